"""The dense mode's CPU weights in 8 or 4 bits (`--cpu-weights int8|int4`).

A dense decode step reads every weight once, so on the CPU its bytes set the speed: fp32
weights (what the checkpoint's 16 bits become for torch's CPU products) read 4 bytes a
weight where llama.cpp's Q8_0 reads 1.06 and Q4_0 0.56. Here a freshly loaded CPU layer's
attention projections and FFN, and an untied output head, become the CPU tier's quantized
matrices (`engine.kernels.quantized`: int8 rows with a scale each, or ggml's Q4_0 blocks),
whose products quantize the activations to int8 blocks and run int8 x int8 / int8 x 4-bit
dot products, one token (decode) or a whole prompt (prefill, each row read once for all
its tokens) per call. fp32 stays the exact reference (`cpu_weights="fp32"`).

The FFN keeps its down projection in the checkpoint's orientation, `down` [d, n_ff]: a
row per output, so the down product is one more matrix product over whole quantized rows
(llama.cpp's ffn_down), not a sum of neuron rows scaled by their activations.

`load_dense` writes what it built once into the model's sidecar (engine.loading.prepared,
`prepared-<format>-dense-mode.safetensors`); later loads with the same checkpoint and
format map that file: no checkpoint tensor is read, nothing is quantized or copied.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.errors import ModelFormatError
from engine.kernels import host_memory
from engine.kernels.quantized import Int8Matrix, QuantMatrix, matrix_nbytes, quantize_matrix
from engine.model.layers import DenseFfn, Layer, linear
from engine.model.transformer import Transformer
from engine.loading import prepared
from engine.loading.loader import load_transformer

log = logging.getLogger(__name__)

# Formats the dense mode's CPU weights may take; fp32 keeps the plain tensors.
DENSE_FORMATS = ("fp32", "int8", "int4")


class QuantDenseFfn(DenseFfn):
    """`DenseFfn` over quantized matrices: gate_up [2n or n, d] and down [d, n] (QuantMatrix)."""

    def __init__(self, gate_up: QuantMatrix, down: QuantMatrix, gated: bool, activation: str, threshold: float,
                 up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None):
        self.gate_up, self.down = gate_up, down
        self.gated, self.activation, self.threshold = gated, activation, threshold
        self.up_bias, self.down_bias = up_bias, down_bias
        self.n_ff = down.shape[1]

    @classmethod
    def from_prepared(cls, file, i: int, config) -> "QuantDenseFfn":
        """Layer i's FFN over a prepared file's mapped matrices (engine.loading.prepared.PreparedDenseMode)."""
        n, d, p = config.intermediate_size, config.hidden_size, f"layers.{i}.ffn."
        rows = file.rows(p + "gate_up")
        if rows not in (n, 2 * n):
            raise ValueError(f"{p}gate_up has {rows} rows for {n} neurons")
        up_bias = file.matrix(p + "up_bias", (n,)) if file.has(p + "up_bias") else None
        down_bias = file.matrix(p + "down_bias", (d,)) if file.has(p + "down_bias") else None
        return cls(file.matrix(p + "gate_up", (rows, d)), file.matrix(p + "down", (d, n)), rows == 2 * n,
                   config.activation, config.activation_threshold, up_bias, down_bias)

    @classmethod
    def from_dense(cls, ffn: DenseFfn, fmt: str, where: str = "the FFN") -> "QuantDenseFfn":
        _check_finite(ffn.down_t, where)
        # One transposing copy, then whole rows: quantizing the strided view row block by row
        # block took 4.4 s against 0.9 s for a 7B down projection (int8; Q4_0 2.3 vs 1.4 s).
        down = ffn.down_t.t().contiguous()
        return cls(_quantized(ffn.gate_up, fmt, where), _quantized(down, fmt, where), ffn.gated,
                   ffn.activation, ffn.threshold, ffn.up_bias, ffn.down_bias)

    # Rows as fp32 for code that reads them (a split into tiers); the products never do.
    @property
    def gate(self) -> torch.Tensor | None:
        return self.gate_up.dequantize(0, self.n_ff) if self.gated else None

    @property
    def up(self) -> torch.Tensor:
        return self.gate_up.dequantize(self.n_ff if self.gated else 0)

    @property
    def down_t(self) -> torch.Tensor:
        return self.down.dequantize().t().contiguous()

    @property
    def nbytes(self) -> int:
        return sum(matrix_nbytes(t) for t in (self.gate_up, self.down, self.up_bias, self.down_bias))

    def project(self, act: torch.Tensor) -> torch.Tensor:
        return linear(act, self.down, self.down_bias)


def _check_finite(w: torch.Tensor, where: str) -> None:
    """Refuse NaN/Inf: rounding would hide them (an int8 row's scale skips a NaN), and the first
    token's check for broken weights (`Engine._check_finite`) would then pass. One sum: NaN and
    Inf carry through it, and it reads the matrix once (0.04 s for 45M weights, isfinite 1 s)."""
    if not bool(torch.isfinite(w.sum())):
        raise ModelFormatError(f"{where} holds NaN or infinite weights: the checkpoint is broken (a damaged "
                               "file or a failed conversion); download or convert the model again")


def _quantized(w: torch.Tensor, fmt: str, where: str) -> QuantMatrix:
    if not isinstance(w, QuantMatrix):
        _check_finite(w, where)
    return quantize_matrix(w, fmt)


def quantize_layer(index: int, layer: Layer, fmt: str) -> None:
    """A CPU layer's attention projections and dense FFN into `fmt` (int8 or int4), in place.
    Other FFNs (a mixture of experts) and the router keep their storage."""
    if fmt == "fp32" or layer.device.type != "cpu":
        return
    where = f"layer {index}'s attention"
    layer.qkv = _quantized(layer.qkv, fmt, where)
    layer.out = _quantized(layer.out, fmt, where)
    if type(layer.ffn) is DenseFfn:
        layer.ffn = QuantDenseFfn.from_dense(layer.ffn, fmt, f"layer {index}'s FFN")


def quantize_head(model: Transformer, fmt: str) -> None:
    """The output head on the CPU into `fmt`. A tied head (the embeddings) gets its own copy
    in int8 rows for either format: every token reads the head whole, and as fp32 it was most
    of a small model's bytes (SmolLM2-135M: 113 MB of a token's 190); int8 rows, not Q4_0,
    because a GGUF's embeddings are mostly Q8_0 blocks, which 4-bit rows would round again."""
    head = model.lm_head
    if fmt == "fp32" or head.device.type != "cpu" or isinstance(head, QuantMatrix):
        return
    if head.data_ptr() == model.embed.data_ptr():
        _check_finite(head, "the embeddings (the tied output head)")
        model.lm_head = Int8Matrix.quantize(head)
        return
    model.lm_head = _quantized(head, fmt, "the output head")


def load_dense(model_dir: Path, config, device: torch.device, ctx: int, progress, fmt: str):
    """The dense mode's model with `fmt` CPU weights, and the prepared file it maps (None
    when its weights are its own). int8/int4 on the CPU: a current prepared file is mapped;
    else the checkpoint is read and quantized layer by layer, and the result written into
    the sidecar where one may be written (`prepared.may_write`; a failure to write only logs),
    then mapped from there as later loads map it."""

    devices = [device] * config.num_layers
    preparable = (fmt in prepared.FORMATS and device.type == "cpu" and not config.is_moe
                  and prepared.enabled() and not prepared.is_bundled(model_dir))
    file = prepared.PreparedDenseMode.open_if_current(model_dir, fmt) if preparable else None
    if file is not None and file.complete(config.num_layers):
        try:
            return _load_mapped(model_dir, config, devices, device, ctx, progress, file), file
        except (KeyError, ValueError) as exc:  # a header that lies about its tensors: rebuilt below
            if isinstance(exc, ModelFormatError):  # the checkpoint's own shapes disagree with config.json
                raise
            log.warning("ignoring the prepared file %s (%s)", file.path, exc)
    file = None  # drop the mapping of a bad file before its rebuild renames over it (Windows refuses that)
    model = load_transformer(model_dir, config, devices, device, ctx, progress,
                             on_layer=lambda i, layer: quantize_layer(i, layer, fmt))
    quantize_head(model, fmt)
    quantized = all(isinstance(layer.ffn, QuantDenseFfn) and isinstance(layer.qkv, QuantMatrix)
                    and isinstance(layer.out, QuantMatrix) for layer in model.layers)
    if preparable and quantized and prepared.may_write(model_dir):
        try:
            prepared.write_tensors(prepared.dense_mode_path(model_dir, fmt), prepared.dense_mode_tensors(model),
                                   {"key": prepared.dense_mode_key(model_dir, fmt), "format": fmt,
                                    "layout_version": str(prepared.DENSE_MODE_LAYOUT_VERSION)}, progress)
        except (OSError, ValueError) as exc:
            log.warning("could not write the prepared layout of %s: %s", model_dir, exc)
            return model, None
        # the file just written, mapped as every later load maps it, in place of the converted
        # copies (see engine.hotcold.sparse.load_sparse)
        file = prepared.PreparedDenseMode.open_if_current(model_dir, fmt)
        if file is not None and file.complete(config.num_layers):
            try:
                mapped = _load_mapped(model_dir, config, devices, device, ctx, None, file)
            except (KeyError, ValueError, OSError) as exc:
                log.warning("could not map the prepared layout just written for %s: %s", model_dir, exc)
            else:
                del model
                host_memory.return_free_heap()
                return mapped, file
    return model, None


def _load_mapped(model_dir: Path, config, devices, device: torch.device, ctx: int, progress, file):
    """The dense mode's model from its prepared file: everything mapped, the checkpoint's headers read."""
    return load_transformer(
        model_dir, config, devices, device, ctx, progress, read_ffn=lambda i: False,
        on_layer=lambda i, layer: setattr(layer, "ffn", QuantDenseFfn.from_prepared(file, i, config)),
        prepared=file, from_prepared=lambda i: True, globals_from_prepared=True)
