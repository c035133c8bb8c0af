"""The transformer: plain tensors and functions, one decode step at a time.

Every architecture is converted at load time into one layer layout (`LayerWeights`):
fused QKV, norms, and an FFN object that owns its rows in the neuron-major layout of
docs/ARCHITECTURE.md. The FFN object is swapped per mode (dense, sparse, hybrid,
oracle) without touching the rest. Attention is dense on the device of its layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.kernels import cpu as cpu_kernels
from engine.kernels.reference import activations
from engine.runtime import fused_decode
from engine.runtime.kv_cache import KVCache
from engine.hotcold.moe import route
from engine.loading.quantized import Int8Matrix, QuantMatrix, matrix_nbytes
from engine.runtime.rope import RotaryTable, apply_rotary

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

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            pre = linear(x, self.gate_up)
            gate_pre, up_pre = pre[..., : self.n_ff], pre[..., self.n_ff :]
        else:
            gate_pre, up_pre = None, linear(x, self.gate_up, self.up_bias)
        return activations(gate_pre, up_pre, self.activation, self.threshold)

    def project(self, act: torch.Tensor) -> torch.Tensor:
        if act.shape[0] == 1 and act.device.type == "cpu" and act.dtype == torch.float32:
            out = cpu_kernels.combine(act[0].contiguous(), self.down_t)[None]
        else:
            out = act @ self.down_t
        return out + self.down_bias if self.down_bias is not None else out

    def __call__(self, x: torch.Tensor, pred_input: torch.Tensor, layer: int,
                 observer: FfnObserver | None = None) -> torch.Tensor:
        act = self.activations(x)
        if observer is not None:
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
    # Mixture of experts (engine/hotcold/moe.py): the router reads the layer input before attention,
    # and `ffn` then takes the routing in place of the predictor input.
    router: torch.Tensor | Int8Matrix | None = None
    rope: bool = True          # False: this layer's attention has no positions (NoPE)
    window: int | None = None  # attend over the last `window` positions only
    fused: object = None  # fused_decode.FusedLayer: this layer's prepared decode call, built on first use

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the layer computes in (int8 matrices compute in their norm's fp32)."""
        return self.attn_norm.weight.dtype

    @property
    def dense_nbytes(self) -> int:
        """Bytes of everything but the FFN rows."""
        norms = self.attn_norm.nbytes + (self.mlp_norm.nbytes if self.mlp_norm else 0)
        return norms + _nbytes(self.qkv, self.qkv_bias, self.out, self.out_bias, self.router)


class Transformer:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[Layer], final_norm: Norm,
                 lm_head: torch.Tensor | Int8Matrix, rotary: dict[torch.device, RotaryTable]):
        self.config = config
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.rotary = rotary
        self.ffn_observer: FfnObserver | None = None
        self.fused_head = None  # fused_decode.FusedLayer of the final norm and the head
        self.scale = config.head_dim ** -0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # muP scales (MiniCPM, engine/arch/minicpm.py); None where the architecture has none.
        self.embedding_scale = config.embedding_scale if config.embedding_scale != 1.0 else None
        self.residual_scale = config.residual_scale if config.residual_scale != 1.0 else None
        self.logit_scale = config.logit_scale if config.logit_scale != 1.0 else None

    @property
    def head_device(self) -> torch.device:
        return self.lm_head.device

    @property
    def head_nbytes(self) -> int:
        """Bytes of the output head beyond the embeddings (0 when it is them: tied, same tier)."""
        shared = isinstance(self.lm_head, torch.Tensor) and self.lm_head.data_ptr() == self.embed.data_ptr()
        return 0 if shared else matrix_nbytes(self.lm_head)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run tokens `ids` [T] at positions start.. ; returns logits [T or 1, vocab] (fp32)."""
        count = ids.shape[0]
        if count == 1:  # decode: one compiled call per layer where the model allows (fused_decode)
            logits = fused_decode.decode_step(self, ids, start, cache)
            if logits is not None:
                return logits
        cache.prepare(start, count)
        x = self.embed[ids.to(self.embed.device)]
        if self.embedding_scale is not None:
            x = x * self.embedding_scale
        mask = cache.mask(start, count)
        window_masks: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            if x.device != layer.device or x.dtype != layer.dtype:  # the hidden state crosses tiers
                x = x.to(layer.device, layer.dtype)
            layer_mask = mask
            if layer.window is not None:  # a windowed layer among full ones (SmallThinker)
                if layer.window not in window_masks:
                    window_masks[layer.window] = _window_mask(cache, start, count, layer.window)
                layer_mask = window_masks[layer.window]
            x = self._layer(index, layer, x, start, cache, layer_mask)
        if not all_logits:
            x = x[-1:]
        x = self.final_norm(x.to(self.final_norm.weight.device, self.final_norm.weight.dtype))
        if self.logit_scale is not None:
            x = x * self.logit_scale
        return linear(x, self.lm_head).float()

    def _layer(self, index: int, layer: Layer, x: torch.Tensor, start: int, cache: KVCache,
               mask: torch.Tensor | None) -> torch.Tensor:
        routing = None
        if layer.router is not None:  # the experts are known before attention runs
            cfg = self.config
            routing = route(layer.router, x, cfg.experts_per_token, cfg.router_softmax)
            before_attention = getattr(layer.ffn, "before_attention", None)
            if before_attention is not None:  # where cold experts beyond RAM would start loading
                before_attention(routing)
        h_attn = layer.attn_norm(x)
        attn = self._attention(index, layer, h_attn, start, cache, mask)
        scale = self.residual_scale
        if layer.parallel:
            h_mlp = layer.mlp_norm(x) if layer.mlp_norm is not None else h_attn
            return x + attn + layer.ffn(h_mlp, x, index, self.ffn_observer)
        h = x + (attn if scale is None else attn * scale)
        ffn = layer.ffn(layer.mlp_norm(h), h if routing is None else routing, index, self.ffn_observer)
        return h + (ffn if scale is None else ffn * scale)

    def _attention(self, index: int, layer: Layer, x: torch.Tensor, start: int, cache: KVCache,
                   mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        count = x.shape[0]
        qkv = linear(x, layer.qkv, layer.qkv_bias)
        q = qkv[:, : self.q_size].view(count, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(count, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = qkv[:, self.q_size + self.kv_size :].view(count, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        if layer.rope:
            cos, sin = self.rotary[layer.device].at(start, count)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        cache.write(index, k, v, start)
        if count == 1 and mask is None and q.device.type == "cpu" and not cache.rolling:
            # Decode on the CPU: one numba call over the cache, fp32 or 16-bit (cpu.decode_attention).
            out = cpu_kernels.decode_attention(q[:, 0], cache.k[index], cache.v[index], start + count,
                                               self.scale).to(q.dtype).reshape(1, self.q_size)
            return linear(out, layer.out, layer.out_bias)
        keys, values = cache.keys_values(index, start + count)
        if keys.dtype != q.dtype:  # a 16-bit CPU cache under fp32 compute
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if count == 1 and mask is None:
            # Decode: group query heads by their KV head, two small batched matmuls.
            group = cfg.num_heads // cfg.num_kv_heads
            qg = q.reshape(cfg.num_kv_heads, group, cfg.head_dim)
            scores = torch.softmax(torch.bmm(qg, keys.transpose(1, 2)) * self.scale, dim=-1)
            out = torch.bmm(scores, values).reshape(1, self.q_size)
        else:
            attn_mask = mask.to(x.device) if mask is not None else None
            out = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=attn_mask, scale=self.scale,
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )[0]
            out = out.transpose(0, 1).reshape(count, self.q_size)
        return linear(out, layer.out, layer.out_bias)


def _window_mask(cache: KVCache, start: int, count: int, window: int) -> torch.Tensor:
    """[count, keys] mask of a windowed layer in a cache shared with full-attention layers
    (which never rolls): each query sees itself and the window - 1 positions before it."""
    query_pos = torch.arange(start, start + count)[:, None]
    key_pos = torch.arange(start + count)[None, :]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)
