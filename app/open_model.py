"""From what a user typed as MODEL to a loaded engine: names resolve here, in the app.

The engine loads folders (`Engine.load(path)`) and talks to servers it is given
(`RemoteEngine.connect(entry, key)`); which folder `demo`, a catalogue id or a repo id
means, and which server `remote/NAME` means, is the model registry's knowledge.
"""

from __future__ import annotations

REMOTE_PREFIX = "remote/"


def open_engine(spec: str, **options):
    """`Engine.load` options (mode, ctx, budgets, device, threads, cpu_weights, progress);
    a remote model takes only ctx."""
    if str(spec).startswith(REMOTE_PREFIX):  # a model served elsewhere (models add-remote)
        from engine.runtime.remote import RemoteEngine
        from models_registry.remotes import api_key_for, get_remote

        remote = get_remote(str(spec))
        return RemoteEngine.connect(remote, api_key_for(remote), ctx=options.get("ctx"))
    from engine import Engine
    from models_registry.resolve import resolve_model

    return Engine.load(resolve_model(str(spec)), **options)
