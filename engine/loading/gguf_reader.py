"""GGUF files (llama.cpp's and PowerInfer's): the header and tensor reader.

Read with ggml's own `gguf` package (numpy only, no torch). PowerInfer files carry the magic
`PWRI` in place of `GGUF` (written over the header by PowerInfer's convert.py); the rest of the
header is GGUF's. Every size, offset and type is checked against the file before a byte is
used: a truncated or lying file is refused with one message (ModelFormatError), never a
traceback. Tensors in F32, F16, BF16, Q8_0, Q4_0 and the types of engine.kernels.ggml_quants are
read (decoded exactly to fp32 by `dequantize`); other types are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError, UserError
from engine.kernels.ggml_quants import TYPE_NAMES as BLOCK_TYPES

POWERINFER_MAGIC = b"PWRI"
GGUF_MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "bamboo", "qwen2")

_READS = (f"Thermocline reads F32, F16, BF16, Q8_0, Q4_0, {', '.join(BLOCK_TYPES)} tensors (convert the file to "
          "one of these with llama.cpp's llama-quantize)")


def _types():
    import gguf

    T = gguf.GGMLQuantizationType
    return {T.F32: "F32", T.F16: "F16", T.BF16: "BF16", T.Q8_0: "Q8_0", T.Q4_0: "Q4_0",
            **{T[kind]: kind for kind in BLOCK_TYPES}}


@dataclass
class GgufTensor:
    name: str
    kind: str              # F32 F16 BF16 Q8_0 Q4_0 Q6_K
    shape: tuple[int, ...]  # torch order: [rows, row length]
    raw: np.ndarray        # the file's bytes of this tensor (a view of the mapped file)


@dataclass
class GgufModel:
    path: Path
    powerinfer: bool
    arch: str
    fields: dict
    tensors: dict[str, GgufTensor]


class _Refused(Exception):
    """A tensor entry of the header that we refuse (before the reader touches its data)."""

    def __init__(self, message: str, user: bool = False):
        super().__init__(message)
        self.user = user


def reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """GGUFReader that also takes PowerInfer's magic (the rest of the header is GGUF's),
        and checks each tensor entry's type, shape and extent before reading its data."""

        def _get(self, offset, dtype, count=1, override_order=None):
            if offset == 0 and bytes(self.data[:4]) == POWERINFER_MAGIC:
                return np.frombuffer(GGUF_MAGIC, dtype=np.uint32)
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            supported, size = _types(), len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise _Refused(f"tensor {name} has the unknown type id {int(raw_dtype[0])}") from None
                if qtype not in supported:
                    raise _Refused(f"tensor {name} is {qtype.name}; {_READS}", user=True)
                shape = [int(x) for x in dims.tolist()]
                block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
                if not shape or any(x <= 0 for x in shape) or shape[0] % block:
                    raise _Refused(f"tensor {name} has the impossible shape {shape[::-1]} for {qtype.name}")
                nbytes = math.prod(shape) // block * block_bytes
                start = int(start_offs) + int(offset[0])
                if start + nbytes > size:
                    raise _Refused(f"tensor {name} ({qtype.name} {shape[::-1]}, {nbytes} bytes at offset "
                                   f"{start}) lies outside the {size}-byte file: it is truncated or corrupt")
            return super()._build_tensors(start_offs, fields)

    return Reader


def _field_value(field):
    """A reader field as a Python value (str, number, or list of them)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(x).decode("utf-8", errors="replace") for x in items]
        return [x.tolist()[0] if len(x) == 1 else x.tolist() for x in items]
    part = field.parts[field.data[0]]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


def read_gguf(path: str | Path) -> GgufModel:
    """Parse and check a GGUF file; ModelFormatError/UserError say what is wrong."""
    import gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{path} is not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in (GGUF_MAGIC, POWERINFER_MAGIC):
        raise ModelFormatError(f"{path.name} is not a GGUF file (it starts with {magic!r}, not GGUF or PWRI)")
    try:
        reader = reader_class()(path, "r")
    except _Refused as exc:
        raise (UserError if exc.user else ModelFormatError)(f"{path.name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the reader's ValueError/IndexError/struct errors on bad headers
        raise ModelFormatError(f"{path.name} is truncated or corrupt: its header cannot be read ({exc})") from None
    fields = {}
    for name, field in reader.fields.items():
        try:
            fields[name] = _field_value(field)
        except Exception:  # noqa: BLE001 - a field we cannot decode is a corrupt file
            raise ModelFormatError(f"{path.name} is corrupt: metadata field {name!r} cannot be read") from None
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        named = f"its architecture is {arch[:60]!r}" if isinstance(arch, str) and arch else \
            "it names no readable architecture"
        raise UserError(f"{path.name} is not a GGUF of a supported architecture ({named}); Thermocline imports "
                        f"GGUFs of the {', '.join(ARCHITECTURES)} architectures (ReLU-family models, and SwiGLU "
                        "ones, which run dense)")
    supported = _types()
    tensors = {}
    for t in reader.tensors:
        kind = supported.get(t.tensor_type)
        if kind is None:
            raise UserError(f"{path.name}: tensor {t.name} is {t.tensor_type.name}; {_READS}")
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        n = math.prod(shape)
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if shape[-1] % block or n <= 0:
            raise ModelFormatError(f"{path.name} is corrupt: tensor {t.name} has shape {list(shape)}, "
                                   f"rows not a whole number of {kind} blocks")
        nbytes = n // block * block_bytes
        start = int(t.data_offset)
        if start < 0 or start + nbytes > size or int(t.n_bytes) != nbytes:
            raise ModelFormatError(f"{path.name} is truncated or corrupt: tensor {t.name} ({kind} "
                                   f"{list(shape)}, {nbytes} bytes at offset {start}) lies outside the "
                                   f"{size}-byte file")
        if t.name in tensors:
            raise ModelFormatError(f"{path.name} is corrupt: tensor {t.name} appears twice")
        raw = reader.data[start:start + nbytes]
        tensors[t.name] = GgufTensor(t.name, kind, shape, raw)
    _check_overlaps(path, tensors)
    return GgufModel(path, magic == POWERINFER_MAGIC, arch, fields, tensors)


def _check_overlaps(path: Path, tensors: dict[str, GgufTensor]) -> None:
    spans = sorted((t.raw.__array_interface__["data"][0], t.raw.nbytes, t.name) for t in tensors.values())
    for (a, an, aname), (b, _, bname) in zip(spans, spans[1:]):
        if a + an > b:
            raise ModelFormatError(f"{path.name} is corrupt: tensors {aname} and {bname} overlap")


# ------------------------------------------------------------------------------- tensors
def dequantize(t: GgufTensor, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Rows lo..hi of a tensor as float32 [rows, row length] (values exact for every type)."""
    import gguf

    rows = math.prod(t.shape[:-1])
    hi = rows if hi is None else hi
    row_bytes = t.raw.nbytes // rows
    chunk = np.asarray(t.raw[lo * row_bytes:hi * row_bytes]).reshape(hi - lo, row_bytes)
    if t.kind == "F32":
        return chunk.view(np.float32).copy()
    if t.kind == "F16":
        return chunk.view(np.float16).astype(np.float32)
    if t.kind == "BF16":
        return (chunk.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    qtype = gguf.GGMLQuantizationType[t.kind]
    return gguf.quants.dequantize(chunk, qtype).reshape(hi - lo, -1).astype(np.float32)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert.py's q/k row permutation (interleaved rotary halves -> HF's halves)."""
    out, cols = w.shape
    return w.reshape(heads, out // heads // 2, 2, cols).swapaxes(1, 2).reshape(out, cols)
