"""Choosing the next token: greedy, temperature, top-k, top-p, min-p, and the logits' adjustments
before them: a bias per token, the repetition penalty, and OpenAI's presence and frequency
penalties.

OpenAI's penalties (its "parameter details"): for each token j sampled so far in this answer
(the prompt does not count), `logit[j] -= count[j] * frequency_penalty + (count[j] > 0) *
presence_penalty`. The bias is added to the logits as they come from the model, so a bias of
-100 bans a token and +100 forces it, greedy included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from engine.validation import check_sampling

if TYPE_CHECKING:
    from engine.runtime.constraints import Constraint, GrammarSpec


def first_maxima(logits: torch.Tensor):
    """Each row's index of its first maximum (a NaN counts as the maximum), as torch.argmax over
    the last dimension gives it, as a numpy array (a 0-d one for one row). numpy's on a CPU
    fp32 tensor: one thread, and 3 µs for a row of 32,000 against torch's 54 (12 against 91 µs
    for a step's 8 rows of 4,096, 55 against 380 for rows of 32,000), where torch's also wakes
    its thread pool beside numba's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1)
    return logits.argmax(dim=-1).cpu().numpy()


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # -2..2, OpenAI's definition (module docstring)
    frequency_penalty: float = 0.0  # -2..2
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> -100..100, added to its logit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # What the answer must match (engine.runtime.constraints): the sampler masks every other token.
    grammar: "GrammarSpec | None" = None

    def validate(self) -> None:
        """Raise UserError for any value out of range (NaN, negative, a seed past 2**64...);
        the one check the command line, the window and the server all use."""
        check_sampling(self)


class Sampler:
    def __init__(self, params: SamplingParams, vocab_limit: int | None = None,
                 constraint: "Constraint | None" = None):
        self.params = params
        self.constraint = constraint  # the grammar's mask, applied in every mode (greedy too)
        # Ids at or past this are rows the tokenizer has no token for (a config vocabulary
        # padded beyond it, TurboSparse 32064 vs 32002): they are never sampled.
        self.vocab_limit = vocab_limit
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.counts: dict[int, int] = {}  # how often each token was sampled in this answer
        if params.logit_bias:
            self._bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            self._bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first (no bias, penalty or grammar): the
        token is the argmax of the logits within `vocab_limit`, which a batch takes for all such
        rows in one call."""
        p = self.params
        return (p.temperature == 0 and not p.logit_bias and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty and self.constraint is None)

    def accept(self, token: int) -> None:
        """The token chosen (by this sampler or not) joins the answer: the penalties count it."""
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.constraint is not None:
            self.constraint.accept(token)

    def adjust(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The logits after the bias, the penalties and the grammar's mask: a float32 copy of our own."""
        p = self.params
        if self.vocab_limit is not None:
            logits = logits[..., : self.vocab_limit]
        logits = logits.float().cpu().clone()  # our own copy: the model's is an inference tensor
        if p.logit_bias:
            keep = self._bias_ids < logits.shape[-1]
            logits.index_add_(0, self._bias_ids[keep], self._bias[keep])
        if p.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)), dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= counts * p.frequency_penalty + p.presence_penalty
        if self.constraint is not None:
            self.constraint.apply(logits)
        return logits

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        p = self.params
        logits = self.adjust(logits, history)
        if p.temperature == 0:
            return int(first_maxima(logits.reshape(-1)))
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
