"""Remote models: OpenAI-compatible servers (vLLM, llama.cpp's server, Ollama, another
Thermocline) used as the model id `remote/NAME`.

Entries live in the registry's settings file under "remotes": the URL, the model id the
server knows, and the *name* of the environment variable that holds the API key. The key
itself is never stored here; it comes from that variable or the OS keyring at use time.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from engine.errors import UserError

from .paths import load_settings, save_setting

PREFIX = "remote/"
KEYRING_SERVICE = "thermocline"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class RemoteModel:
    name: str
    url: str                       # base URL of the OpenAI API, ending in /v1 (or the server's own prefix)
    model: str | None = None       # the id the server knows; None: the server's first model
    api_key_env: str | None = None  # environment variable holding the key

    @property
    def id(self) -> str:
        return PREFIX + self.name

    def to_dict(self) -> dict:
        return dict(asdict(self), id=self.id)


def is_remote(spec: str) -> bool:
    return str(spec).startswith(PREFIX)


def normalize_url(url: str) -> str:
    """`http://host:8000` -> `http://host:8000/v1`; a URL with a path is kept as given."""
    text = url.strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"{url!r} is not an http(s) URL; give one like http://host:8000/v1")
    if parts.username or parts.password:
        raise UserError("put the API key in an environment variable (--api-key-env), not in the URL")
    if parts.query or parts.fragment:
        raise UserError(f"{url!r} has a query or fragment; give the server's base URL like http://host:8000/v1")
    return text if parts.path not in ("", "/") else text + "/v1"


def _entries() -> dict:
    data = load_settings().get("remotes")
    return data if isinstance(data, dict) else {}


def list_remotes() -> list[RemoteModel]:
    out = []
    for name, raw in sorted(_entries().items()):
        if isinstance(raw, dict) and isinstance(raw.get("url"), str) and _NAME.match(name):
            out.append(RemoteModel(name, raw["url"], raw.get("model") or None, raw.get("api_key_env") or None))
    return out


def get_remote(spec: str) -> RemoteModel:
    name = spec[len(PREFIX):] if is_remote(spec) else spec
    for remote in list_remotes():
        if remote.name == name:
            return remote
    raise UserError(f"no remote model named {name!r}: add it with "
                    f"`thermocline models add-remote {name} --url URL`")


def add_remote(name: str, url: str, model: str | None = None, api_key_env: str | None = None) -> RemoteModel:
    if not _NAME.match(name or ""):
        raise UserError(f"remote name {name!r} must be letters, digits, '.', '_' or '-' (at most 64)")
    if api_key_env is not None and not _ENV.match(api_key_env):
        raise UserError(f"{api_key_env!r} is not an environment variable name")
    if model is not None and not model.strip():
        model = None
    remote = RemoteModel(name, normalize_url(url), model, api_key_env)
    entries = _entries()
    entries[name] = {k: v for k, v in asdict(remote).items() if k != "name" and v is not None}
    save_setting("remotes", entries)
    return remote


def remove_remote(spec: str) -> RemoteModel:
    remote = get_remote(spec)
    entries = _entries()
    entries.pop(remote.name, None)
    save_setting("remotes", entries or None)
    return remote


def api_key_for(remote: RemoteModel) -> str | None:
    """The key from the named environment variable, else from the OS keyring (when one is installed)."""
    import os

    if remote.api_key_env and os.environ.get(remote.api_key_env):
        return os.environ[remote.api_key_env]
    try:
        import keyring
    except ImportError:
        return None
    try:
        return keyring.get_password(KEYRING_SERVICE, remote.id) or None
    except Exception:  # noqa: BLE001 - no usable keyring backend: behave as if none is installed
        return None


def store_key_in_keyring(remote: RemoteModel, key: str) -> None:
    """Keep a key in the OS keyring (never in a file of ours); UserError when there is no keyring."""
    try:
        import keyring
        keyring.set_password(KEYRING_SERVICE, remote.id, key)
    except ImportError:
        raise UserError("no OS keyring is available (pip install keyring): put the key in an environment "
                        "variable and pass its name with --api-key-env") from None
    except Exception as exc:  # noqa: BLE001 - keyring backends raise their own types
        raise UserError(f"the OS keyring refused the key ({exc}); use --api-key-env instead") from None
