"""What the per-architecture loaders share (torch): tensor conversion, the FFN row layout,
and the loader of the Llama layout, which several architecture modules name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import ModelConfig
from engine.model.layers import DenseFfn, Layer, Norm
from engine.errors import ModelFormatError
from engine.kernels.quantized import Q4Matrix
from engine.kernels.q4_rows import Q4FfnRows
from engine.model.q4_ffn import Q4StagedFfn, q4_rows_of, transposed_q4_rows


class TensorSource(Protocol):
    """What the loaders read a checkpoint through (engine.loading.weights.WeightSource, and
    the loader's header-only source); `q4_rows`, `quant_kind` and `transposed_rows` are
    optional (a source of stored 4-bit rows has them)."""

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


@dataclass
class LoadTarget:
    """Where and in which dtype one layer's tensors live."""
    device: torch.device
    dtype: torch.dtype


class Converter:
    """Reads checkpoint tensors with shape checks and converts them to the compute dtype."""

    def __init__(self, source: TensorSource, config: ModelConfig):
        self.source, self.config = source, config
        self.skip_ffn = False  # the sparse engine maps this layer's FFN rows from a prepared file
        # The sparse engine's int4 CPU tier: weights stored as Q4_0 blocks stay the file's
        # 4-bit rows (no dequantize-requantize): matrices of this layer (keep_q4) and FFN
        # rows (keep_q4_ffn: `ffn` returns engine.model.q4_ffn.Q4StagedFfn, no fp32 copy).
        self.keep_q4 = False
        self.keep_q4_ffn = False

    @property
    def values(self) -> "Converter":
        """The converter that reads the checkpoint's values: itself (the loader's header-only
        converter answers its real one, for the FFN it does read)."""
        return self

    def get(self, name: str, shape: tuple[int, ...], where: LoadTarget) -> torch.Tensor:
        return self.source.get(name, shape).to(device=where.device, dtype=where.dtype)

    def _q4(self, name: str, shape: tuple[int, ...], transposed: bool = False) -> torch.Tensor | None:
        """The stored 4-bit rows of `name` (of its transpose), shape-checked, or None."""
        q4_rows = getattr(self.source, "q4_rows", None)
        rows = q4_rows(name, transposed) if q4_rows is not None else None
        if rows is not None and tuple(self.source.shape(name)) != tuple(shape):
            raise ModelFormatError(f"tensor {name} has shape {tuple(self.source.shape(name))} but config.json "
                                   f"implies {tuple(shape)}")
        return rows

    def matrix(self, name: str, shape: tuple[int, int], where: LoadTarget):
        """A weight matrix: with keep_q4 (a CPU-tier layer) a Q4_0 one as its own 4-bit rows
        (engine.kernels.quantized.Q4Matrix over the mapped file), else `get`."""
        if self.keep_q4 and where.device.type == "cpu":
            rows = self._q4(name, shape)
            if rows is not None:
                return Q4Matrix(rows, shape[1])
            quant_kind = getattr(self.source, "quant_kind", None)
            if quant_kind is not None and quant_kind(name) is not None and len(shape) == 2:
                # other blocks (Q8_0, a Q6_K head): 4-bit rows a step of rows at a time, no fp32 copy

                if tuple(self.source.shape(name)) != tuple(shape):
                    raise ModelFormatError(f"tensor {name} has shape {tuple(self.source.shape(name))} but "
                                           f"config.json implies {tuple(shape)}")
                return Q4Matrix(q4_rows_of(self.source, name, shape), shape[1])
        return self.get(name, shape, where)

    def matrix_rows(self, parts: list[tuple[str, tuple[int, int]]], where: LoadTarget):
        """Weights (name, shape) stacked by rows (q/k/v): 4-bit rows as `matrix` when every
        part is stored Q4_0, else one float tensor (`stack_rows`)."""
        if self.keep_q4 and where.device.type == "cpu":
            rows = [self._q4(name, shape) for name, shape in parts]
            if all(r is not None for r in rows):
                return Q4Matrix(torch.cat(rows), parts[0][1][1])
        return self.stack_rows([self.source.get(name, shape) for name, shape in parts], where)

    def maybe(self, name: str, shape: tuple[int, ...], where: LoadTarget) -> torch.Tensor | None:
        return self.get(name, shape, where) if self.source.has(name) else None

    def stack_rows(self, parts: list[torch.Tensor], where: LoadTarget) -> torch.Tensor:
        """Concatenate row blocks into one new tensor (one copy, straight from the map)."""
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty(rows, parts[0].shape[1], dtype=where.dtype, device=where.device)
        offset = 0
        for p in parts:
            out[offset : offset + p.shape[0]].copy_(p)
            offset += p.shape[0]
        return out

    def output_head(self, embed: torch.Tensor, cpu: LoadTarget, head: LoadTarget,
                    name: str = "lm_head.weight") -> torch.Tensor:
        """The output head: its own tensor, or the embeddings when tied or when the
        checkpoint has no head (shared where the two tiers agree in device and dtype)."""
        cfg = self.config
        if cfg.tie_word_embeddings or not self.source.has(name):
            same = head.device == cpu.device and head.dtype == cpu.dtype
            return embed if same else embed.to(head.device, head.dtype)
        return self.matrix(name, (cfg.vocab_size, cfg.hidden_size), head)

    def ffn(self, gate_name: str | None, up_name: str, down_name: str, where: LoadTarget,
            up_bias_name: str | None = None, down_bias_name: str | None = None) -> DenseFfn:
        if self.skip_ffn:
            return None
        cfg = self.config
        d, n = cfg.hidden_size, cfg.intermediate_size
        if self.keep_q4_ffn and up_bias_name is None and down_bias_name is None:
            staged = self._q4_ffn(gate_name, up_name, down_name)
            if staged is not None:  # the sparse split takes the 4-bit rows: no fp32 copy of the layer
                return staged
        up = self.source.get(up_name, (n, d))
        parts = [self.source.get(gate_name, (n, d)), up] if gate_name else [up]
        gate_up = self.stack_rows(parts, where)
        down_t = self.source.get(down_name, (d, n)).t().to(device=where.device, dtype=where.dtype).contiguous()
        up_bias = self.maybe(up_bias_name, (n,), where) if up_bias_name else None
        down_bias = self.maybe(down_bias_name, (d,), where) if down_bias_name else None
        ffn = DenseFfn(gate_up, down_t, gate_name is not None, cfg.activation, cfg.activation_threshold,
                       up_bias, down_bias)
        return ffn

    def _q4_ffn(self, gate_name: str | None, up_name: str, down_name: str):
        """The layer's FFN as 4-bit rows (engine.model.q4_ffn.Q4StagedFfn) when gate and up
        are stored as Q4_0 rows: theirs as they are, the down projection's too when stored
        transposed (PowerInfer's ffn_down_t), else requantized from its values."""
        d, n = self.config.hidden_size, self.config.intermediate_size
        up = self._q4(up_name, (n, d))
        gate = self._q4(gate_name, (n, d)) if gate_name else None
        if up is None or (gate_name and gate is None):
            return None

        down_t = self._q4(down_name, (d, n), transposed=True)
        requantized = down_t is None
        if requantized:
            if tuple(self.source.shape(down_name)) != (d, n):
                raise ModelFormatError(f"tensor {down_name} has shape {tuple(self.source.shape(down_name))} but "
                                       f"config.json implies {(d, n)}")
            down_t = transposed_q4_rows(self.source, down_name, (d, n))
        return Q4StagedFfn(Q4FfnRows(gate, up, down_t, d), self.source, down_name if requantized else None)


def load_gated_globals(conv: Converter, names, cpu: LoadTarget, head: LoadTarget):
    """Embeddings (on the CPU), final RMSNorm and output head of a Llama-layout checkpoint;
    `names` is an engine.arch.llama.GatedTensors."""
    cfg = conv.config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    embed = conv.get(names.embed, (vocab, d), cpu)
    norm = Norm(conv.get(names.final_norm, (d,), head), None, cfg.norm_eps)
    return embed, norm, conv.output_head(embed, cpu, head, names.lm_head)


def load_gated_layer(conv: Converter, names, i: int, where: LoadTarget, ffn_where: LoadTarget | None = None) -> Layer:
    """One Llama-layout layer: separate q/k/v/o projections (optional biases), two RMSNorms,
    a gated FFN."""
    cfg = conv.config
    d, hd = cfg.hidden_size, cfg.head_dim
    p = names.layer.format(i=i)
    q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
    src = conv.source
    qkv = conv.matrix_rows([
        (p + names.q + ".weight", (q_rows, d)),
        (p + names.k + ".weight", (kv_rows, d)),
        (p + names.v + ".weight", (kv_rows, d)),
    ], where)
    qkv_bias = None
    if src.has(p + names.q + ".bias"):
        qkv_bias = torch.cat([
            conv.get(p + names.q + ".bias", (q_rows,), where),
            conv.get(p + names.k + ".bias", (kv_rows,), where),
            conv.get(p + names.v + ".bias", (kv_rows,), where),
        ])
    return Layer(
        attn_norm=Norm(conv.get(p + names.attn_norm, (d,), where), None, cfg.norm_eps),
        mlp_norm=Norm(conv.get(p + names.mlp_norm, (d,), where), None, cfg.norm_eps),
        qkv=qkv,
        qkv_bias=qkv_bias,
        out=conv.matrix(p + names.o + ".weight", (d, q_rows), where),
        out_bias=conv.maybe(p + names.o + ".bias", (d,), where),
        ffn=conv.ffn(p + names.gate, p + names.up, p + names.down, ffn_where or where),
        parallel=False,
        device=where.device,
    )


def load_expert_stacks(conv: Converter, i: int, where: LoadTarget, name: str, parts: tuple[str, str, str]):
    """Layer i's experts as stacked gate, up, down_t [E, n, d], one copy each from the map;
    `name` formats a tensor's name from i, e and part, `parts` names gate, up and down."""
    cfg = conv.config
    d, n, count = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    stacks = [torch.empty(count, n, d, dtype=where.dtype, device=where.device) for _ in range(3)]
    gate, up, down = parts
    source = conv.values.source  # a layer built from a prepared file's headers still reads its experts
    for e in range(count):
        stacks[0][e].copy_(source.get(name.format(i=i, e=e, part=gate), (n, d)))
        stacks[1][e].copy_(source.get(name.format(i=i, e=e, part=up), (n, d)))
        stacks[2][e].copy_(source.get(name.format(i=i, e=e, part=down), (d, n)).t())
    return stacks
