"""Per-layer activation predictors: logits = fc2(relu(fc1(x))), a neuron is predicted
active when its logit >= the layer's threshold.

A `PredictorSet` is stored as safetensors in the sidecar folder; those PowerInfer
publishes and those a checkpoint carries are imported by engine/loading/predictor_import.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.errors import ModelFormatError
from engine.kernels.quantized import Q4Matrix, QuantMatrix, matrix_nbytes, quantize_matrix
from engine.kernels.tensor_kinds import QUANT_KINDS, parse_quant_name, quant_name
from engine.model.layers import linear
from engine.cpu_formats import predictor_cpu_format
from engine.loading.sidecar import group_by_layer, sidecar_dir

FILENAME = "predictors.safetensors"


@dataclass
class PredictorSet:
    fc1: list[torch.Tensor]  # [rank_i, d]
    fc2: list[torch.Tensor]  # [n_ff, rank_i]
    thresholds: list[float]
    source: str = "thermocline"
    extra: dict = field(default_factory=dict)  # per-layer quality figures, training settings

    def __len__(self) -> int:
        return len(self.fc1)

    @property
    def ranks(self) -> list[int]:
        return [w.shape[0] for w in self.fc1]

    def nbytes(self, layer: int) -> int:
        return matrix_nbytes(self.fc1[layer]) + matrix_nbytes(self.fc2[layer])

    def logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Logits [n_ff] for one token x [d], or [T, n_ff] for x [T, d]."""
        def computable(w):  # stored 16-bit and not placed on a tier (placement converts them): fp32
            return w.float() if not isinstance(w, QuantMatrix) and w.device.type == "cpu" and w.dtype in _HALF else w

        fc1, fc2 = computable(self.fc1[layer]), computable(self.fc2[layer])
        dtype = torch.float32 if isinstance(fc1, QuantMatrix) else fc1.dtype
        rows = x.to(dtype).reshape(-1, x.shape[-1])
        out = linear(torch.relu(linear(rows, fc1)), fc2)
        return out.reshape(*x.shape[:-1], fc2.shape[0])

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.logits(layer, x) >= self.thresholds[layer]

    def to(self, layer: int, device: torch.device, dtype: torch.dtype, int8: bool = False,
           quant: str | None = None) -> None:
        """Move a layer's predictor to a tier: device and dtype, or the rows of the CPU tier
        whose weights are int8 (or `quant`): int8 on a 4-bit tier too, but for a file's own
        4-bit matrices (engine.cpu_formats.predictor_cpu_format)."""
        quant = quant or ("int8" if int8 else None)

        def place(w):
            if quant in ("int8", "int4"):
                return quantize_matrix(w, quant if isinstance(w, Q4Matrix) else predictor_cpu_format(quant))
            return w.to_dense(device, dtype) if isinstance(w, QuantMatrix) else w.to(device, dtype)

        self.fc1[layer], self.fc2[layer] = place(self.fc1[layer]), place(self.fc2[layer])

    # ---------------------------------------------------------------- storage
    def save(self, model_dir: Path) -> Path:
        """Write the predictors at their own precision (fp32, 16-bit, or a GGUF's Q4_0 rows as
        `NAME.q4_0`, engine.kernels.tensor_kinds), never widened."""
        folder = sidecar_dir(model_dir)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, (a, b) in enumerate(zip(self.fc1, self.fc2)):
            tensors.update(_stored(f"layers.{i}.fc1.weight", a))
            tensors.update(_stored(f"layers.{i}.fc2.weight", b))
        metadata = {"thresholds": json.dumps(self.thresholds), "source": self.source,
                    "extra": json.dumps(self.extra)}
        path = folder / FILENAME
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(path)  # never leave a half-written file where a good one was
        return path

    @classmethod
    def exists(cls, model_dir: Path) -> bool:
        return (sidecar_dir(model_dir) / FILENAME).is_file()

    @classmethod
    def load(cls, model_dir: Path, num_layers: int | None = None, dim: int | None = None,
             n_ff: int | None = None) -> "PredictorSet":
        path = sidecar_dir(model_dir) / FILENAME
        if not path.is_file():
            raise ModelFormatError(
                f"{Path(model_dir).name} has no activation predictors; run `thermocline train-predictors "
                f"--model {model_dir}` or import PowerInfer's with `thermocline models import`"
            )
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            tensors = _from_stored(load_file(str(path)), path)
            thresholds = json.loads(metadata.get("thresholds", "[]"))
            extra = json.loads(metadata.get("extra", "{}"))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFormatError(f"predictor file {path} is corrupt ({exc}); train or import them again") from None
        layers = group_by_layer(tensors)
        predictors = cls._from_layers(layers, thresholds, metadata.get("source", "thermocline"), path)
        predictors.extra = extra
        predictors.check(num_layers, dim, n_ff)
        return predictors

    @classmethod
    def _from_layers(cls, layers: dict[int, dict], thresholds: list[float], source: str, where) -> "PredictorSet":
        if list(layers) != list(range(len(layers))):
            raise ModelFormatError(f"predictor layers in {where} are not numbered 0..N-1: {list(layers)}")
        try:
            fc1 = [at_own_precision(layers[i]["fc1.weight"]) for i in layers]
            fc2 = [at_own_precision(layers[i]["fc2.weight"]) for i in layers]
        except KeyError as exc:
            raise ModelFormatError(f"predictor in {where} lacks {exc}") from None
        return cls(fc1, fc2, _thresholds(thresholds, len(fc1), where), source)

    def check(self, num_layers: int | None, dim: int | None, n_ff: int | None) -> None:
        if num_layers is not None and len(self) != num_layers:
            raise ModelFormatError(f"predictors cover {len(self)} layers but the model has {num_layers}")
        for i, (a, b) in enumerate(zip(self.fc1, self.fc2)):
            if a.shape[0] != b.shape[1] or (dim and a.shape[1] != dim) or (n_ff and b.shape[0] != n_ff):
                raise ModelFormatError(
                    f"predictor of layer {i} has shapes fc1 {tuple(a.shape)}, fc2 {tuple(b.shape)}, which do not "
                    f"fit the model (d={dim}, n_ff={n_ff})"
                )


_HALF = (torch.float16, torch.bfloat16)


def at_own_precision(w):
    """A predictor matrix at no more than its own precision: 16-bit, fp32 and 4-bit rows stay
    as they are (each tier converts them when placing them), anything else becomes fp32."""
    if isinstance(w, QuantMatrix) or w.dtype in _HALF + (torch.float32,):
        return w
    return w.float()


def _stored(name: str, w) -> dict[str, torch.Tensor]:
    """How `save` stores one matrix: its tensor at its dtype, or 4-bit rows as NAME.q4_0
    (plain rows: a set placed on an int4 CPU tier holds them packed)."""
    if isinstance(w, Q4Matrix):
        return {quant_name(name, "Q4_0"): w.rows().detach().cpu().contiguous()}
    if isinstance(w, QuantMatrix):
        w = w.dequantize()
    return {name: at_own_precision(w.detach()).cpu().contiguous()}


def _from_stored(tensors: dict[str, torch.Tensor], where) -> dict:
    """`save`'s tensors back: NAME.q4_0 rows as a Q4Matrix under NAME (checked)."""
    out = {}
    for name, t in tensors.items():
        parsed = parse_quant_name(name)
        if parsed is None:
            out[name] = t
            continue
        base, suffix, transposed = parsed
        _, block, size = QUANT_KINDS[suffix]
        if suffix != "q4_0" or transposed or t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] % size:
            raise ModelFormatError(f"predictor tensor {name} in {where} is not Q4_0 rows: {t.dtype} {tuple(t.shape)}")
        out[base] = Q4Matrix(t.contiguous(), t.shape[1] // size * block)
    return out


def _thresholds(values, layers: int, where) -> list[float]:
    """One finite number per layer (one number, or a list of one, serves them all)."""
    if not isinstance(values, list):
        values = [values]
    if len(values) != layers:
        values = values[:1] * layers if values else [0.0] * layers
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelFormatError(f"the predictor file {where} holds a threshold that is not a number "
                                   f"({str(value)[:40]!r}); train or import the predictors again")
        out.append(float(value))
    return out
