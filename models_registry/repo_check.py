"""Check a model the user wants to add, before any weights are downloaded.

For a Hugging Face repo only config.json is fetched (verified against its git blob id);
for a local folder it is read. Either is refused with a message naming what is supported,
or described: architecture, activation, size and, given a hardware probe, the fit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

from .arch import ArchInfo, detect_architecture
from .catalogue import DEFAULT_MODEL_FILES, find_entry
from .hub import OfflineModeOn, auth_headers, check_access, fetch_plan, file_url, hub_endpoint, hub_error, is_offline
from .token import get_token


@dataclass
class ModelCheck:
    source: str  # the repo id or folder
    commit: str | None
    arch: ArchInfo
    config: dict
    size_bytes: int  # weights and tokenizer files to download (or on disk)
    gated: bool
    fit: dict | None = None

    def to_dict(self) -> dict:
        return {"source": self.source, "commit": self.commit, "family": self.arch.family,
                "model_type": self.arch.model_type, "activation": self.arch.activation,
                "size_bytes": self.size_bytes, "gated": self.gated, "fit": self.fit}


def _fit(config: dict, arch: ArchInfo, hardware, ctx: int, model_dir: Path | None) -> dict | None:
    if hardware is None:
        return None
    from .fit import estimate_fit

    est = estimate_fit(config, ctx=ctx, hardware=hardware, model_dir=model_dir, known_activation=arch.activation)
    return {"verdict": est.verdict, "reason": est.reason, "suggested_vram_budget": est.suggested_vram_budget,
            "suggested_ram_budget": est.suggested_ram_budget}


def check_repo(repo: str, *, revision: str | None = None, endpoint: str | None = None, token: str | None = None,
               hardware=None, ctx: int = 2048, timeout: float = 30.0) -> ModelCheck:
    """Fetch only config.json of `repo` and say whether Thermocline can run it."""
    from huggingface_hub import errors
    from huggingface_hub.utils import get_session, hf_raise_for_status

    if is_offline():
        raise OfflineModeOn(f"offline mode: cannot look at {repo} on the Hub")
    entry = find_entry(repo)
    endpoint, token = hub_endpoint(endpoint), token or get_token()
    plan = fetch_plan(repo, revision, entry.files if entry else DEFAULT_MODEL_FILES, endpoint=endpoint, token=token)
    check_access(plan, endpoint=endpoint, token=token)
    remote = {f.name: f for f in plan.files}.get("config.json")
    if remote is None:
        raise UserError(f"{repo} has no config.json: not a transformers model repo")
    try:
        response = get_session().get(file_url(endpoint, repo, plan.commit, "config.json"),
                                     headers=auth_headers(token), timeout=timeout, follow_redirects=True)
        hf_raise_for_status(response)
    except errors.HfHubHTTPError as exc:
        raise hub_error(exc, repo, endpoint, token) from exc
    data = response.content
    if remote.git_sha1 and hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != remote.git_sha1:
        raise UserError(f"config.json of {repo} arrived damaged; try again")
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise UserError(f"config.json of {repo} is not valid JSON: {exc}") from exc
    arch = detect_architecture(config, entry.activation if entry else None)
    return ModelCheck(repo, plan.commit, arch, config, plan.total_bytes, plan.gated,
                      _fit(config, arch, hardware, ctx, None))


def check_folder(folder: str | Path, *, hardware=None, ctx: int = 2048) -> ModelCheck:
    """Read a local folder's config.json and say whether Thermocline can run it."""
    folder = Path(folder).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{folder} is not a model folder: it has no config.json") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {folder}/config.json: {exc}") from exc
    arch = detect_architecture(config)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return ModelCheck(str(folder), None, arch, config, size, False, _fit(config, arch, hardware, ctx, folder))
