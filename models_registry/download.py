"""Download a model (and its PowerInfer predictor repo) into the models folder.

Order of work: pin the revision to a commit; fetch config.json and refuse unsupported
architectures before any weights; check free disk; fetch every file resumably into
`thermocline/partial/`, verify it against the Hub's sha256 (LFS) or git blob id, move it
into place; then hand the predictor folder to `on_predictors_downloaded(src, model_dir)`
(the CLI passes `engine.loading.predictor_import.import_powerinfer_predictors`). A file whose hash does
not match is reported with a `corrupt` event, removed and fetched again; a second mismatch
stops the download with an error. The model is marked ready only when every file checked.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.loading.confine import confined
from engine.errors import UserError
from engine.units import format_size

from .arch import detect_architecture
from .catalogue import DEFAULT_MODEL_FILES, CatalogueEntry, find_entry
from .hardware import free_disk
from .hub import (
    OfflineModeOn, RemoteFile, RepoPlan, auth_headers, check_access, fetch_plan, file_url, hub_endpoint, hub_error,
    is_offline,
)
from .gguf_fetch import choose_gguf, import_gguf_predictors_from_hub
from .gguf_weights import import_bytes, import_weights_gguf, weights_gguf_plan
from .paths import models_dir, repo_folder_name
from .pickles import convert_pickles, is_pickle_weight
from .progress import DownloadControl, ProgressMeter
from .resolve import DEMO_ID, is_repo_id
from .state import SIDECAR, read_state, write_state
from .token import get_token
from .transfer import fetch_file, hash_file

PREDICTOR_SUBDIR = "powerinfer-predictor"
PARTIAL_SUBDIR = "partial"
DISK_MARGIN_MIN = 64 * 1024**2  # room for the state file, the imported predictors, the filesystem
DISK_MARGIN_FRACTION = 0.01


class IntegrityError(UserError):
    """A file did not match the Hub's hash twice in a row."""


@dataclass
class DownloadResult:
    model_dir: Path
    repo: str
    revision: str
    files: list[str]
    bytes_total: int
    bytes_fetched: int  # this run; less than the total after a resume or when cached
    from_cache: bool = False
    predictors: str = "none"  # none | train | downloaded | imported
    corrupt_refetched: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model_dir": str(self.model_dir), "repo": self.repo, "revision": self.revision,
                "files": self.files, "bytes_total": self.bytes_total, "bytes_fetched": self.bytes_fetched,
                "from_cache": self.from_cache, "predictors": self.predictors,
                "corrupt_refetched": self.corrupt_refetched}


def _entry_for(name: str) -> tuple[str, CatalogueEntry | None]:
    if name == DEMO_ID:
        raise UserError("the demo model ships with Thermocline; there is nothing to download")
    entry = find_entry(name)
    if entry is not None:
        return entry.repo, entry
    if not is_repo_id(name):
        raise UserError(f"cannot download {name!r}: give a catalogue id (see `thermocline models list`) "
                        "or a Hugging Face repo id like org/name")
    return name, None


def _files_intact(model_dir: Path, state: dict) -> bool:
    """Cheap check of a ready model: every recorded file present with its size."""
    for rel, meta in (state.get("files") or {}).items():
        path = model_dir / rel
        if not path.is_file() or path.stat().st_size != meta.get("size"):
            return False
    return True


class _Job:
    """One download run: the plans, the state file, the meter and the transfers."""

    def __init__(self, model_dir: Path, endpoint: str, token: str | None, meter: ProgressMeter,
                 control: DownloadControl, state: dict, transfer_opts: dict) -> None:
        self.model_dir = model_dir
        self.endpoint = endpoint
        self.token = token
        self.headers = auth_headers(token)
        self.meter = meter
        self.control = control
        self.state = state
        self.transfer_opts = transfer_opts
        self.fetched = 0
        self.corrupt: list[str] = []

    def already_have(self, rel: str, remote: RemoteFile) -> int:
        """Bytes of `remote` already on disk (a verified final file counts whole)."""
        final = self.model_dir / rel
        if self._verified(rel, remote) and final.is_file() and final.stat().st_size == remote.size:
            return remote.size
        part = self.partial(rel)
        return min(part.stat().st_size, remote.size) if part.is_file() else 0

    def _verified(self, rel: str, remote: RemoteFile) -> bool:
        meta = (self.state.get("files") or {}).get(rel)
        return bool(meta) and meta.get("hash") == list(remote.expected_hash) and meta.get("verified")

    def partial(self, rel: str) -> Path:
        return self.model_dir / SIDECAR / PARTIAL_SUBDIR / (rel + ".part")

    def save_state(self) -> None:
        write_state(self.model_dir, self.state)

    def get(self, plan: RepoPlan, remote: RemoteFile, rel: str) -> None:
        """Make `model_dir/rel` the verified content of `remote`."""
        final = self.model_dir / rel
        kind, expected = remote.expected_hash
        if final.is_file() and final.stat().st_size == remote.size:
            if self._verified(rel, remote):
                self.meter.start_file(rel, remote.size, remote.size)
                self.meter.end_file("already downloaded and verified")
                return
            if hash_file(final, kind, remote.size).hexdigest() == expected:
                self._record(rel, remote)
                self.meter.start_file(rel, remote.size, remote.size)
                self.meter.end_file("already present; hash checked")
                return
        if final.exists():
            # A wrong file in place (damaged copy, other revision): say so, then fetch it anew.
            self.meter.emit("corrupt", rel, message=f"{rel} on disk does not match the Hub's {kind}; fetching it again")
            self.corrupt.append(rel)
            final.unlink()
        url = file_url(self.endpoint, plan.repo, plan.commit, remote.name)
        part = self.partial(rel)
        for attempt in (1, 2):
            before = self.meter.transferred
            digest = fetch_file(url, part, remote, headers=self.headers, meter=self.meter,
                                control=self.control, **self.transfer_opts)
            self.fetched += self.meter.transferred - before
            if digest == expected:
                break
            self.meter.discard(remote.size)  # these bytes do not count: they are fetched again
            self.meter.emit("corrupt", rel, message=(
                f"{rel}: {kind} {digest[:12]}… does not match the Hub's {expected[:12]}…; "
                + ("removing it and fetching it again" if attempt == 1 else "giving up")))
            self.corrupt.append(rel)
            part.unlink()
            if attempt == 2:
                raise IntegrityError(
                    f"{plan.repo}/{remote.name} arrived damaged twice (expected {kind} {expected}, got {digest}); "
                    "the damaged copy was removed; try again later or check the network/proxy"
                )
        final.parent.mkdir(parents=True, exist_ok=True)
        part.replace(final)
        self._record(rel, remote)
        self.meter.end_file("verified")

    def _record(self, rel: str, remote: RemoteFile) -> None:
        self.state.setdefault("files", {})[rel] = {
            "size": remote.size, "hash": list(remote.expected_hash), "verified": True}
        self.save_state()


def download_model(
    name: str,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    progress: Callable | None = None,
    control: DownloadControl | None = None,
    offline: bool | None = None,
    with_predictors: bool = True,
    on_predictors_downloaded: Callable[[Path, Path], None] | None = None,
    convert_pickles: Callable[[Path], dict] | None = None,
    root: Path | None = None,
    stall_timeout: float = 30.0,
    max_retries: int = 5,
    retry_delay: float = 1.0,
) -> DownloadResult:
    """Download `name` (catalogue id or org/name) and return where it is.

    Blocking: the app runs it on a worker thread. `progress(DownloadEvent)` is called on that
    thread with the events of `models_registry.progress` (an exception raised there stops the
    download like a crash: partial files stay); `control` pauses or cancels from any thread.
    Offline, a ready model is returned from disk and anything else is refused.
    """
    repo, entry = _entry_for(name.strip())
    endpoint = hub_endpoint(endpoint)
    token = token or get_token()
    control = control or DownloadControl()
    if not is_repo_id(repo):  # a catalogue entry's repo becomes a folder name too
        raise UserError(f"the catalogue's repo {repo!r} for {name} is not an org/name repo id")
    model_dir = confined(Path(root or models_dir()), repo_folder_name(repo), "the catalogue")
    state = read_state(model_dir) or {}

    if is_offline(offline):
        if state.get("status") == "ready" and _files_intact(model_dir, state):
            ProgressMeter(repo, 0, progress).emit("done", message="offline: using the downloaded copy")
            return _result_from_state(model_dir, repo, state, from_cache=True)
        raise OfflineModeOn(f"offline mode: {name} is not downloaded, or incomplete; "
                        "turn offline mode off (HF_HUB_OFFLINE / Settings) to download it")
    if state.get("status") == "ready" and _files_intact(model_dir, state) and (
            revision is None or revision == state.get("revision")) and not (
            with_predictors and state.get("predictors") == "downloaded" and on_predictors_downloaded) and not (
            with_predictors and entry is not None and entry.predictor.source == "gguf"
            and state.get("predictors") != "imported"):
        ProgressMeter(repo, 0, progress).emit("done", message="already downloaded")
        return _result_from_state(model_dir, repo, state, from_cache=True)

    created = not model_dir.exists()
    pinned = revision or (state.get("revision") if state.get("status") == "downloading" else None) \
        or (entry.revision if entry else None)
    patterns = entry.files if entry else DEFAULT_MODEL_FILES
    plan = fetch_plan(repo, pinned, patterns, endpoint=endpoint, token=token)
    check_access(plan, endpoint=endpoint, token=token)
    gguf_weights = entry is not None and entry.gguf_weights
    if gguf_weights:  # one GGUF, imported into the folder once fetched (gguf_weights.py)
        plan = weights_gguf_plan(plan)
    if state.get("revision") and state["revision"] != plan.commit:
        # Another commit: partial files may be prefixes of other contents. Verified files stay
        # recorded by hash, so those that did not change are not fetched again.
        shutil.rmtree(model_dir / SIDECAR / PARTIAL_SUBDIR, ignore_errors=True)
    names = plan.names()
    if not gguf_weights and "config.json" not in names:
        raise UserError(f"{repo} has no config.json at {plan.commit[:12]}: not a transformers model repo")
    if not gguf_weights and not any(n.endswith(".safetensors") or n.endswith(".bin") for n in names):
        raise UserError(f"{repo} has no weights in safetensors (or PyTorch .bin) format")

    pred_plan = None
    predictors = "none"
    if entry is not None and entry.predictor.source in ("train", "checkpoint"):
        predictors = entry.predictor.source  # checkpoint: the engine copies them out at the first load
    if with_predictors and entry is not None and entry.predictor.source == "powerinfer":
        pinned_pred = (state.get("predictor") or {}).get("revision") or entry.predictor.revision
        pred_plan = fetch_plan(entry.predictor.repo, pinned_pred, entry.predictor.files,
                               endpoint=endpoint, token=token)
        check_access(pred_plan, endpoint=endpoint, token=token)
        if not any(n.startswith("model_") and n.endswith(".pt") for n in pred_plan.names()):
            raise UserError(f"{entry.predictor.repo} has no model_N.pt predictor files")
    gguf_plan = None
    if with_predictors and entry is not None and entry.predictor.source == "gguf":
        # Only the predictor tensors of this GGUF are fetched, after the model (gguf_fetch.py).
        gguf_plan = fetch_plan(entry.predictor.repo, entry.predictor.revision, entry.predictor.files,
                               endpoint=endpoint, token=token)
        check_access(gguf_plan, endpoint=endpoint, token=token)
        choose_gguf(gguf_plan)  # refuse a repo without one before any weights move

    jobs = [(plan, f.name, f) for f in plan.files]
    if pred_plan is not None:
        jobs += [(pred_plan, f"{SIDECAR}/{PREDICTOR_SUBDIR}/{f.name}", f) for f in pred_plan.files]
    # Pickles converted by an earlier run are not fetched again.
    converted = state.get("converted") or {}
    jobs = [j for j in jobs if not (j[1] in converted and (model_dir / converted[j[1]]).is_file())]
    # config.json first: the architecture is checked before any weights move.
    jobs.sort(key=lambda job: (job[1] != "config.json", job[1]))
    for repo_plan, rel, _ in jobs:  # every target checked before the first byte is written
        confined(model_dir, rel, f"the Hub's listing of {repo_plan.repo}")

    state.update(status="downloading", repo=repo, revision=plan.commit, endpoint=endpoint,
                 catalogue_id=entry.id if entry else None, started=state.get("started") or time.time())
    if not gguf_weights:  # the pinned revision's whole list: `verify` names what is missing (a GGUF is imported, not kept)
        state["planned"] = {rel: {"size": f.size, "hash": list(f.expected_hash)}
                            for repo_plan, rel, f in jobs if repo_plan is plan}  # predictors become a sidecar
    if pred_plan is not None:
        state["predictor"] = {"repo": pred_plan.repo, "revision": pred_plan.commit}
    if entry is not None:  # read by engine.config when config.json names no activation (old Falcon)
        state["activation"] = entry.activation
    if entry is not None and entry.chat_format:  # the tokenizer's template when the repo has none
        state.update(chat_format=entry.chat_format, chat_model=entry.chat)
    total = sum(f.size for _, _, f in jobs)
    state["size_bytes"] = plan.total_bytes  # the Hub's listing, known before any byte moves
    meter = ProgressMeter(repo, total, progress)
    job = _Job(model_dir, endpoint, token, meter, control, state,
               dict(stall_timeout=stall_timeout, max_retries=max_retries, retry_delay=retry_delay))

    remaining = sum(f.size - job.already_have(rel, f) for _, rel, f in jobs)
    gguf_out = import_bytes(endpoint, plan, headers=job.headers) if gguf_weights and jobs else 0
    need = disk_need(remaining, plan, pred_plan if on_predictors_downloaded else None, gguf_out)
    disk_path, free = free_disk(model_dir)
    if free is not None and need > free:
        raise UserError(f"not enough free disk for {repo}: it needs {format_size(need)} more and "
                        f"{disk_path} has {format_size(free)} free; free some space or choose another "
                        "models folder (Settings, or THERMOCLINE_MODELS_DIR)")

    job.save_state()  # the listing shows the Hub's size from now on
    meter.emit("plan", message=f"{len(jobs)} files, {format_size(total)}, {format_size(remaining)} to fetch")
    with _DownloadLock(model_dir):  # the import too: a second download must not fetch into it
        _fetch_all(job, jobs, entry, created, model_dir, endpoint, token)
        if gguf_weights and jobs:
            meter.emit("convert", message=f"importing {jobs[0][1]}")
            # A refused import keeps the verified GGUF and its record: a retry imports it again.
            import_weights_gguf(model_dir, job.state, jobs[0][1], entry.activation, save_state=job.save_state)
    result = _finish(job, plan, pred_plan, predictors, on_predictors_downloaded, meter, names, jobs, convert_pickles)
    if gguf_plan is not None:
        info = import_gguf_predictors_from_hub(job.endpoint, gguf_plan, model_dir, headers=job.headers,
                                               importer=on_predictors_downloaded, progress=progress, control=control)
        job.state.update(predictors="imported", predictor=info)
        job.save_state()
        result.predictors = "imported"
    return result


def disk_need(fetch_bytes: int, plan: RepoPlan, imported_pred_plan: RepoPlan | None, gguf_import_bytes: int) -> int:
    """Free disk a download needs: what it still fetches, what its imports write while the
    source is still there, and a margin. The one rule of download_model and planned_disk."""
    # The predictor import writes predictors.safetensors next to the downloaded model_N.pt.
    imported_copy = imported_pred_plan.total_bytes if imported_pred_plan is not None else 0
    # pytorch_model*.bin shards become safetensors one at a time: one shard's copy at once.
    imported_copy += max((f.size for f in plan.files if is_pickle_weight(f.name)), default=0)
    # A GGUF's import (gguf_weights.import_bytes, from its header) is written before the GGUF goes.
    imported_copy += gguf_import_bytes
    return fetch_bytes + imported_copy + max(DISK_MARGIN_MIN, int(DISK_MARGIN_FRACTION * fetch_bytes))


def planned_disk(name: str, *, endpoint: str | None = None, token: str | None = None,
                 with_predictors: bool = True) -> dict:
    """{"bytes": what a download of `name` fetches, "disk_need": the free disk it needs (disk_need),
    "model_bytes": what the folder holds once done}, from the Hub's listing and, for a GGUF,
    its header (range requests); no weights are fetched."""
    repo, entry = _entry_for(name.strip())
    endpoint, token = hub_endpoint(endpoint), token or get_token()
    plan = fetch_plan(repo, entry.revision if entry else None, entry.files if entry else DEFAULT_MODEL_FILES,
                      endpoint=endpoint, token=token)
    gguf_out = 0
    if entry is not None and entry.gguf_weights:
        plan = weights_gguf_plan(plan)
        gguf_out = import_bytes(endpoint, plan, headers=auth_headers(token))
    total, pred_plan = plan.total_bytes, None
    if with_predictors and entry is not None and entry.predictor.repo and entry.predictor.source == "powerinfer":
        pred_plan = fetch_plan(entry.predictor.repo, entry.predictor.revision, entry.predictor.files,
                               endpoint=endpoint, token=token)
        total += pred_plan.total_bytes
    need = disk_need(total, plan, pred_plan, gguf_out)
    model_bytes = gguf_out if gguf_out else total
    return {"bytes": total, "disk_need": need, "model_bytes": model_bytes}


def _fetch_all(job: _Job, jobs: list, entry: CatalogueEntry | None, created: bool, model_dir: Path,
               endpoint: str, token: str | None) -> None:
    from huggingface_hub import errors as hub_errors

    try:
        for repo_plan, rel, remote in jobs:
            try:
                job.get(repo_plan, remote, rel)
            except hub_errors.HfHubHTTPError as exc:
                raise hub_error(exc, repo_plan.repo, endpoint, token) from exc
            if rel == "config.json":
                _check_config(model_dir / rel, entry, created, model_dir)
            job.save_state()
    except UserError:
        if model_dir.exists():  # gone when the architecture was refused
            job.save_state()
        raise


def _finish(job: _Job, plan: RepoPlan, pred_plan: RepoPlan | None, predictors: str, on_predictors_downloaded,
            meter: ProgressMeter, names: list[str], jobs: list, convert=None) -> DownloadResult:
    """Mark the model ready, then hand the predictor folder over for import."""
    state, model_dir = job.state, job.model_dir
    wanted = {rel for _, rel, _ in jobs}  # forget files of an earlier revision that are gone
    state["files"] = {rel: meta for rel, meta in state.get("files", {}).items()
                      if rel in wanted or meta.get("converted")}
    state["status"] = "ready"
    state["size_bytes"] = plan.total_bytes
    if not str(state.get("weights_format", "")).startswith("gguf"):  # an imported GGUF says so itself
        state["weights_format"] = "safetensors" if any(n.endswith(".safetensors") for n in names) else (
            "safetensors (converted from pytorch-bin)" if state.get("converted") else "pytorch-bin")
    if any(is_pickle_weight(n) for n in names):
        meter.emit("convert", message="converting the PyTorch checkpoint to safetensors")
        convert_pickles(model_dir, state, convert, origin=plan.repo)  # refused: the folder is gone
    state["finished"] = time.time()
    if pred_plan is not None:
        state["predictors"] = "downloaded"
    elif predictors != "none":
        state["predictors"] = predictors
    job.save_state()

    if pred_plan is not None and on_predictors_downloaded is not None:
        src = model_dir / SIDECAR / PREDICTOR_SUBDIR
        on_predictors_downloaded(src, model_dir)
        # The import wrote thermocline/predictors.safetensors; the .pt files would only double
        # the disk use (gigabytes for 70B), so they go, and the state stops listing them.
        prefix = f"{SIDECAR}/{PREDICTOR_SUBDIR}/"
        state["files"] = {rel: meta for rel, meta in state["files"].items() if not rel.startswith(prefix)}
        state["predictors"] = "imported"
        job.save_state()
        shutil.rmtree(src, ignore_errors=True)
        meter.emit("predictors", message=f"imported predictors from {pred_plan.repo}")
    meter.emit("done", message=f"{plan.repo} ready at {model_dir}")
    result = _result_from_state(model_dir, plan.repo, state, from_cache=False)
    result.bytes_fetched = job.fetched
    result.corrupt_refetched = job.corrupt
    return result


class _DownloadLock:
    """One download per model folder at a time (the window and a terminal could both try).

    `<model>/thermocline/download.lock` holds the owner's pid; a lock whose process is gone
    (a crash) is taken over.
    """

    _in_process: set[str] = set()  # the pid file cannot tell two threads of this process apart
    _guard = threading.Lock()

    def __init__(self, model_dir: Path) -> None:
        self.path = model_dir / SIDECAR / "download.lock"
        self.name = model_dir.name.replace("--", "/", 1)

    def __enter__(self):
        with self._guard:
            if str(self.path) in self._in_process:
                raise UserError(f"{self.name} is already being downloaded in this window; wait for it or cancel it")
            self._in_process.add(str(self.path))
        try:
            return self._take_file_lock()
        except BaseException:
            with self._guard:
                self._in_process.discard(str(self.path))
            raise

    def _take_file_lock(self):
        import psutil

        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    owner = 0
                if owner and owner != os.getpid() and psutil.pid_exists(owner):
                    raise UserError(f"{self.name} is already being downloaded by process {owner}; "
                                    "wait for it or cancel it") from None
                self.path.unlink(missing_ok=True)  # left by a crashed download
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return self
        raise UserError(f"cannot lock {self.path} for the download")

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)
        with self._guard:
            self._in_process.discard(str(self.path))


def _check_config(path: Path, entry: CatalogueEntry | None, created: bool, model_dir: Path) -> None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        detect_architecture(config, entry.activation if entry else None)
    except (ValueError, UserError) as exc:
        if created:
            shutil.rmtree(model_dir, ignore_errors=True)  # nothing of value was fetched yet
        raise UserError(f"refusing to download {model_dir.name.replace('--', '/', 1)}: {exc}") from exc


def _result_from_state(model_dir: Path, repo: str, state: dict, from_cache: bool) -> DownloadResult:
    files = sorted(state.get("files") or {})
    total = sum(meta.get("size", 0) for meta in (state.get("files") or {}).values())
    return DownloadResult(model_dir=model_dir, repo=repo, revision=state.get("revision", ""), files=files,
                          bytes_total=total, bytes_fetched=0, from_cache=from_cache,
                          predictors=state.get("predictors", "none"))


@dataclass
class VerifyReport:
    missing: list[str]  # files of the pinned revision that are not on disk
    different: list[str]  # on disk, but not the Hub's size or hash

    @property
    def bad(self) -> list[str]:
        return sorted(self.missing + self.different)


def verify_files(model_dir: Path) -> VerifyReport:
    """Re-hash every file of the pinned revision (the full list recorded when the download
    began, not only the files that arrived): which are missing, which differ.

    Damaged or missing files are un-marked (the model goes back to "downloading"), never
    deleted here: the next download reports and re-fetches them.
    """
    state = read_state(model_dir)
    if not state or not (state.get("files") or state.get("planned")):
        raise UserError(f"{model_dir} has no download record to verify against")
    recorded = state.get("files") or {}
    if "planned" not in state and state.get("status") != "ready":
        raise UserError(f"the download into {model_dir} did not finish; run `thermocline models download` "
                        "again to complete it")
    expected = {**recorded, **(state.get("planned") or {})}  # the Hub's word wins
    converted = state.get("converted") or {}
    missing, different = [], []
    for rel, meta in sorted(expected.items()):
        if rel in converted and (Path(model_dir) / converted[rel]).is_file():
            continue  # a pickle turned into safetensors: the converted file is checked instead
        path = Path(model_dir) / rel
        if not path.is_file():
            missing.append(rel)
        elif not meta.get("hash"):
            continue  # imported from a local folder: there is no Hub hash to compare with
        elif path.stat().st_size != meta["size"] or hash_file(path, meta["hash"][0], meta["size"]).hexdigest() \
                != meta["hash"][1]:
            different.append(rel)
        else:
            continue
        if rel in recorded:
            recorded[rel]["verified"] = False
    if missing or different:
        state["status"] = "downloading"
        write_state(model_dir, state)
    return VerifyReport(missing, different)


def verify_model(model_dir: Path) -> list[str]:
    """The files of `verify_files` that are missing or differ, by name."""
    return verify_files(model_dir).bad


__all__ = ["DownloadResult", "IntegrityError", "VerifyReport", "disk_need", "download_model", "planned_disk",
           "verify_files", "verify_model"]
