"""Talking to the Hugging Face Hub (or a mirror at HF_ENDPOINT) through huggingface_hub.

`fetch_plan` lists a repo at a revision with each file's size and hash (sha256 for LFS
files, the git blob sha1 otherwise) and pins the revision to a commit. Hub errors become
UserErrors that say what to do.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from urllib.parse import quote

from engine.loading.confine import check_relative_name
from engine.errors import UserError

DEFAULT_ENDPOINT = "https://huggingface.co"
EXCLUDED_FILES = ("consolidated*.safetensors", "*.gguf", "original/*", ".gitattributes")


def hub_endpoint(endpoint: str | None = None) -> str:
    """An explicit endpoint, else HF_ENDPOINT read now (not at import), else huggingface.co."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


class OfflineModeOn(UserError):
    """Downloads are switched off here (HF_HUB_OFFLINE, THERMOCLINE_OFFLINE or the saved setting)."""


class HubUnreachable(UserError):
    """The Hub could not be reached: no connection, a name that did not resolve, a timeout."""

    def __init__(self, message: str, *, name_not_resolved: bool = False):
        super().__init__(message)
        self.name_not_resolved = name_not_resolved


_TRUE = {"1", "true", "yes", "on"}


def offline_switch() -> str | None:
    """What switched downloads off ("HF_HUB_OFFLINE", "THERMOCLINE_OFFLINE", "settings"), or None."""
    from .paths import load_settings

    for var in ("HF_HUB_OFFLINE", "THERMOCLINE_OFFLINE"):
        if (os.environ.get(var) or "").strip().lower() in _TRUE:
            return var
    return "settings" if load_settings().get("offline") else None


def is_offline(offline: bool | None = None) -> bool:
    return offline if offline is not None else offline_switch() is not None


def _name_not_resolved(exc: BaseException) -> bool:
    """A DNS failure anywhere in the exception's chain (getaddrinfo's errors are negative errnos)."""
    import socket

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, socket.gaierror):
            return True
        text = str(exc).lower()
        if "name or service not known" in text or "name resolution" in text or "nodename nor servname" in text \
                or "getaddrinfo failed" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files
    git_sha1: str | None  # regular files: the git blob id

    @property
    def expected_hash(self) -> tuple[str, str]:
        return ("sha256", self.sha256) if self.sha256 else ("git-sha1", self.git_sha1 or "")


@dataclass(frozen=True)
class RepoPlan:
    repo: str
    commit: str
    files: tuple[RemoteFile, ...]
    gated: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def names(self) -> list[str]:
        return [f.name for f in self.files]


def file_url(endpoint: str, repo: str, commit: str, filename: str) -> str:
    return f"{endpoint}/{repo}/resolve/{commit}/{quote(filename)}"


def auth_headers(token: str | None) -> dict:
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(token=token or False, library_name="thermocline")
    headers["Accept-Encoding"] = "identity"  # byte offsets must be those of the file for Range
    return headers


def select_files(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """Files matching `patterns`, minus duplicates of the weights in other formats."""
    # asked for by name (*.gguf, or a narrower *.q4.powerinfer.gguf): kept
    excluded = [x for x in EXCLUDED_FILES
                if not any(p == x or (x.startswith("*.") and p.endswith(x[1:])) for p in patterns)]
    chosen = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)
              and not any(fnmatch.fnmatch(n, x) for x in excluded)]
    if any(n.endswith(".safetensors") for n in chosen):
        chosen = [n for n in chosen if not (n.startswith("pytorch_model") and
                                           (n.endswith(".bin") or n.endswith(".bin.index.json")))]
    return chosen


def hub_error(exc: Exception, repo: str, endpoint: str, token: str | None) -> UserError:
    """Turn a huggingface_hub / httpx exception into a message a user can act on."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        how = ("your token has no access: accept the model's terms on its page with the account of the token"
               if token else "no Hugging Face token is set: accept the terms on the model page, then set a "
               "token (HF_TOKEN, `thermocline models download --token ... --save-token`, or the Settings page)")
        return UserError(f"{repo} is a gated repo; {how} ({endpoint}/{repo})")
    if isinstance(exc, errors.RevisionNotFoundError):
        return UserError(f"{repo} has no such revision: {exc.__class__.__name__}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return UserError(f"repo {repo} was not found on {endpoint} (or it is private and the token cannot see it)")
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return OfflineModeOn(f"offline mode is on: cannot reach the Hub to download {repo}")
    if isinstance(exc, errors.HfHubHTTPError):
        code = exc.response.status_code if exc.response is not None else "?"
        return UserError(f"the Hub answered HTTP {code} for {repo}; try again later")
    return HubUnreachable(f"cannot reach the Hub at {endpoint} ({exc.__class__.__name__}: {exc}); "
                          "check the connection, or use offline mode for models already downloaded",
                          name_not_resolved=_name_not_resolved(exc))


def fetch_plan(repo: str, revision: str | None, patterns: tuple[str, ...], *, endpoint: str,
               token: str | None, timeout: float = 30.0) -> RepoPlan:
    """List a repo's files at `revision` (resolved to a commit) that match `patterns`."""
    import httpx2
    from huggingface_hub import HfApi, errors

    api = HfApi(endpoint=endpoint, token=token or False, library_name="thermocline")
    try:
        info = api.model_info(repo, revision=revision or "main", files_metadata=True, timeout=timeout)
    except (errors.HfHubHTTPError, httpx2.HTTPError, OSError) as exc:
        raise hub_error(exc, repo, endpoint, token) from exc
    if not info.sha:
        raise UserError(f"the Hub did not say which commit {repo}@{revision or 'main'} is; cannot pin it")
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    files = []
    for name in select_files(sorted(siblings), patterns):
        # Names from the listing become paths on disk: one that leads out of the model folder
        # (or into our own sidecar) stops the whole download before anything is written.
        check_relative_name(name, f"the Hub's listing of {repo}")
        if name.split("/", 1)[0] == "thermocline":
            raise UserError(f"the Hub's listing of {repo} names {name!r}, inside Thermocline's own "
                            "sidecar folder; refusing to download it")
        s = siblings[name]
        size = s.lfs.size if s.lfs else s.size
        if size is None or int(size) < 0:
            raise UserError(f"the Hub listed {repo}/{name} without a valid size; cannot check the download")
        files.append(RemoteFile(name, int(size), s.lfs.sha256 if s.lfs else None, s.blob_id))
    return RepoPlan(repo=repo, commit=info.sha, files=tuple(files), gated=bool(info.gated))


def check_access(plan: RepoPlan, *, endpoint: str, token: str | None, timeout: float = 30.0) -> None:
    """For a gated repo, ask for one file's metadata (HEAD) so a missing or wrong token is
    reported before anything is planned or written (model_info works without access)."""
    if not plan.gated or not plan.files:
        return
    import httpx2
    from huggingface_hub import errors, get_hf_file_metadata

    url = file_url(endpoint, plan.repo, plan.commit, plan.files[0].name)
    try:
        get_hf_file_metadata(url, token=token or False, timeout=timeout, endpoint=endpoint)
    except (errors.HfHubHTTPError, httpx2.HTTPError, OSError) as exc:
        raise hub_error(exc, plan.repo, endpoint, token) from exc
