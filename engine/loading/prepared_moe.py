"""The MoE prepared layout: a mixture's experts in the CPU tier's format, written once into
the sidecar (`thermocline/prepared-<format>-moe.safetensors`, beside the dense prepared file
that holds the attention, norms, routers, embeddings and head) and memory-mapped by later
loads, whose cold experts are views of the map: nothing converted, nothing copied.

The file, per layer i (every layer, in order; E experts of n neurons, d = hidden size):
- `layers.{i}.experts.gate`, `.up`, `.down_t`: the experts stacked, [E, n, d] int8 (int8)
  or [E, n, row_bytes(d)] uint8 Q4_0 rows (int4); down_t is the down projection transposed
  (neuron-major), so row j of expert e is neuron j's in each matrix, at byte
  (e * n + j) * row_bytes from the tensor's start;
- int8 only: `layers.{i}.experts.gate_scale`, `.up_scale`, `.down_t_scale` fp32 [E, n];
- experts that carry predictors (TurboSparse-Mixtral): `layers.{i}.experts.predictor.fc1`
  int8 [E, rank_i, d] with `.fc1_scale` fp32 [E, rank_i], and `.fc2` int8 [E, n, rank_i]
  with `.fc2_scale` fp32 [E, n] (int8 on both tiers: engine.cpu_formats.predictor_cpu_format).
Metadata: `key` (the checkpoint's key, `moe_key`), `format`, `layout_version`. A cut or
damaged file, one of other shapes, or one of another key is not used, and the next load
rebuilds it; the write goes to a `.<pid>.partial` file renamed into place at the end, so
a load killed mid-write leaves no file taken for a prepared one (and the next writer
removes the partial of a pid that no longer runs).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from pathlib import Path

import torch

from engine.kernels import q4_format
from engine.kernels.quantized import Int8Matrix
from engine.loading import prepared
from engine.loading.safetensors_out import CODES, StreamedSafetensors
from engine.loading.sidecar import sidecar_dir
from engine.model.expert_stack import PARTS, ExpertStack
from engine.model.moe import ExpertPredictors

log = logging.getLogger(__name__)

MOE_LAYOUT_VERSION = 1  # bump when the experts' layout or these names change


def moe_path(model_dir: Path, fmt: str) -> Path:
    return sidecar_dir(model_dir) / f"prepared-{fmt}-moe.safetensors"


def moe_key(model_dir: Path, fmt: str) -> str:
    """The checkpoint's key (weight files, config.json, format) and this layout's version."""
    return hashlib.sha256(f"moe{MOE_LAYOUT_VERSION}:{prepared.checkpoint_key(model_dir, fmt)}".encode()).hexdigest()


def layer_entries(i: int, experts: int, n: int, d: int, fmt: str, rank: int | None
                  ) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype code, shape) of layer i's tensors, in file order."""
    p = f"layers.{i}.experts."
    if fmt == q4_format.QUANT:
        out = [(p + part, "U8", (experts, n, q4_format.row_bytes(d))) for part in PARTS]
    else:
        out = [(p + part, "I8", (experts, n, d)) for part in PARTS]
        out += [(p + part + "_scale", "F32", (experts, n)) for part in PARTS]
    if rank is not None:
        out += [(p + "predictor.fc1", "I8", (experts, rank, d)), (p + "predictor.fc1_scale", "F32", (experts, rank)),
                (p + "predictor.fc2", "I8", (experts, n, rank)), (p + "predictor.fc2_scale", "F32", (experts, n))]
    return out


def file_entries(config, fmt: str, ranks: list[int] | None) -> list[tuple[str, str, tuple[int, ...]]]:
    return [e for i in range(config.num_layers)
            for e in layer_entries(i, config.num_experts, config.intermediate_size, config.hidden_size, fmt,
                                   ranks[i] if ranks else None)]


def layer_tensors(i: int, stack: ExpertStack, predictors: ExpertPredictors | None) -> dict[str, torch.Tensor]:
    """What the file holds of layer i, by name: the stack's arrays and the stacked predictors."""
    p = f"layers.{i}.experts."
    out = {p + name: t for name, t in stack.tensors().items()}
    if predictors is not None:
        for part in ("fc1", "fc2"):
            mats = getattr(predictors, part)
            if not all(isinstance(m, Int8Matrix) for m in mats):
                raise ValueError("the experts' predictors are not int8 rows")
            out[p + f"predictor.{part}"] = torch.stack([m.q for m in mats])
            out[p + f"predictor.{part}_scale"] = torch.stack([m.scale for m in mats])
    return out


class MoeWriter:
    """Streams the layers into a temporary file as the load makes them (no whole-model copy);
    `finish` renames it into place, `abort` deletes it."""

    def __init__(self, model_dir: Path, fmt: str, config, ranks: list[int] | None):
        self.out = StreamedSafetensors(moe_path(model_dir, fmt), file_entries(config, fmt, ranks),
                                       {"key": moe_key(model_dir, fmt), "format": fmt,
                                        "layout_version": str(MOE_LAYOUT_VERSION)})

    def add_layer(self, i: int, stack: ExpertStack, predictors: ExpertPredictors | None) -> None:
        for name, t in layer_tensors(i, stack, predictors).items():
            self.out.write(name, t)

    def finish(self) -> Path:
        return self.out.finish()

    def abort(self) -> None:
        self.out.abort()


class PreparedExperts(prepared.PreparedRows):
    """The MoE file, memory-mapped (copy-on-write; the engine never writes to it)."""

    @classmethod
    def open_if_current(cls, model_dir: Path, fmt: str, config, ranks: list[int] | None) -> "PreparedExperts | None":
        """The file when its key matches the checkpoint and it holds exactly the tensors this
        model's layers need, else None (the caller rebuilds it)."""
        path = moe_path(model_dir, fmt)
        if not prepared.enabled() or fmt not in prepared.FORMATS or not path.is_file():
            return None
        try:
            experts = cls(path)
            if experts.metadata.get("key") != moe_key(model_dir, fmt):
                return None
            want = {name: (code, list(shape)) for name, code, shape in file_entries(config, fmt, ranks)}
            have = {name: (e["dtype"], e["shape"]) for name, e in experts.header.items()}
            if have != want:
                raise ValueError("its tensors are not this model's")
            for e in experts.header.values():  # offsets inside the file, sized as the shapes say
                lo, hi = e["data_offsets"]
                if not 0 <= lo <= hi or hi - lo != math.prod(e["shape"]) * CODES[e["dtype"]][1]:
                    raise ValueError("a tensor's offsets do not match its shape")
        except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable prepared experts %s (%s)", path, exc)
            return None
        return experts

    def stack(self, i: int, dim: int) -> ExpertStack:
        """Layer i's experts as views of the map."""
        p = f"layers.{i}.experts."
        fmt = self.fmt
        parts = [self.tensor(p + part) for part in PARTS]
        scales = [self.tensor(p + part + "_scale") for part in PARTS] if fmt == "int8" else [None] * 3
        return ExpertStack(fmt, dim, *parts, *scales)

    def predictors(self, i: int) -> ExpertPredictors | None:
        """Layer i's experts' predictors (int8 rows, views of the map), or None."""
        p = f"layers.{i}.experts.predictor."
        if p + "fc1" not in self.header:
            return None
        fc1, s1, fc2, s2 = (self.tensor(p + name) for name in ("fc1", "fc1_scale", "fc2", "fc2_scale"))
        return ExpertPredictors([Int8Matrix(fc1[e], s1[e]) for e in range(fc1.shape[0])],
                                [Int8Matrix(fc2[e], s2[e]) for e in range(fc2.shape[0])])
