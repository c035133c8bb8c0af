"""Reading checkpoint tensors from safetensors files, memory-mapped.

Single files and shards (`model.safetensors.index.json`) are both served by
`WeightSource.get(name)`, which returns a tensor backed by the mapped file: nothing is
copied until the engine converts it into its own layout.

Quantized tensor kinds (`engine.kernels.tensor_kinds`, written by the GGUF import):
`get(NAME)` of a weight stored as `NAME.q4_0` / `NAME.q8_0` / `NAME.q4_k` (any kind of engine.kernels.ggml_quants) / `NAME.t.q4_0` dequantizes
(exact: fp32 holds every value); `q4_rows(NAME)` hands the 4-bit rows over as they are,
so the CPU tier's Q4_0 rows are the file's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.loading.confine import check_relative_name
from engine.errors import ModelFormatError
from engine.kernels.q4_format import dequantize_rows_q4
from engine.kernels.tensor_kinds import QUANT_KINDS, parse_quant_name as _parse_quant_name
from engine.kernels.ggml_quants import REFERENCE_KINDS, dequantize_rows


def dequantize_blocks(q: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 rows of ggml blocks [n, row bytes] -> fp32 [n, cols] (exact)."""
    _, block, size = QUANT_KINDS[kind.lower()]
    n, nbytes = q.shape
    if kind.lower() == "q4_0":  # the 4-bit kernels' own decode (imported here: it loads numba)

        return dequantize_rows_q4(q, nbytes // size * block)
    if kind.lower() in REFERENCE_KINDS:  # ggml's own decode (the gguf package): exact in fp32
        return torch.from_numpy(dequantize_rows(q.numpy(), kind.lower()))
    blocks = q.reshape(n, nbytes // size, size)
    d = blocks[:, :, :2].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
    vals = blocks[:, :, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (vals * d).reshape(n, -1)


class WeightSource:
    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelFormatError(f"cannot read {index}: {exc!r}") from None
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index.name}: weight_map is not an object of tensor -> file")
            # The index is downloaded text: a shard name must be a file inside this folder.
            # (Links the user made on disk, e.g. a Hugging Face cache snapshot, are theirs.)
            for filename in set(weight_map.values()):
                check_relative_name(filename, f"{index.name} in {self.model_dir}")
            self._where = dict(weight_map)
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                bins = list(self.model_dir.glob("*.bin")) + list(self.model_dir.glob("*.pt"))
                hint = " (PyTorch pickles are never loaded: convert to safetensors)" if bins else ""
                raise ModelFormatError(f"{self.model_dir} has no *.safetensors weights{hint}")
            for f in files:
                for name in self._open(f.name).keys():
                    self._where[name] = f.name
        # quantized tensors answer under their weight's name
        self._quant: dict[str, tuple[str, str, bool]] = {}
        for stored in [n for n in self._where if _parse_quant_name(n)]:
            name, suffix, transposed = _parse_quant_name(stored)
            if name in self._where or name in self._quant:
                raise ModelFormatError(f"tensor {name} is stored twice in {self.model_dir} ({stored})")
            self._quant[name] = (stored, suffix, transposed)
            self._where[name] = self._where.pop(stored)

    def _open(self, filename: str):
        handle = self._files.get(filename)
        if handle is None:
            path = self.model_dir / filename
            if not path.is_file():
                raise ModelFormatError(f"weight shard {filename} is missing from {self.model_dir}")
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise ModelFormatError(
                    f"{path.name} is corrupt or truncated ({exc}); download it again"
                ) from None
            self._files[filename] = handle
        return handle

    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def quant_kind(self, name: str) -> tuple[str, bool] | None:
        """(Q4_0 or Q8_0, whether its rows are the transpose's) of a quantized weight, else None."""
        entry = self._quant.get(name)
        return None if entry is None else (QUANT_KINDS[entry[1]][0], entry[2])

    def _stored_blocks(self, name: str) -> torch.Tensor:
        """A quantized weight's uint8 rows of blocks, as stored (mapped), checked."""
        stored, suffix, _ = self._quant[name]
        try:
            q = self._open(self._where[name]).get_tensor(stored)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelFormatError(f"cannot read tensor {stored} ({exc}); the file may be truncated") from None
        _check_block_rows(stored, suffix, q.dtype == torch.uint8, str(q.dtype), tuple(q.shape))
        return q

    def q4_rows(self, name: str, transposed: bool = False) -> torch.Tensor | None:
        """The stored 4-bit rows (engine.kernels.cpu_q4's layout, uncopied) of weight `name`
        (transposed: of its transpose), when it is stored so; else None."""
        entry = self._quant.get(name)
        if entry is None or entry[1] != "q4_0" or entry[2] != transposed:
            return None
        return self._stored_blocks(name)

    def transposed_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi of the transpose of the matrix `name` (its columns lo..hi) as fp32
        [hi - lo, rows], reading only what they need: for Q4_0/Q8_0 rows the blocks of
        those columns, for a float tensor a slice, for a transposed kind its rows."""
        if name not in self._where:
            raise ModelFormatError(f"tensor {name} is missing from the checkpoint in {self.model_dir}")
        if name in self._quant:
            _, suffix, transposed = self._quant[name]
            q = self._stored_blocks(name)
            if transposed:
                return dequantize_blocks(q[lo:hi].contiguous(), suffix)
            _, block, size = QUANT_KINDS[suffix]
            first, last = lo // block, -(-hi // block)  # the blocks that hold columns lo..hi
            part = dequantize_blocks(q[:, first * size:last * size].contiguous(), suffix)
            return part[:, lo - first * block:hi - first * block].t().contiguous()
        try:
            part = self._open(self._where[name]).get_slice(name)[:, lo:hi]
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelFormatError(f"cannot read tensor {name} ({exc}); the file may be truncated") from None
        return part.to(torch.float32).t().contiguous()

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi of the matrix `name` as fp32, reading only those rows' bytes."""
        if name in self._quant and not self._quant[name][2]:
            return dequantize_blocks(self._stored_blocks(name)[lo:hi].contiguous(), self._quant[name][1])
        if name in self._quant:  # a transposed kind (only down projections are): decoded whole
            return self.get(name)[lo:hi].contiguous()
        if name not in self._where:
            raise ModelFormatError(f"tensor {name} is missing from the checkpoint in {self.model_dir}")
        try:
            part = self._open(self._where[name]).get_slice(name)[lo:hi]
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelFormatError(f"cannot read tensor {name} ({exc}); the file may be truncated") from None
        return part.to(torch.float32)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._where:
            raise ModelFormatError(f"tensor {name} is missing from the checkpoint in {self.model_dir}")
        if name in self._quant:
            _, suffix, transposed = self._quant[name]
            tensor = _dequantize_stepwise(self._stored_blocks(name), suffix, transposed)
        else:
            try:
                tensor = self._open(self._where[name]).get_tensor(name)
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise ModelFormatError(f"cannot read tensor {name} ({exc}); the file may be truncated") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ModelFormatError(
                f"tensor {name} has shape {tuple(tensor.shape)} but config.json implies {tuple(shape)}"
            )
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the file's header (nothing read)."""
        if name not in self._where:
            raise ModelFormatError(f"tensor {name} is missing from the checkpoint in {self.model_dir}")
        if name in self._quant:
            stored, suffix, transposed = self._quant[name]
            header = self._open(self._where[name]).get_slice(stored)
            dtype, stored_shape = header.get_dtype(), tuple(header.get_shape())
            _check_block_rows(stored, suffix, dtype == "U8", dtype, stored_shape)
            rows, nbytes = stored_shape
            _, block, size = QUANT_KINDS[suffix]
            shape = (rows, nbytes // size * block)
            return shape[::-1] if transposed else shape
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

    def dtype(self) -> torch.dtype:
        """Storage dtype of the checkpoint (of its first floating tensor), from the headers:
        reading the tensor itself would copy it (the first name is often the 250 MB head)."""
        for name in sorted(self._where):
            if name in self._quant:
                continue  # blocks of ggml: not the storage dtype of the float tensors
            try:
                dtype = _HEADER_DTYPES.get(self._open(self._where[name]).get_slice(name).get_dtype())
            except (SafetensorError, OSError, ValueError, RuntimeError, AttributeError):
                dtype = None
                t = self.get(name)
                if t.is_floating_point():
                    return t.dtype
            if dtype is not None:
                return dtype
        return torch.float32


_DEQUANT_ROWS = 1024  # stored rows decoded per step: the decode's temporaries stay a few MB


def _dequantize_stepwise(q: torch.Tensor, suffix: str, transposed: bool) -> torch.Tensor:
    """Stored block rows as the weight's fp32 matrix (the transpose's when `transposed`),
    decoded a step of rows at a time into one output: the decode's int16/fp32 temporaries
    of a whole 32000-row embedding were three times the result."""
    _, block, size = QUANT_KINDS[suffix]
    n, cols = q.shape[0], q.shape[1] // size * block
    out = torch.empty((cols, n) if transposed else (n, cols), dtype=torch.float32)
    for lo in range(0, n, _DEQUANT_ROWS):
        hi = min(n, lo + _DEQUANT_ROWS)
        part = dequantize_blocks(q[lo:hi], suffix)
        if transposed:
            out[:, lo:hi] = part.t()
        else:
            out[lo:hi] = part
    return out


def _check_block_rows(stored: str, suffix: str, is_uint8: bool, dtype: str, shape: tuple[int, ...]) -> None:
    """A quantized tensor must be uint8 [rows, a whole number of blocks]: else ModelFormatError."""
    kind, _, size = QUANT_KINDS[suffix]
    if not is_uint8 or len(shape) != 2 or shape[1] == 0 or shape[1] % size:
        raise ModelFormatError(f"tensor {stored} is not {kind} rows (uint8 [rows, a multiple of {size} "
                               f"bytes]): {dtype} {shape}")


# safetensors' dtype names of the floating types a checkpoint may store
_HEADER_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
