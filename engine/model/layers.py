"""The layer types every architecture is converted into at load time: `Norm`, `linear`
(the one matrix product over plain and quantized weights), `DenseFfn` and `Layer`.

One layer layout: fused QKV, norms, and an FFN object that owns its rows in the
neuron-major layout of docs/ARCHITECTURE.md. The FFN object is swapped per mode (dense,
sparse, hybrid, oracle) without touching the rest (engine/model/transformer.py runs them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.kernels import cpu as cpu_kernels
from engine.kernels.quantized import Int8Matrix, QuantMatrix, matrix_nbytes
from engine.kernels.reference import activations

# Called per layer with (layer index, predictor input [T, d], true FFN activations [T, n_ff]).
FfnObserver = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class Norm:
    weight: torch.Tensor
    bias: torch.Tensor | None  # LayerNorm (Falcon) has one, RMSNorm none
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            if x.dtype != torch.float32:  # 16-bit on a GPU: normalise in fp32, as the references do
                xf = x.float()
                return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
            variance = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(variance + self.eps) * self.weight
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight, self.bias)


# Up to this many tokens on the CPU, one matrix-vector product per token beats torch's
# matrix product, which reads the weights at a fraction of the bandwidth at small T
# (32000 x 4096 fp32 on 2 cores: 2 tokens 38 vs 64 ms, 4 tokens 72 vs 106 ms).
_PER_TOKEN_MAX = 4


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Matrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, d] @ weight[n, d]^T (+ bias). A few tokens on the CPU go through our own
    matrix-vector kernel, which streams the weights about twice as fast as torch's; int8
    matrices (the CPU tier's, see engine.quantized) through their own product."""
    if isinstance(weight, QuantMatrix):
        out = weight.linear(x)
    elif x.shape[0] <= _PER_TOKEN_MAX and x.device.type == "cpu" and x.dtype == torch.float32:
        out = torch.stack([cpu_kernels.matvec(row, weight) for row in x])
    else:
        return F.linear(x, weight, bias)
    return out + bias if bias is not None else out


def _nbytes(*tensors: torch.Tensor | Int8Matrix | None) -> int:
    return sum(matrix_nbytes(t) for t in tensors)


class DenseFfn:
    """The whole FFN with dense matmuls: prefill, the `dense` mode, and the reference.

    Rows are neuron-major: `gate_up` stacks gate rows over up rows ([2n, d], one matmul),
    `down_t` is the down projection transposed ([n, d]).
    """

    def __init__(self, gate_up: torch.Tensor, down_t: torch.Tensor, gated: bool, activation: str,
                 threshold: float, up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None):
        self.gate_up, self.down_t = gate_up, down_t
        self.gated, self.activation, self.threshold = gated, activation, threshold
        self.up_bias, self.down_bias = up_bias, down_bias
        self.n_ff = down_t.shape[0]

    @property
    def gate(self) -> torch.Tensor | None:
        return self.gate_up[: self.n_ff] if self.gated else None

    @property
    def up(self) -> torch.Tensor:
        return self.gate_up[self.n_ff :] if self.gated else self.gate_up

    @property
    def nbytes(self) -> int:
        return _nbytes(self.gate_up, self.down_t, self.up_bias, self.down_bias)

    def pre_activations(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(gate, up) before the nonlinearity (gate None: ungated)."""
        if self.gated:
            pre = linear(x, self.gate_up)
            return pre[..., : self.n_ff], pre[..., self.n_ff :]
        return None, linear(x, self.gate_up, self.up_bias)

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        return activations(*self.pre_activations(x), self.activation, self.threshold)

    def project(self, act: torch.Tensor) -> torch.Tensor:
        if act.shape[0] == 1 and act.device.type == "cpu" and act.dtype == torch.float32:
            out = cpu_kernels.combine(act[0].contiguous(), self.down_t)[None]
        else:
            out = act @ self.down_t
        return out + self.down_bias if self.down_bias is not None else out

    def __call__(self, x: torch.Tensor, pred_input: torch.Tensor, layer: int,
                 observer: FfnObserver | None = None) -> torch.Tensor:
        gate_pre, up_pre = self.pre_activations(x)
        act = activations(gate_pre, up_pre, self.activation, self.threshold)
        if observer is not None:
            gates = getattr(observer, "gate_values", None)  # CATS calibration: the gate before thresholding
            if gates is not None and gate_pre is not None:
                gates(layer, gate_pre)
            observer(layer, pred_input, act)
        return self.project(act)


@dataclass
class Layer:
    attn_norm: Norm
    mlp_norm: Norm | None  # None: the MLP reads the attention norm's output (Falcon parallel, 1 LN)
    qkv: torch.Tensor | Int8Matrix  # [(heads + 2 kv_heads) * head_dim, d], rows q | k | v
    qkv_bias: torch.Tensor | None
    out: torch.Tensor | Int8Matrix  # [d, heads * head_dim]
    out_bias: torch.Tensor | None
    ffn: object            # DenseFfn or a sparse FFN with the same call signature
    parallel: bool         # Falcon: attention and MLP both read the layer input
    device: torch.device
    # Mixture of experts (engine/model/moe.py): the router reads the layer input before attention,
    # and `ffn` then takes the routing in place of the predictor input.
    router: torch.Tensor | Int8Matrix | None = None
    rope: bool = True          # False: this layer's attention has no positions (NoPE)
    window: int | None = None  # attend over the last `window` positions only
    fused: object = None  # the decoder's prepared call for this layer (runtime.fused_decode), built on first use
    fused_batch: object = None  # the batched decoder's (runtime.fused_batch)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the layer computes in (int8 matrices compute in their norm's fp32)."""
        return self.attn_norm.weight.dtype

    @property
    def dense_nbytes(self) -> int:
        """Bytes of everything but the FFN rows."""
        norms = self.attn_norm.nbytes + (self.mlp_norm.nbytes if self.mlp_norm else 0)
        return norms + _nbytes(self.qkv, self.qkv_bias, self.out, self.out_bias, self.router)
