"""Choosing the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from engine.validation import check_sampling


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Raise UserError for any value out of range (NaN, negative, a seed past 2**64...);
        the one check the command line, the window and the server all use."""
        check_sampling(self)


class Sampler:
    def __init__(self, params: SamplingParams, vocab_limit: int | None = None):
        self.params = params
        # Ids at or past this are rows the tokenizer has no token for (a config vocabulary
        # padded beyond it, TurboSparse 32064 vs 32002): they are never sampled.
        self.vocab_limit = vocab_limit
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        p = self.params
        if self.vocab_limit is not None:
            logits = logits[..., : self.vocab_limit]
        logits = logits.float().cpu().clone()  # our own copy: the model's is an inference tensor
        if p.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)), dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs[probs < p.min_p * probs.max()] = 0
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))
