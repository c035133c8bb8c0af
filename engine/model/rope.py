"""Rotary position embeddings with the Llama scaling variants (rotate-half convention)."""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, ctx: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies and the attention factor applied to cos/sin."""
    dim = head_dim
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (base ** exponents)
    orig = rope.original_max_positions or ctx
    factor = rope.factor
    if rope.kind == "linear":
        return inv / factor, 1.0
    if rope.kind == "dynamic":
        # NTK-aware: the base grows once the window exceeds the trained length. Fixed for
        # the chosen context instead of per step, so the cache stays consistent.
        if ctx > orig:
            base = base * ((factor * ctx / orig) - (factor - 1)) ** (dim / (dim - 2))
            inv = 1.0 / (base ** exponents)
        return inv, 1.0
    if rope.kind == "llama3":
        low_wavelen = orig / rope.low_freq_factor
        high_wavelen = orig / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.kind == "yarn":
        attention = rope.attention_factor
        if attention is None:
            attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(rope.beta_fast)), 0)
        high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        return inv, float(attention)
    return inv, 1.0


class RotaryTable:
    """cos/sin per position, grown on demand (rolling caches can pass the context size)."""

    def __init__(self, rope: RopeConfig, head_dim: int, ctx: int, dtype: torch.dtype, device: torch.device):
        self.inv_freq, self.scale = inverse_frequencies(rope, head_dim, ctx)
        self.dtype, self.device = dtype, device
        self.cos = self.sin = torch.empty(0)
        self._grow(ctx)

    def _grow(self, length: int) -> None:
        t = torch.arange(length, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.scale).to(self.device, self.dtype)
        self.sin = (emb.sin() * self.scale).to(self.device, self.dtype)

    def at(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start + length > self.cos.shape[0]:
            self._grow(max(2 * self.cos.shape[0], start + length))
        return self.cos[start : start + length], self.sin[start : start + length]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, head_dim]; cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
