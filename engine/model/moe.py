"""Mixture-of-experts FFN (SmallThinker, TurboSparse-Mixtral): a router picks k experts per
token, each expert a small gated FFN: ReGLU `down(up(x) * relu(gate(x)))` (SmallThinker) or
dReLU `down(relu(up(x)) * relu(gate(x)))` (TurboSparse-Mixtral; `activation`).

SmallThinker's router reads the layer's input before its attention norm, so `route` runs
before attention and the chosen experts are known while it runs; Mixtral's reads the FFN's
normed input (ModelConfig.router_input). Scores: top-k of the router logits, then sigmoid
of those k renormalised to sum 1, or a softmax over them (Mixtral's softmax over all
experts, top-k, renormalised, is the same numbers).

TurboSparse-Mixtral's experts each carry a neuron predictor (`ExpertPredictors`): its
published forward multiplies a chosen expert's activations by round(sigmoid(fc2(relu(fc1(x))))),
so only the predicted neurons count. The sparse and hybrid modes compute exactly those;
the dense mode (`DenseMoe`, every neuron) is the same experts without the masks.

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


def expert_acts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "relu") -> torch.Tensor:
    """An expert's activations on tokens x [T, d]: relu(gate(x)) * up(x) (ReGLU, "relu")
    or relu(gate(x)) * relu(up(x)) (dReLU, "drelu")."""
    up_x = F.linear(x, up)
    return F.relu(F.linear(x, gate)) * (F.relu(up_x) if activation == "drelu" else up_x)


def reglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor,
          activation: str = "relu", mask: torch.Tensor | None = None) -> torch.Tensor:
    """One expert on tokens x [T, d] with dense matmuls: down(act), act as `expert_acts`,
    times `mask` [T, n] (a predictor's 0/1 choice) when given."""
    act = expert_acts(x, gate, up, activation)
    return (act if mask is None else act * mask.to(act.dtype)) @ down_t


class ExpertPredictors:
    """The neuron predictors one layer's experts carry (TurboSparse-Mixtral: one per expert,
    `experts.{e}.predictor.fc1/fc2`): neuron j of expert e fires when
    sigmoid(fc2[e] @ relu(fc1[e] @ x))_j > 0.5, i.e. its logit > 0 (the published forward
    rounds the sigmoid; 0.5 rounds to 0). They read the expert's input. fc1 [rank, d] and
    fc2 [n, rank] per expert: plain tensors, or int8 rows on an int8 or int4 CPU tier."""

    THRESHOLD = 0.0  # logit > 0 (the kernels take >= : equality has measure zero)

    def __init__(self, fc1: list, fc2: list):
        self.fc1, self.fc2 = list(fc1), list(fc2)

    @property
    def rank(self) -> int:
        return self.fc1[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(matrix_nbytes(w) for w in (*self.fc1, *self.fc2))

    def logits(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """fp32 [T, n]: expert e's predictor logits on its inputs x [T, d]."""
        return linear(F.relu(linear(x, self.fc1[e])), self.fc2[e]).float()

    def mask(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """bool [T, n]: the neurons expert e's predictor lets fire."""
        return self.logits(e, x) > self.THRESHOLD

    def placed(self, place) -> "ExpertPredictors":
        """The same predictors with every matrix passed through `place` (a tier's storage)."""
        return ExpertPredictors([place(w) for w in self.fc1], [place(w) for w in self.fc2])


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

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor, activation: str = "relu",
                 predictors: ExpertPredictors | None = None):
        self.gate, self.up, self.down_t = gate, up, down_t
        self.num_experts, self.n_ff = gate.shape[0], gate.shape[1]
        self.activation = activation
        # carried for the tiered runtime (engine.hotcold.moe_tiers); the dense mode computes every neuron
        self.predictors = predictors

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
            act = expert_acts(xs, gate, up, self.activation)
            if count_neurons is not None:
                count_neurons(layer, e, (act != 0).sum(0))
            out.index_add_(0, tokens, (act @ down_t).float() * weights.to(x.device)[:, None])
        return out.to(x.dtype)


def need_frequencies(stats, num_experts: int, n: int, layers: int, predicted: bool) -> list[np.ndarray] | None:
    """How often a token needs each unit's rows resident (the disk tier's cache order and
    reads, engine.hotcold.placement): P(e chosen) for every neuron of expert e (a chosen
    expert reads all its gate rows), or, where the experts carry predictors (`predicted`),
    P(j fires) of its neurons (those the predictor picks; fires as profiled stand in for
    them). None without statistics: the placement's frequencies."""
    if stats is None:
        return None
    chosen = [c.double().numpy() / max(stats.tokens, 1) for c in stats.counts]
    if any(len(c) != num_experts for c in chosen) or len(chosen) != layers:
        raise ValueError("expert counts do not match the model")
    if not predicted or stats.expert_neurons is None:
        return [np.repeat(c, n) for c in chosen]
    return [(fired.double().numpy() / max(stats.tokens, 1)).reshape(-1) for fired in stats.expert_neurons]


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
