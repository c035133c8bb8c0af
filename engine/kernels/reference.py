"""Pure-torch sparse FFN over the row layout: the reference every kernel is checked against,
and the fallback the CPU path uses when numba is missing or disabled.

Row layout (docs/ARCHITECTURE.md): neuron i is row i of `gate` [n, d] (optional), `up` [n, d]
and `down_t` [n, d] (= down_proj.weight.T, contiguous). Accumulation is fp32 whatever the
row dtype.

Activations (the nonlinearity acts on the gate when there is one, else on up): the table of
`engine.activations`. `act_threshold` only matters for fatrelu and silu (CATS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import activations as activation_names

ACTIVATIONS = activation_names.NAMES
check_activation = activation_names.check


def gate_nonlinearity(g: torch.Tensor, activation: str, act_threshold: float = 0.0) -> torch.Tensor:
    """The nonlinearity applied to the gate (gated FFN) or to up (ungated FFN). FATReLU at
    threshold 0 is a plain relu, so NaN stays NaN (a broken checkpoint is caught, not masked)."""
    check_activation(activation)
    if activation == "silu":  # SwiGLU; a CATS threshold zeroes the small magnitudes
        s = F.silu(g)
        return torch.where(s.abs() < act_threshold, torch.zeros((), dtype=g.dtype, device=g.device), s) \
            if act_threshold > 0 else s
    if activation == "fatrelu" and act_threshold > 0:
        return torch.where(g >= act_threshold, g, torch.zeros((), dtype=g.dtype, device=g.device))
    r = torch.relu(g)
    return r * r if activation == "relu2" else r


def activations(g: torch.Tensor | None, u: torch.Tensor, activation: str,
                act_threshold: float = 0.0) -> torch.Tensor:
    """Per-neuron activation from the gate and up pre-activations (g None: ungated): the one
    torch definition, used by the model's dense FFN, the hybrid FFN and every kernel's check;
    a neuron fired iff its value is not 0."""
    if g is None:
        return gate_nonlinearity(u, activation, act_threshold)
    if activation == "drelu":
        u = torch.relu(u)
    return gate_nonlinearity(g, activation, act_threshold) * u


def dense_ffn(x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor,
              activation: str, act_threshold: float = 0.0) -> torch.Tensor:
    """The dense FFN as an `F.linear` chain in the dtype of the rows (the benchmark baseline)."""
    u = F.linear(x, up)
    g = F.linear(x, gate) if gate is not None else None
    a = activations(g, u, activation, act_threshold)
    return a @ down_t


def sparse_ffn(x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor,
               active: torch.Tensor | None, activation: str, act_threshold: float = 0.0,
               out_acts: torch.Tensor | None = None, *,
               scales: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None,
               ) -> torch.Tensor:
    """y fp32 [d] = sum over computed neurons i of act_i * down_t[i].

    `active`: int [k] neuron ids to compute (the predicted set), or None for all n.
    `out_acts`: optional fp32 [k] (or [n] when active is None) filled with the activations.
    `scales`: (gate_scale, up_scale, down_scale) fp32 [n] for int8 rows (row i is
    q[i] * scale[i]); gate_scale is None when there is no gate.
    Only the selected gate/up rows, and the down rows of neurons whose activation is
    nonzero, are read (gathered: this is the reference, not the fast path).
    """
    check_activation(activation)
    x = x.to(torch.float32)
    gate_s, up_s, down_s = scales if scales is not None else (None, None, None)
    if active is not None:
        active = active.to(device=up.device, dtype=torch.long)
    u = _row_dots(up, up_s, active, x)
    g = _row_dots(gate, gate_s, active, x) if gate is not None else None
    a = activations(g, u, activation, act_threshold)
    if out_acts is not None:
        out_acts.copy_(a)
    fired = torch.nonzero(a).squeeze(1)
    rows = fired if active is None else active.index_select(0, fired)
    coef = a.index_select(0, fired)
    if down_s is not None:
        coef = coef * down_s.index_select(0, rows)
    return coef @ down_t.index_select(0, rows).to(torch.float32)


def _row_dots(w: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor | None,
              x: torch.Tensor) -> torch.Tensor:
    """(w[rows] . x) * scale[rows] in fp32; all rows when `rows` is None."""
    if rows is not None:
        w = w.index_select(0, rows)
        scale = scale.index_select(0, rows) if scale is not None else None
    out = w.to(torch.float32) @ x
    return out * scale if scale is not None else out
