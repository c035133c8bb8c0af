"""PyTorch pickle checkpoints (`pytorch_model*.bin`) -> safetensors, one shard at a time.

Some repos (ReluFalcon-40B, MiniCPM-S-1B's main branch) publish only pickles. A pickle can
name any Python callable, so each shard is read with `torch.load(weights_only=True)`, whose
unpickler accepts tensors and plain containers only and refuses anything else before
calling it; a refused shard is an `UnsafePickleError` and nothing of the model is kept.

Order of work, so that a crash or a full disk never loses weights:
1. every remaining shard is opened (memory-mapped, so nothing is read) and checked to be a
   state dict of tensors, before anything is written;
2. the free disk must hold the largest shard once more (a shard and its copy coexist);
3. per shard: tensors are streamed into `<name>.safetensors.tmp` (extra memory: one
   tensor), the file is re-opened and compared with the pickle bit for bit, renamed into
   place, and only then is the pickle deleted;
4. `model.safetensors.index.json` replaces `pytorch_model.bin.index.json`.
A rerun after a crash finds converted shards (renamed only after their check) and
finishes the rest.

Run as `python -m engine.loading.checkpoint_convert MODEL_DIR` it prints one JSON object, or one
`error:` line with exit code 2 (the models registry, which must not import torch, uses
this form).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import torch

from engine.errors import UnsafePickleError, UserError

PICKLE_INDEX = "pytorch_model.bin.index.json"
SAFE_INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"^pytorch_model(-\d+-of-\d+)?\.bin$")
DISK_MARGIN = 64 * 1024**2
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def pickle_shards(model_dir: Path) -> list[Path]:
    """The `pytorch_model*.bin` shards of a folder, in name order."""
    return sorted(p for p in Path(model_dir).iterdir() if p.is_file() and _SHARD.match(p.name))


def safetensors_name(pickle_name: str) -> str:
    """pytorch_model.bin -> model.safetensors; pytorch_model-00001-of-00003.bin -> model-00001-of-00003.safetensors."""
    match = _SHARD.match(pickle_name)
    if match is None:
        raise ValueError(f"not a pytorch_model shard name: {pickle_name}")
    return f"model{match.group(1) or ''}.safetensors"


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one shard, memory-mapped when the file is in torch's zip format."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy (pre-zip) format
    except Exception as exc:  # noqa: BLE001 - the weights-only unpickler raises several kinds
        raise UnsafePickleError(
            f"{path.name} was refused: it is not a plain PyTorch state dict ({_reason(exc)}); "
            "a pickle that would run code is never loaded"
        ) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise UnsafePickleError(f"{path.name} was refused: it holds a {type(state).__name__}, not a state dict")
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise UnsafePickleError(f"{path.name} was refused: it holds no tensors")
    unknown = sorted({str(v.dtype) for v in tensors.values() if v.dtype not in _DTYPES})
    if unknown:
        raise UserError(f"{path.name} holds tensors of dtype {', '.join(unknown)}, which safetensors cannot store")
    return tensors


def _reason(exc: Exception) -> str:
    """The line of torch's refusal that names what the pickle wanted (its message is long)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in str(exc).splitlines() if ln.strip()]
    named = [ln for ln in lines if "Unsupported" in ln or "GLOBAL" in ln]
    text = (named or lines or [exc.__class__.__name__])[0]
    text = text.split(" was not an allowed global")[0].replace("WeightsUnpickler error: ", "")
    return text[:200]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy when it is already contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Stream `tensors` into a safetensors file, one tensor in memory at a time."""
    header, offset = {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for name in sorted(tensors):
            out.write(_raw(tensors[name]).numpy().data)
        out.flush()
        os.fsync(out.fileno())


def _verify(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        names = set(handle.keys())
        if names != set(tensors):
            raise UserError(f"the converted {path.name} lacks tensors {sorted(set(tensors) - names)[:5]}")
        for name, source in tensors.items():
            copy = handle.get_tensor(name)
            if copy.dtype != source.dtype or copy.shape != source.shape or not torch.equal(_raw(copy), _raw(source)):
                raise UserError(f"the converted {path.name} differs from its pickle at {name}; the pickle is kept")


def _free_disk(path: Path) -> int:
    return shutil.disk_usage(path).free


def convert_pytorch_checkpoint(model_dir: Path, *, free_disk=_free_disk) -> dict:
    """Convert every `pytorch_model*.bin` shard of `model_dir` to safetensors in place.

    Returns {"converted": {pickle: safetensors}, "bytes": size written, "index": name|None}.
    Raises UnsafePickleError (after deleting the folder's pickles, which are hostile) or
    UserError (disk full, a failed check; the pickles stay).
    """
    model_dir = Path(model_dir)
    shards = pickle_shards(model_dir)
    # A shard whose verified copy is already in place (an earlier run crashed after its
    # rename) only needs its pickle deleted.
    for shard in list(shards):
        if (model_dir / safetensors_name(shard.name)).is_file():
            shard.unlink()
            shards.remove(shard)
    try:
        for shard in shards:
            _load_state_dict(shard)  # refuse any hostile shard before writing anything
    except UnsafePickleError:
        for shard in shards:
            shard.unlink(missing_ok=True)
        (model_dir / PICKLE_INDEX).unlink(missing_ok=True)
        raise
    if shards:
        need = max(s.stat().st_size for s in shards) + DISK_MARGIN
        free = free_disk(model_dir)
        if need > free:
            raise UserError(
                f"not enough free disk to convert {model_dir.name}'s PyTorch checkpoint to safetensors: it needs "
                f"{need / 1024**3:.1f} GiB (one shard's copy) and {free / 1024**3:.1f} GiB are free; free some space "
                "and run the same command again (converted shards are kept)"
            )
    converted, written = {}, 0
    for shard in shards:
        target = model_dir / safetensors_name(shard.name)
        tmp = target.with_name(target.name + ".tmp")
        tensors = _load_state_dict(shard)
        try:
            write_safetensors(tensors, tmp)
            _verify(tensors, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        del tensors
        tmp.replace(target)
        shard.unlink()  # only now: its verified copy is in place
        converted[shard.name] = target.name
        written += target.stat().st_size
    index = _write_index(model_dir)
    return {"converted": converted, "bytes": written, "index": index}


def _write_index(model_dir: Path) -> str | None:
    """model.safetensors.index.json from the pickle index (names renamed), or from the shards."""
    old = model_dir / PICKLE_INDEX
    shards = sorted(p.name for p in model_dir.glob("model-*-of-*.safetensors"))
    if old.is_file():
        try:
            data = json.loads(old.read_text(encoding="utf-8"))
            weight_map = {k: safetensors_name(v) for k, v in data["weight_map"].items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"cannot read {old.name}: {exc}") from None
        metadata = data.get("metadata") or {}
    elif len(shards) > 1:
        from safetensors import safe_open

        weight_map, metadata = {}, {}
        for name in shards:
            with safe_open(str(model_dir / name), framework="pt") as handle:
                weight_map.update(dict.fromkeys(handle.keys(), name))
    else:
        return None
    missing = sorted({v for v in weight_map.values() if not (model_dir / v).is_file()})
    if missing:
        raise UserError(f"{model_dir.name}: the checkpoint index names shards that are missing: {', '.join(missing)}")
    tmp = model_dir / (SAFE_INDEX + ".tmp")
    tmp.write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2), encoding="utf-8")
    tmp.replace(model_dir / SAFE_INDEX)
    old.unlink(missing_ok=True)
    return SAFE_INDEX


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m engine.loading.checkpoint_convert MODEL_DIR\n")
        return 2
    try:
        result = convert_pytorch_checkpoint(Path(args[0]))
    except UnsafePickleError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 3  # distinct: the caller deletes the model
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
