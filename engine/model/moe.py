"""Mixture-of-experts FFN (SmallThinker): a router picks k experts per token, each expert a
small ReGLU FFN `down(up(x) * relu(gate(x)))`.

The router reads the layer's input before its attention norm (SmallThinker routes before
attention), so `route` runs before attention and the chosen experts are known while it
runs. Scores: top-k of the router logits, then sigmoid of those k renormalised to sum 1,
or a softmax over them when the config asks for it.

Rows are neuron-major like the dense FFN (docs/ARCHITECTURE.md): per expert, gate and up
[n, d] and the down projection transposed, down_t [n, d], so one expert is the same rows
the CPU kernels read for a dense layer, and the kernels' skipping applies inside it: a
neuron whose relu(gate) is 0 reads neither its up nor its down row (the second level of
sparsity, exact, no predictor).

`DenseMoe` is the reference and the `dense` mode: every expert on one device, plain
matmuls. The tiered version (hot experts on the fast device, cold on the CPU) is in
engine/hotcold/moe_tiers.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.quantized import Int8Matrix, matrix_nbytes
from engine.model.layers import linear


@dataclass
class Routing:
    """The router's choice for T tokens."""
    inputs: torch.Tensor   # [T, d] what the router read (the layer input)
    experts: torch.Tensor  # long [T, k] chosen expert ids, best first
    weights: torch.Tensor  # fp32 [T, k] their mixing weights

    def scattered(self, num_experts: int) -> torch.Tensor:
        """fp32 [T, E]: each token's weight per expert, 0 where not chosen (what the FFN
        observer sees: an expert 'fired' for a token when it was chosen)."""
        out = torch.zeros(self.experts.shape[0], num_experts, dtype=torch.float32, device=self.weights.device)
        return out.scatter_(1, self.experts.to(out.device), self.weights)


def route(router: torch.Tensor | Int8Matrix, x: torch.Tensor, k: int, softmax: bool) -> Routing:
    """x [T, d] -> the k experts of each token and their weights (fp32)."""
    logits = linear(x, router).float()
    top, experts = torch.topk(logits, k, dim=-1)
    if softmax:
        weights = torch.softmax(top, dim=-1)
    else:
        weights = torch.sigmoid(top)
        weights = weights / weights.sum(-1, keepdim=True)
    return Routing(x, experts, weights)


def reglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """One expert on tokens x [T, d] with dense matmuls: down(up(x) * relu(gate(x)))."""
    return (F.relu(F.linear(x, gate)) * F.linear(x, up)) @ down_t


def experts_by_token(routing: Routing) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, token rows, weights [rows]) for every expert chosen by some token."""
    experts = routing.experts.cpu()
    out = []
    for e in torch.unique(experts).tolist():
        tokens, slot = torch.nonzero(experts == e, as_tuple=True)
        out.append((e, tokens, routing.weights[tokens.to(routing.weights.device), slot.to(routing.weights.device)]))
    return out


class DenseMoe:
    """Every expert of one layer on one device, computed with dense matmuls.

    gate, up, down_t: [E, n, d] (down_t is `down` transposed, neuron-major).
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor):
        self.gate, self.up, self.down_t = gate, up, down_t
        self.num_experts, self.n_ff = gate.shape[0], gate.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(matrix_nbytes(t) for t in (self.gate, self.up, self.down_t))

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate[e], self.up[e], self.down_t[e]

    def __call__(self, x: torch.Tensor, routing: Routing, layer: int, observer=None) -> torch.Tensor:
        """x [T, d]: the post-attention-normed hidden state; routing: from `route` on the
        layer input."""
        if observer is not None:
            observer(layer, routing.inputs, routing.scattered(self.num_experts))
        count_neurons = getattr(observer, "expert_neurons", None)  # profiling: firing inside each expert
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e, tokens, weights in experts_by_token(routing):
            tokens = tokens.to(x.device)
            gate, up, down_t = self.expert(e)
            xs = x[tokens]
            act = F.relu(F.linear(xs, gate)) * F.linear(xs, up)
            if count_neurons is not None:
                count_neurons(layer, e, (act != 0).sum(0))
            out.index_add_(0, tokens, (act @ down_t).float() * weights.to(x.device)[:, None])
        return out.to(x.dtype)


def placement_frequencies(stats, num_experts: int, n: int, layers: int) -> list[np.ndarray]:
    """What the solver ranks the neurons of a mixture's experts by (unit e*n + j: neuron j
    of expert e): the rows a token reads from the CPU tier while the neuron stays there, a
    third each. A chosen expert reads every gate row and the up and down rows of the
    neurons that fire, so neuron j of expert e scores (P(e chosen) + 2 P(j fires)) / 3.
    With expert counts only (an earlier profile), every neuron of an expert scores
    P(e chosen): whole experts by use. Without statistics (None), all alike."""
    if stats is None:
        return [np.ones(num_experts * n) for _ in range(layers)]
    chosen = [c.double().numpy() / max(stats.tokens, 1) for c in stats.counts]
    if any(len(c) != num_experts for c in chosen) or len(chosen) != layers:
        raise ValueError("expert counts do not match the model")
    if stats.expert_neurons is None:
        return [np.repeat(c, n) for c in chosen]
    out = []
    for c, fired in zip(chosen, stats.expert_neurons):
        if tuple(fired.shape) != (num_experts, n):
            raise ValueError("expert neuron counts do not match the model")
        fires = fired.double().numpy() / max(stats.tokens, 1)
        out.append(((c[:, None] + 2 * fires) / 3).reshape(-1))
    return out
