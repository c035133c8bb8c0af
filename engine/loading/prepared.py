"""The prepared layout: a model's FFN rows in the CPU tier's format, written once into the
sidecar (`thermocline/prepared-<format>.safetensors`) and memory-mapped by later loads.

Every load used to read the checkpoint's 16/32-bit FFN tensors, transpose the down
projections and quantize every row. The first load with a CPU format (int8 or int4) now
also writes each layer's rows, neuron-major and quantized, into this file (a progress
line per layer); later loads map it, and a layer whose neurons all sit on the CPU takes
the mapped rows as its cold rows as they are: no conversion, no copy, only the pages a
token reads become resident. Layers with hot neurons still read the checkpoint, so the
fast tier keeps the checkpoint's precision.

The file is keyed by the checkpoint (each weight file's name, size and modification time,
and config.json's bytes, hashed), the format and `LAYOUT_VERSION`; a different key means
the file is rebuilt. It lives in the model's folder, so `models remove` deletes it too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import numpy as np
import torch

from engine.kernels import cpu as cpu_kernels
from engine.kernels import q4_format, q4_rows
from engine.kernels import host_memory
from engine.loading.sidecar import sidecar_dir
from engine.loading.predictors import FILENAME
from engine.loading.safetensors_out import CODE_OF, CODES, NUMPY, StreamedSafetensors
from engine.kernels.quantized import Int8Matrix, Q4Matrix, Q4MinMatrix
from engine.model.layers import Norm

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump when the rows' layout or this file's names change
FORMATS = ("int8", "int4")
DISABLE_ENV = "THERMOCLINE_NO_PREPARED"  # 1: neither read nor write prepared files


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip() in ("", "0")


def is_bundled(model_dir: Path) -> bool:
    """A model shipped inside Thermocline (the demo): never written to, it is small anyway."""
    import resources

    try:
        Path(model_dir).resolve().relative_to(Path(resources.__file__).resolve().parent)
    except ValueError:
        return False
    return True


def prepared_path(model_dir: Path, fmt: str) -> Path:
    return sidecar_dir(model_dir) / f"prepared-{fmt}.safetensors"


def checkpoint_key(model_dir: Path, fmt: str) -> str:
    """What the prepared rows were made from: the weight files' names, sizes and times,
    config.json's bytes, the format and the layout version, hashed."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(f"{LAYOUT_VERSION}:{fmt}".encode())
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.index.json")):
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    config = model_dir / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    return h.hexdigest()


def _names(i: int, gated: bool, fmt: str) -> list[str]:
    parts = (["gate"] if gated else []) + ["up", "down_t"]
    names = [f"layers.{i}.{p}" for p in parts]
    if fmt == "int8":
        names += [f"layers.{i}.{p}_scale" for p in parts]
    return names


def _layer_tensors(i: int, rows, fmt: str) -> dict[str, torch.Tensor]:
    out = {f"layers.{i}.up": rows.up, f"layers.{i}.down_t": rows.down_t}
    if rows.gate is not None:
        out[f"layers.{i}.gate"] = rows.gate
    if fmt == "int8":
        out[f"layers.{i}.up_scale"], out[f"layers.{i}.down_t_scale"] = rows.up_scale, rows.down_scale
        if rows.gate is not None:
            out[f"layers.{i}.gate_scale"] = rows.gate_scale
    return out


def _shapes(n: int, d: int, gated: bool, fmt: str, layers: int) -> list[tuple[str, str, tuple[int, ...]]]:
    entries = []
    for i in range(layers):
        for name in _names(i, gated, fmt):
            if name.endswith("_scale"):
                entries.append((name, "F32", (n,)))
            elif fmt == "int4":
                entries.append((name, "U8", (n, q4_format.row_bytes(d))))
            else:
                entries.append((name, "I8", (n, d)))
    return entries


class PreparedWriter:
    """Writes the rows layer by layer, in order, into a temporary file; `finish` renames it
    into place (a half-written file is never taken for a prepared one)."""

    def __init__(self, model_dir: Path, fmt: str, key: str, n: int, d: int, gated: bool, layers: int):
        self.fmt, self.gated = fmt, gated
        self.out = StreamedSafetensors(prepared_path(model_dir, fmt), _shapes(n, d, gated, fmt, layers),
                                       {"key": key, "format": fmt, "layout_version": str(LAYOUT_VERSION)})
        self.tmp = self.out.tmp

    def add_layer(self, i: int, rows) -> None:
        tensors = _layer_tensors(i, rows, self.fmt)
        for name in _names(i, self.gated, self.fmt):
            self.out.write(name, tensors[name])

    def finish(self) -> Path:
        return self.out.finish()

    def abort(self) -> None:
        self.out.abort()


class PreparedRows:
    """A prepared file, memory-mapped (copy-on-write, so the tensors are writable views that
    share the file's pages until written, which the engine never does)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            size = os.fstat(f.fileno()).st_size
            if length > size - 8:  # a damaged length: checked before anything that size is allocated
                raise ValueError(f"its header length {length} is beyond the file's {size} bytes")
            self.header = json.loads(f.read(length))
            if not isinstance(self.header, dict):
                raise ValueError("its header is not a JSON object")
        self.metadata = self.header.pop("__metadata__", {})
        self.fmt = self.metadata.get("format")
        self._map = host_memory.map_file(path)  # copy-on-write, advised for huge pages
        self._base = 8 + length
        # a truncated (or padded) file is refused here, not found out by a tensor's view
        end = max((e["data_offsets"][1] for e in self.header.values()), default=0)
        if self._map.size != self._base + end:
            raise ValueError(f"{self._map.size} bytes where its header describes {self._base + end}")
        self._file_huge: bool | None = None  # the kernel maps this file in 2 MB pages (see `tensor`)
        self._recached: bool | None = None  # None: not tried; True: this load re-read pages in 2 MB folios

    @classmethod
    def open_if_current(cls, model_dir: Path, fmt: str) -> "PreparedRows | None":
        """The prepared file of this format when its key matches the checkpoint, else None."""
        path = prepared_path(model_dir, fmt)
        if not enabled() or fmt not in FORMATS or not path.is_file():
            return None
        try:
            rows = cls(path)
        except (OSError, ValueError, struct.error, KeyError, TypeError) as exc:  # TypeError: a header of non-dicts
            log.warning("ignoring unreadable prepared rows %s (%s)", path, exc)
            return None
        return rows if rows.metadata.get("key") == checkpoint_key(model_dir, fmt) else None

    def holds(self, t: torch.Tensor) -> bool:
        """t's memory lies in this mapped file (it was not copied)."""
        lo = self._map.ctypes.data
        return lo <= t.data_ptr() < lo + self._map.size

    def tensor(self, name: str, resident: bool = False) -> torch.Tensor:
        """A stored tensor as a view of the mapped file. With `resident` (weights every token
        reads whole), one in huge pages: the view where the kernel maps the file in 2 MB
        pages (decided once per file, on its largest matrix: see host_memory.file_pages_huge),
        else a copy read into host_memory's anonymous huge
        pages. Measured on a 2-core EPYC (2 layers of 7B int8 qkv/out + 32k head, median of
        20 rotations): anonymous huge pages 19.1 ms, the file in 2 MB pages 20.4 ms; the lead
        measured 18.7 (anonymous huge) vs 22.8 ms from the file in 4 KB pages. The copy costs
        the load 0.3-0.7 s for those 281 MB (faulting fresh huge pages is slow), so it is
        made only where the file's pages are small and cannot be read again in 2 MB folios
        (host_memory.recache_huge: a file just written sits in small ones; re-reading the
        matrix through the mapping costs that load less than the copy, and later loads none)."""
        array = self._view(name)
        if resident and array.nbytes >= host_memory.MIN_BYTES and host_memory.thp_available():
            if self._file_huge is None:
                self._file_huge = host_memory.file_pages_huge(self._view(self._probe_name()))
            if not self._file_huge and self._recached is None and array.nbytes >= 2 * host_memory.HUGE_PAGE:
                self._recached = host_memory.recache_huge(array, self.path)  # checked on one matrix
            elif not self._file_huge and self._recached:
                host_memory.recache_huge(array, self.path, check=False)  # the next ones go the same way
            if not self._file_huge and not self._recached:
                out = host_memory.empty(array.shape, CODES[self.header[name]["dtype"]][0])
                host_memory.copy_out_of_map(array, out)
                return out
        return torch.from_numpy(array)

    def _view(self, name: str) -> np.ndarray:
        entry = self.header[name]
        lo, hi = entry["data_offsets"]
        return self._map[self._base + lo:self._base + hi].view(NUMPY[entry["dtype"]]).reshape(entry["shape"])

    def _probe_name(self) -> str:
        """The largest head or attention matrix (read whole by the load anyway; never an FFN
        matrix of the dense mode's file, which the load only maps): the one whose pages say
        how the kernel maps this file."""
        sizes = {n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in self.header.items()
                 if (n.endswith((".q", ".q4", "." + Q4_PACKED)) and ".ffn." not in n) or n in ("embed", "lm_head")}
        matrices = {n: b for n, b in sizes.items() if n != "embed"} or sizes
        return max(matrices, key=matrices.get)

    def has_layer(self, i: int) -> bool:
        return f"layers.{i}.up" in self.header

    def layer_rows(self, i: int, dim: int):
        """Layer i's rows in the CPU kernels' storage, backed by the mapped file."""
        gate = self.tensor(f"layers.{i}.gate") if f"layers.{i}.gate" in self.header else None
        up, down_t = self.tensor(f"layers.{i}.up"), self.tensor(f"layers.{i}.down_t")
        if self.fmt == "int4":
            return q4_rows.Q4FfnRows(gate, up, down_t, dim)
        scale = {p: self.tensor(f"layers.{i}.{p}_scale") for p in ("up", "down_t")}
        gate_scale = self.tensor(f"layers.{i}.gate_scale") if gate is not None else None
        return cpu_kernels.CpuFfnRows(gate, up, down_t, gate_scale, scale["up"], scale["down_t"], quant="int8")


# ------------------------------------------------------------------ everything but the FFN rows
# A second file, `prepared-<format>-dense.safetensors`, holds the rest of what a load builds
# for the CPU tier in its final form: each CPU layer's norms, biases and attention matrices
# (int8 or 4-bit rows, as `convert_layer_dense` leaves them), the embeddings and final norm,
# the output head in the CPU format, and the predictors in it. With it and the FFN rows, a
# load of a model placed on the CPU reads nothing from the checkpoint but its headers: the
# layers are built over shape-only (meta) tensors and then given the mapped ones.
DENSE_LAYOUT_VERSION = 4  # 2: 4-bit matrices packed in groups of 8 rows (`.q4x8`); 3: int8 predictors on int4;
# 4: Q4_1 matrices kept as Q4_0 rows and block offsets (`.q4min`; tests/test_prepared_layout.py)
Q4_PACKED = "q4x8"  # the name suffix of a packed 4-bit matrix (`.q4`: plain rows)
Q4_OFFSETS = "q4min"  # beside `.q4`/`.q4x8`: a Q4_1 matrix's block offsets (engine.kernels.quantized.Q4MinMatrix)
_MATRIX_SUFFIXES = ("", ".q", ".q4", "." + Q4_PACKED)
# a layer's dense tensors; `router`: a mixture's (SmallThinker, TurboSparse-Mixtral), whose
# experts are in the MoE prepared file (engine.loading.prepared_moe)
_LAYER_FIELDS = ("attn_norm", "mlp_norm", "qkv", "qkv_bias", "out", "out_bias", "router")


def dense_path(model_dir: Path, fmt: str) -> Path:
    return sidecar_dir(model_dir) / f"prepared-{fmt}-dense.safetensors"


def dense_key(model_dir: Path, fmt: str) -> str:
    """The checkpoint's key, the predictors file's size and time, and this layout's version."""
    h = hashlib.sha256(f"dense{DENSE_LAYOUT_VERSION}:{checkpoint_key(model_dir, fmt)}".encode())
    pred = sidecar_dir(model_dir) / FILENAME
    if pred.is_file():
        st = pred.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _matrix_parts(name: str, w) -> dict[str, torch.Tensor]:
    """A weight in its stored form: a plain tensor, or a quantized matrix's arrays."""
    if isinstance(w, Int8Matrix):
        return {f"{name}.q": w.q, f"{name}.scale": w.scale}
    if isinstance(w, Q4Matrix):  # rows, or packed in groups of 8 (engine.kernels.cpu_q4x8): by name
        return {f"{name}.{Q4_PACKED if w.packed else 'q4'}": w.q}
    if isinstance(w, Q4MinMatrix):  # Q4_1 blocks: the 4-bit rows and their block offsets
        return {**_matrix_parts(name, w.rows), f"{name}.{Q4_OFFSETS}": w.offsets}
    return {name: w}


def dense_tensors(model, predictors, cpu_layers: list[int], head_on_cpu: bool) -> dict[str, torch.Tensor]:
    """What the dense file holds, by name, from a loaded model (references, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for i in cpu_layers:
        layer = model.layers[i]
        for field in _LAYER_FIELDS:
            value = getattr(layer, field, None)
            if value is None:
                continue
            if isinstance(value, Norm):
                out[f"layers.{i}.{field}.weight"] = value.weight
                if value.bias is not None:
                    out[f"layers.{i}.{field}.bias"] = value.bias
            else:
                out.update(_matrix_parts(f"layers.{i}.{field}", value))
        if predictors is not None:
            out.update(_matrix_parts(f"predictors.{i}.fc1", predictors.fc1[i]))
            out.update(_matrix_parts(f"predictors.{i}.fc2", predictors.fc2[i]))
    if head_on_cpu:
        out["embed"] = model.embed
        out["final_norm.weight"] = model.final_norm.weight
        if model.final_norm.bias is not None:
            out["final_norm.bias"] = model.final_norm.bias
        if model.head_nbytes:  # an own head (not the embeddings themselves)
            out.update(_matrix_parts("lm_head", model.lm_head))
    return out


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                  progress=None) -> Path:
    """A safetensors file of CPU tensors, streamed tensor by tensor (no copy of the whole),
    written under a temporary name and renamed into place; `progress(fraction, text)` after
    each tensor when given."""
    for name, t in tensors.items():
        if t.device.type != "cpu" or t.dtype not in CODE_OF:
            raise ValueError(f"{name}: cannot prepare a {t.dtype} tensor on {t.device}")
    out = StreamedSafetensors(path, [(name, CODE_OF[t.dtype], tuple(t.shape)) for name, t in tensors.items()],
                              metadata)
    try:
        done = 0
        for name, t in tensors.items():
            out.write(name, t)
            done += t.numel() * t.element_size()
            if progress is not None:
                progress(done / max(out.size, 1), f"writing the prepared layout (first load only): "
                                                  f"{100 * done // max(out.size, 1)}%")
    except BaseException:
        out.abort()
        raise
    return out.finish()


class PreparedDense(PreparedRows):
    """The dense file, memory-mapped: tensors and quantized matrices by name."""

    _path, _key = staticmethod(dense_path), staticmethod(dense_key)  # where it lives, what it must match

    @classmethod
    def open_if_current(cls, model_dir: Path, fmt: str) -> "PreparedDense | None":
        path = cls._path(model_dir, fmt)
        if not enabled() or fmt not in FORMATS or not path.is_file():
            return None
        try:
            dense = cls(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            log.warning("ignoring unreadable prepared file %s (%s)", path, exc)
            return None
        return dense if dense.metadata.get("key") == cls._key(model_dir, fmt) else None

    def has(self, name: str) -> bool:
        return any(f"{name}{suffix}" in self.header for suffix in _MATRIX_SUFFIXES)

    def matrix(self, name: str, shape: tuple[int, int] | None = None, resident: bool = False):
        """A weight as stored: a mapped tensor or a quantized matrix over mapped arrays (with
        `resident`, read into huge pages: see `tensor`); `shape` ([n, cols], the checkpoint's)
        is checked against it."""
        q4 = next((f"{name}.{s}" for s in ("q4", Q4_PACKED) if f"{name}.{s}" in self.header), None)
        if q4 is not None:
            q = self.tensor(q4, resident)
            if shape is None:
                raise ValueError(f"{name}: the 4-bit matrix needs its column count")
            if q.dim() != 2:
                raise ValueError(f"{name}: 4-bit rows of shape {tuple(q.shape)}")
            w = Q4Matrix(q, shape[1], packed=q4.endswith(Q4_PACKED))
            if q.shape[1] != q4_format.row_bytes(shape[1]):
                raise ValueError(f"{name}: 4-bit rows of {q.shape[1]} bytes do not hold {shape[1]} columns")
            if f"{name}.{Q4_OFFSETS}" in self.header:
                offsets = self.tensor(f"{name}.{Q4_OFFSETS}", resident)
                if tuple(offsets.shape) != (q.shape[0], q4_format.n_blocks(shape[1])) or offsets.dtype != torch.float32:
                    raise ValueError(f"{name}: block offsets of shape {tuple(offsets.shape)} for {tuple(shape)}")
                w = Q4MinMatrix(w, offsets)
        elif f"{name}.q" in self.header:
            w = Int8Matrix(self.tensor(f"{name}.q", resident), self.tensor(f"{name}.scale"))
        else:
            w = self.tensor(name, resident)
        if shape is not None and tuple(w.shape) != tuple(shape):
            raise ValueError(f"{name}: prepared shape {tuple(w.shape)}, the checkpoint's {tuple(shape)}")
        return w

    def rows(self, name: str) -> int:
        """The row count of a stored weight (from the header)."""
        for suffix in _MATRIX_SUFFIXES:
            if f"{name}{suffix}" in self.header:
                return self.header[f"{name}{suffix}"]["shape"][0]
        raise KeyError(name)

    def has_layer(self, i: int) -> bool:
        return f"layers.{i}.attn_norm.weight" in self.header

    def has_globals(self) -> bool:
        return "embed" in self.header

    def has_predictors(self, layers: int) -> bool:
        return all(self.has(f"predictors.{i}.fc1") for i in range(layers))

    def fill_layer(self, i: int, layer) -> None:
        """Replace the shape-only (meta) tensors of a layer built from the checkpoint's
        headers with the mapped ones."""
        for field in _LAYER_FIELDS:
            value = getattr(layer, field, None)
            if value is None:
                continue
            if isinstance(value, Norm):
                value.weight = self.matrix(f"layers.{i}.{field}.weight", tuple(value.weight.shape))
                if value.bias is not None:
                    value.bias = self.matrix(f"layers.{i}.{field}.bias", tuple(value.bias.shape))
            else:  # qkv, out (and a mixture's router): read whole by every token
                setattr(layer, field, self.matrix(f"layers.{i}.{field}", tuple(value.shape), resident=True))

    def fill_globals(self, embed, norm, head):
        """(embed, final norm, head) in place of meta tensors of the same shapes."""
        embed = self.matrix("embed", tuple(embed.shape))
        norm.weight = self.matrix("final_norm.weight", tuple(norm.weight.shape))
        if norm.bias is not None:
            norm.bias = self.matrix("final_norm.bias", tuple(norm.bias.shape))
        # A tied head is stored only where the CPU tier holds its own copy in the CPU format
        # (a mixture's: engine.hotcold.moe_tiers.MoeRuntime._head_weights; the dense mode's
        # int8 rows: dense_quant.quantize_head); else the embeddings are the head, read whole
        # by every token.
        if not self.has("lm_head"):
            embed = self.matrix("embed", tuple(embed.shape), resident=True)
            head = embed
        else:
            head = self.matrix("lm_head", tuple(head.shape), resident=True)
        return embed, norm, head


# ------------------------------------------------------------------ the dense mode's whole model
# `prepared-<format>-dense-mode.safetensors`: everything a dense-mode load with int8/int4 CPU
# weights builds (engine.loading.dense_quant), every layer and the globals, in its final form:
# the names of the dense file above for the norms, biases, attention matrices, embeddings,
# final norm and an own head, and per layer the FFN as the dense mode computes it,
# `layers.{i}.ffn.gate_up` ([2n or n, d] rows) and `layers.{i}.ffn.down` ([d, n] rows, the
# checkpoint's orientation; the sparse files hold down_t), plus its biases. A separate file
# from the sparse modes' dense part: that one holds only the placement's CPU layers and the
# predictors (its key follows the predictors file), and on a GGUF's Q4_0 weights it keeps the
# file's codes where the dense mode requantizes, so the two need not agree.
DENSE_MODE_LAYOUT_VERSION = 3  # 2: 4-bit matrices packed in groups of 8 rows (`.q4x8`); 3: Q4_1 kept (`.q4min`)


def dense_mode_path(model_dir: Path, fmt: str) -> Path:
    return sidecar_dir(model_dir) / f"prepared-{fmt}-dense-mode.safetensors"


def dense_mode_key(model_dir: Path, fmt: str) -> str:
    """The checkpoint's key (weight files, config.json, format) and this layout's version."""
    return hashlib.sha256(f"dense-mode{DENSE_MODE_LAYOUT_VERSION}:{checkpoint_key(model_dir, fmt)}".encode()).hexdigest()


def dense_mode_tensors(model) -> dict[str, torch.Tensor]:
    """What the dense-mode file holds, by name, from a loaded dense model (references, no copies)."""
    out = dense_tensors(model, None, list(range(len(model.layers))), head_on_cpu=True)
    for i, layer in enumerate(model.layers):
        ffn = layer.ffn
        out.update(_matrix_parts(f"layers.{i}.ffn.gate_up", ffn.gate_up))
        out.update(_matrix_parts(f"layers.{i}.ffn.down", ffn.down))
        for field in ("up_bias", "down_bias"):
            if getattr(ffn, field) is not None:
                out[f"layers.{i}.ffn.{field}"] = getattr(ffn, field)
    return out


def may_write(model_dir: Path) -> bool:
    """Whether a dense-mode load may write its prepared file into this model's sidecar: only
    where the sidecar folder exists already (a model Thermocline downloaded, imported or
    profiled, or one a sparse load prepared), not into a plain folder a dense load was merely
    pointed at, nor into the bundled demo."""
    return sidecar_dir(model_dir).is_dir() and not is_bundled(model_dir)


class PreparedDenseMode(PreparedDense):
    """The dense mode's file, memory-mapped (`PreparedDense`'s readers, its own name and key)."""

    _path, _key = staticmethod(dense_mode_path), staticmethod(dense_mode_key)

    def complete(self, layers: int) -> bool:
        """Holds every layer (attention and FFN) and the globals."""
        return self.has_globals() and all(self.has_layer(i) and self.has(f"layers.{i}.ffn.down")
                                          for i in range(layers))
