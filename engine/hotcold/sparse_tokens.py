"""The sparse runtime's per-token hooks: predictor logits, the generation's counters, the
scoring switch, and the re-placement queued for the next token boundary. `FfnContext` is
what one layer's FFN reads of them (its layer's predictor and threshold, the mode, the
counters), so an FFN holds a small context, not the whole runtime.

A mixin of `engine.hotcold.sparse.SparseRuntime`: reads its predictors, thresholds, mode,
override_masks and _pending/_pending_lock, and calls its `apply` (engine.sparse_moves).
"""

from __future__ import annotations

import contextlib

import torch

from engine.errors import UserError
from engine.hotcold.hybrid_ffn import FfnCounters


class FfnContext:
    """What layer `layer`'s FFN needs of the runtime at each token."""

    __slots__ = ("layer", "_hooks")

    def __init__(self, layer: int, hooks: "TokenHooks"):
        self.layer, self._hooks = layer, hooks

    @property
    def mode(self) -> str:
        """The mode the engine was loaded in."""
        return self._hooks.mode

    @property
    def scoring_mode(self) -> str | None:
        """The mode `Engine.score` runs as, during a scoring; else None."""
        return self._hooks.scoring_mode

    @property
    def has_predictors(self) -> bool:
        return self._hooks.predictors is not None

    @property
    def cpu_weights(self) -> str:
        return self._hooks.cpu_weights

    @property
    def threshold(self) -> float:
        """The predictor logit a neuron needs to be computed."""
        return self._hooks.thresholds[self.layer]

    @property
    def counters(self) -> FfnCounters:
        """This generation's counters (a new object per generation)."""
        return self._hooks.counters

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._hooks.predictor_logits(self.layer, x)


class TokenHooks:
    def predictor_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.predictors is None:
            raise UserError("this mode needs activation predictors")
        logits = self.predictors.logits(layer, x)
        if self.override_masks is not None:
            threshold = self.thresholds[layer]
            # one drawn set per token, as each token decoded alone would draw it
            masks = [self.override_masks(layer) for _ in range(len(logits) if logits.dim() == 2 else 1)]
            mask = masks[0] if logits.dim() == 1 else torch.stack(masks)
            return torch.where(mask.to(logits.device), threshold + 1.0, threshold - 1.0)
        return logits

    def begin_generation(self) -> None:
        self.counters = FfnCounters()
        self.at_token_boundary()

    def at_token_boundary(self) -> None:
        with self._pending_lock:
            plan, self._pending = self._pending, None
        if plan is not None:
            self.apply(plan)

    def generation_fractions(self) -> tuple[float, float]:
        return self.counters.fractions()

    @contextlib.contextmanager
    def scoring(self, mode: str):
        if mode not in ("sparse", "hybrid", "oracle"):
            raise UserError(f"unknown scoring mode {mode}")
        if mode != "oracle" and self.predictors is None:
            raise UserError(f"mode {mode} needs activation predictors")
        self.scoring_mode = mode
        try:
            yield
        finally:
            self.scoring_mode = None

    def ffn_context(self, layer: int) -> FfnContext:
        return FfnContext(layer, self)
