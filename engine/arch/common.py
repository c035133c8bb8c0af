"""What the per-family loaders share: tensor conversion and the FFN row layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model import DenseFfn
from ..weights import WeightSource


@dataclass
class Placement:
    """Where and in which dtype one layer's tensors live."""
    device: torch.device
    dtype: torch.dtype


class Converter:
    """Reads checkpoint tensors with shape checks and converts them to the compute dtype."""

    def __init__(self, source: WeightSource, config: ModelConfig):
        self.source, self.config = source, config
        self.skip_ffn = False  # the sparse engine maps this layer's FFN rows from a prepared file

    def get(self, name: str, shape: tuple[int, ...], where: Placement) -> torch.Tensor:
        return self.source.get(name, shape).to(device=where.device, dtype=where.dtype)

    def maybe(self, name: str, shape: tuple[int, ...], where: Placement) -> torch.Tensor | None:
        return self.get(name, shape, where) if self.source.has(name) else None

    def stack_rows(self, parts: list[torch.Tensor], where: Placement) -> torch.Tensor:
        """Concatenate row blocks into one new tensor (one copy, straight from the map)."""
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty(rows, parts[0].shape[1], dtype=where.dtype, device=where.device)
        offset = 0
        for p in parts:
            out[offset : offset + p.shape[0]].copy_(p)
            offset += p.shape[0]
        return out

    def output_head(self, embed: torch.Tensor, cpu: Placement, head: Placement) -> torch.Tensor:
        """The output head: its own tensor, or the embeddings when tied (shared where the
        two tiers agree in device and dtype)."""
        cfg = self.config
        if cfg.tie_word_embeddings or not self.source.has("lm_head.weight"):
            same = head.device == cpu.device and head.dtype == cpu.dtype
            return embed if same else embed.to(head.device, head.dtype)
        return self.get("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), head)

    def ffn(self, gate_name: str | None, up_name: str, down_name: str, where: Placement,
            up_bias_name: str | None = None, down_bias_name: str | None = None) -> DenseFfn:
        if self.skip_ffn:
            return None
        cfg = self.config
        d, n = cfg.hidden_size, cfg.intermediate_size
        up = self.source.get(up_name, (n, d))
        parts = [self.source.get(gate_name, (n, d)), up] if gate_name else [up]
        gate_up = self.stack_rows(parts, where)
        down_t = self.source.get(down_name, (d, n)).t().to(device=where.device, dtype=where.dtype).contiguous()
        up_bias = self.maybe(up_bias_name, (n,), where) if up_bias_name else None
        down_bias = self.maybe(down_bias_name, (d,), where) if down_bias_name else None
        return DenseFfn(gate_up, down_t, gate_name is not None, cfg.activation, cfg.activation_threshold,
                        up_bias, down_bias)
