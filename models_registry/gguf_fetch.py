"""Fetch only the activation predictors out of a PowerInfer GGUF on the Hub.

PowerInfer's GGUFs (magic `PWRI`: a GGUF whose first four bytes were overwritten) hold the
whole model plus per-layer predictors `blk.N.fc1.weight` / `blk.N.fc2.weight` and the
`powerinfer.sparse_threshold` key. We need the predictors only, a few percent of the file,
so the header is read with HTTP range requests (growing until it parses), then the byte
spans of the predictor tensors. They land in a sparse local file of the GGUF's size (only
the fetched spans use disk), which the `gguf` package reads like the original; the engine
turns it into our predictor sidecar. A server that ignores ranges gets the whole file,
checked against the Hub's hash.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from engine.errors import UserError

from engine.units import format_size

from .hub import RemoteFile, RepoPlan, file_url
from .progress import DownloadControl, ProgressMeter
from .state import SIDECAR
from .transfer import fetch_file

PREDICTOR_TENSOR = re.compile(r"^blk\.(\d+)\.fc([12])(?:\.weight)?$")
MAGICS = (b"GGUF", b"PWRI")
FIRST_HEADER_BYTES = 1 << 20
MAX_HEADER_BYTES = 256 << 20  # a vocabulary of a few hundred thousand tokens fits well below
GGUF_SUBDIR = "gguf-predictor"  # <model>/thermocline/: the sparse working copy, gone after the import


def choose_gguf(plan: RepoPlan) -> RemoteFile:
    """The GGUF to read predictors from: an fp16 one if listed (predictors unquantised), else the first."""
    ggufs = [f for f in plan.files if f.name.endswith(".gguf")]
    if not ggufs:
        raise UserError(f"{plan.repo} has no .gguf file")
    return next((f for f in ggufs if re.search(r"(?i)(^|[^a-z0-9])f(p)?16", f.name)), sorted(ggufs, key=lambda f: f.name)[0])


def _get_range(session, url: str, headers: dict, start: int, end: int, timeout: float) -> bytes | None:
    """Bytes [start, end) of `url`, or None when the server answers with the whole file."""
    from huggingface_hub.utils import hf_raise_for_status

    with session.stream("GET", url, headers=dict(headers, Range=f"bytes={start}-{end - 1}"), timeout=timeout,
                        follow_redirects=True) as response:
        if response.status_code == 200:
            return None
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        data = b"".join(response.iter_bytes())
    if response.status_code != 206 or len(data) != end - start:
        raise UserError(f"the server sent {len(data)} bytes for a range of {end - start}; try again later")
    return data


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _parse(path: Path, have: int):
    """A GGUFReader over `path` when its first `have` bytes hold the whole header, else None."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, MemoryError):
        return None
    return reader if reader.data_offset <= have else None


def read_header(session, url: str, plan: RepoPlan, remote: RemoteFile, dest: Path, *, headers: dict,
                meter: ProgressMeter, control: DownloadControl, timeout: float = 30.0):
    """Range-read the GGUF's header into `dest` (a sparse file of the GGUF's size, magic GGUF),
    growing the span until it parses: (GGUFReader, bytes read, the file's magic), or None when
    the server ignores ranges."""
    with open(dest, "wb") as f:
        f.truncate(remote.size)  # sparse: unfetched spans take no disk
    have, reader, magic = 0, None, b""
    want = FIRST_HEADER_BYTES
    while reader is None:
        want = min(want, remote.size)
        control.checkpoint(lambda: None, lambda: None)
        data = _get_range(session, url, headers, have, want, timeout)
        if data is None:
            return None
        magic = magic or data[:4]
        if magic not in MAGICS:
            raise UserError(f"{plan.repo}/{remote.name} is not a GGUF file (magic {magic!r})")
        _write_at(dest, have, b"GGUF" + data[4:] if have == 0 else data)
        meter.add(len(data))
        have = want
        reader = _parse(dest, have)
        if reader is None and (have >= remote.size or have >= MAX_HEADER_BYTES):
            raise UserError(f"cannot read the header of {plan.repo}/{remote.name}: not a GGUF file")
        want *= 4
    return reader, have, magic


def fetch_gguf_predictors(endpoint: str, plan: RepoPlan, remote: RemoteFile, dest: Path, *, headers: dict,
                          meter: ProgressMeter, control: DownloadControl, timeout: float = 30.0) -> dict:
    """Make `dest` a local GGUF (magic GGUF) holding at least the header and the predictor tensors."""
    from huggingface_hub.utils import get_session

    url = file_url(endpoint, plan.repo, plan.commit, remote.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    session = get_session()
    header = read_header(session, url, plan, remote, dest, headers=headers, meter=meter, control=control,
                         timeout=timeout)
    if header is None:  # no range support: the whole file, checked against the Hub's hash
        return _fetch_whole(url, dest, remote, headers, meter, control)
    reader, have, magic = header
    fetched = have
    spans = sorted((t.data_offset, t.data_offset + int(t.n_bytes)) for t in reader.tensors
                   if PREDICTOR_TENSOR.match(t.name))
    if not spans:
        raise UserError(f"{plan.repo}/{remote.name} holds no blk.N.fc1/fc2 predictor tensors")
    merged: list[list[int]] = []
    for start, end in spans:  # fc1 and fc2 of a layer usually sit side by side: one request
        if merged and start - merged[-1][1] <= 64 * 1024:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    del reader
    for start, end in merged:
        start = max(start, have)
        if start >= end:
            continue
        control.checkpoint(lambda: None, lambda: None)
        data = _get_range(session, url, headers, start, end, timeout)
        if data is None:
            return _fetch_whole(url, dest, remote, headers, meter, control)
        _write_at(dest, start, data)
        fetched += len(data)
        meter.add(len(data))
    return {"file": remote.name, "bytes_fetched": fetched, "file_size": remote.size, "tensors": len(spans),
            "magic": magic.decode("ascii", "replace"), "ranged": True}


def _fetch_whole(url: str, dest: Path, remote: RemoteFile, headers: dict, meter: ProgressMeter,
                 control: DownloadControl) -> dict:
    part = dest.with_name(dest.name + ".part")
    part.unlink(missing_ok=True)
    digest = fetch_file(url, part, remote, headers=headers, meter=meter, control=control)
    kind, expected = remote.expected_hash
    if digest != expected:
        part.unlink(missing_ok=True)
        raise UserError(f"{remote.name} arrived damaged ({kind} mismatch); try again")
    with open(part, "r+b") as f:
        magic = f.read(4)
        if magic not in MAGICS:
            raise UserError(f"{remote.name} is not a GGUF file (magic {magic!r})")
        f.seek(0)
        f.write(b"GGUF")  # our working copy: the gguf package reads GGUF only
    part.replace(dest)
    return {"file": remote.name, "bytes_fetched": remote.size, "file_size": remote.size,
            "magic": magic.decode("ascii", "replace"), "ranged": False}


def import_gguf_predictors_from_hub(endpoint: str, plan: RepoPlan, model_dir: Path, *, headers: dict,
                                    importer: Callable[[Path, Path], None] | None, progress=None,
                                    control: DownloadControl | None = None) -> dict:
    """Range-read the predictors of the repo's GGUF into a working copy, hand its folder to
    `importer(folder, model_dir)` (default: the engine in a child process), drop the copy.
    Returns what the download state records about it."""
    remote = choose_gguf(plan)
    folder = Path(model_dir) / SIDECAR / GGUF_SUBDIR
    meter = ProgressMeter(plan.repo, remote.size, progress)
    meter.emit("predictors", remote.name, message=f"reading the predictors out of {plan.repo}/{remote.name}")
    try:
        info = fetch_gguf_predictors(endpoint, plan, remote, folder / remote.name, headers=headers,
                                     meter=meter, control=control or DownloadControl())
        (importer or _import_in_subprocess)(folder, Path(model_dir))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    meter.emit("predictors", remote.name, message=(
        f"imported predictors from {plan.repo}/{remote.name} ({format_size(info['bytes_fetched'])} of "
        f"{format_size(remote.size)} read)"))
    return {"repo": plan.repo, "revision": plan.commit, "file": remote.name, "bytes_fetched": info["bytes_fetched"]}


def _import_in_subprocess(src: Path, model_dir: Path) -> None:
    """engine.loading.gguf_predictors in a child process: this package does not import torch."""
    gguf = sorted(Path(src).glob("*.gguf"))
    proc = subprocess.run([sys.executable, "-m", "engine.loading.gguf_predictors", str(gguf[0]), str(model_dir)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
        raise UserError(lines[-1][len("error: "):] if lines else
                        f"importing the GGUF predictors failed: {proc.stderr.strip()[-300:]}")
