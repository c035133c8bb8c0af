"""Catalogue entries whose weights are a GGUF file (PowerInfer's `*.q4.powerinfer.gguf`:
Q4_0 weights and predictors, about a seventh of the fp32 repo).

The download fetches the one GGUF the entry's patterns name, then imports it into the
model folder (`engine.loading.gguf_import`, numpy only: config.json, tokenizer, a
model.safetensors whose Q4_0/Q8_0 tensors stay blocks, the predictors into the sidecar)
and deletes it. The state file records the imported files (`converted`: the GGUF's name
-> model.safetensors), so a finished model is not fetched again.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

from engine.errors import UserError

from .hub import RepoPlan, file_url
from .state import SIDECAR

IMPORT_SUBDIR = "gguf-import"  # <model>/thermocline/: the import's folder until it is moved into place


def weights_gguf_plan(plan: RepoPlan) -> RepoPlan:
    """The plan cut to the GGUF to import: the smallest of those the patterns matched."""
    ggufs = [f for f in plan.files if f.name.endswith(".gguf")]
    if not ggufs:
        raise UserError(f"{plan.repo} has no GGUF file matching the catalogue's patterns at {plan.commit[:12]}")
    chosen = min(ggufs, key=lambda f: (f.size, f.name))
    return RepoPlan(plan.repo, plan.commit, (chosen,), plan.gated)


# Without range requests the header is not read: the bound of an all-F32 import of Q4_0
# (32 weights in 18 bytes -> 128 bytes: about 7.1x), rounded up.
NO_HEADER_IMPORT_FACTOR = 8


def import_bytes(endpoint: str, plan: RepoPlan, *, headers: dict, timeout: float = 30.0) -> int:
    """Bytes the import of the plan's GGUF writes into the model folder (Q4_0/Q8_0/Q6_K matrices
    stay blocks, predictors keep their precision), from its header read with range
    requests: gguf_plan.import_output_bytes. The one figure the download's disk check and
    the Models page's plan use."""
    from huggingface_hub.utils import get_session

    from engine.loading.gguf_plan import import_output_bytes

    from .gguf_fetch import read_header
    from .progress import DownloadControl, ProgressMeter

    remote = weights_gguf_plan(plan).files[0]
    with tempfile.TemporaryDirectory(prefix="thermocline-gguf-header-") as tmp:
        header = read_header(get_session(), file_url(endpoint, plan.repo, plan.commit, remote.name), plan, remote,
                             Path(tmp) / "header.gguf", headers=headers, meter=ProgressMeter(plan.repo, 0),
                             control=DownloadControl(), timeout=timeout)
        if header is None:
            return NO_HEADER_IMPORT_FACTOR * remote.size
        reader = header[0]
        tensors = [(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape[::-1]), int(t.n_bytes))
                   for t in reader.tensors]
        data_offset = reader.data_offset
        del reader, header  # the mapped file closes before the folder goes
    return import_output_bytes(tensors, data_offset)


def import_weights_gguf(model_dir: Path, state: dict, rel: str, activation: str | None,
                        save_state: Callable[[], None]) -> dict:
    """Import the downloaded GGUF `rel` into `model_dir`, record what was written (save_state),
    then delete it: a crash in between leaves a record that names the imported files."""
    from engine.loading.gguf_import import import_gguf

    model_dir = Path(model_dir)
    src, tmp = model_dir / rel, model_dir / SIDECAR / IMPORT_SUBDIR
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted import
    summary = import_gguf(src, tmp, activation=activation)
    written = []
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        dest = model_dir / path.relative_to(tmp)
        dest.parent.mkdir(parents=True, exist_ok=True)
        path.replace(dest)
        written.append(dest.relative_to(model_dir).as_posix())
    shutil.rmtree(tmp, ignore_errors=True)
    files = state.setdefault("files", {})
    files.pop(rel, None)
    for name in written:
        files[name] = {"size": (model_dir / name).stat().st_size, "hash": None, "verified": False, "converted": True}
    state.setdefault("converted", {})[rel] = "model.safetensors"
    state["weights_format"] = f"gguf ({', '.join(summary['tensor_types'])}; Q4_0/Q8_0 kept as blocks)"
    if summary.get("predictors"):
        state["predictors"] = "imported"
    save_state()
    src.unlink(missing_ok=True)
    return summary
