"""Quality of sparse inference on held-out text: perplexity, agreement, predictor figures.

The same token windows are scored (teacher forcing) three ways by one sparse-loaded engine:
`dense` (every neuron), `sparse` (the predictors choose, skipped neurons give 0) and `oracle`
(exactly the neurons that fire: must equal dense, a check of the sparse path itself).
All three read the same weights (the CPU tier's in int8 unless the engine was loaded with
cpu_weights="fp32"), so the sparse/dense ratio measures the predictors alone; `cpu_weights`
in the report says which were read.

- ppl_*: exp of the mean next-token negative log-likelihood over all scored positions.
  A SiLU model with CATS thresholds (`cats`): dense is the model without them, oracle the
  thresholded model exactly, sparse the predictors' choice; the firing figures come from
  the oracle pass.
- greedy_agreement: share of positions where sparse and dense pick the same greedy (argmax)
  next token. Teacher-forced, so one early difference does not count every later token.
- Per layer, from the dense pass with an FFN observer: the true firing set against the
  predictor's (logit >= the layer's threshold): recall, precision, actual and predicted
  sparsity. Model-level figures are the means over layers.
- Per layer, the placed predictors (in the CPU tier's format) against their original as the
  predictors file stores it: `selected_vs_original`, the neurons the placed one selects over
  those the original selects, and `recall_of_original`, the share of the original's selection
  the placed one keeps (issue #30's goals: <= 1.15 and >= 0.95); the worst layer of each too.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from engine.errors import UserError
from engine.calibration.profiling import corpus_windows, read_corpus
from engine.loading.sidecar import SIDECAR, sidecar_dir
from engine.loading.predictors import PredictorSet

Progress = Callable[[float, str], None]
EVAL_TEXT = "eval.txt"  # optional held-out text shipped in a model's sidecar folder
MODES = ("dense", "sparse", "oracle")


@dataclass
class EvalSettings:
    max_tokens: int = 2048
    window: int = 256


def default_corpus(model_dir: Path) -> Path:
    path = sidecar_dir(model_dir) / EVAL_TEXT
    if not path.is_file():
        raise UserError(f"{model_dir} ships no held-out text ({SIDECAR}/{EVAL_TEXT}): "
                        "pass --corpus FILE with text the model was not profiled on")
    return path


class _LayerTally:
    """Confusion counts of predicted against true firing for one layer."""

    def __init__(self):
        self.tp = self.pos = self.pred = self.n = 0
        self.original = self.kept = 0  # the original predictor's selection, and the placed one's share of it

    def add(self, predicted: torch.Tensor, fired: torch.Tensor, original: torch.Tensor) -> None:
        self.tp += int((predicted & fired).sum())
        self.pos += int(fired.sum())
        self.pred += int(predicted.sum())
        self.n += fired.numel()
        self.original += int(original.sum())
        self.kept += int((predicted & original).sum())

    def figures(self) -> dict:
        return {
            "sparsity": 1.0 - self.pos / self.n,
            "predicted_sparsity": 1.0 - self.pred / self.n,
            "recall": self.tp / self.pos if self.pos else 1.0,
            "precision": self.tp / self.pred if self.pred else 1.0,
            "selected_vs_original": self.pred / self.original if self.original else 1.0,
            "recall_of_original": self.kept / self.original if self.original else 1.0,
        }


@contextmanager
def _thresholds_off(model):
    """Every layer's FFN without its activation threshold (CATS off: the dense SiLU model)."""
    saved = [layer.ffn.threshold for layer in model.layers]
    try:
        for layer in model.layers:
            layer.ffn.threshold = 0.0
        yield
    finally:
        for layer, t in zip(model.layers, saved):
            layer.ffn.threshold = t


def selection_vs_original(engine, token_ids: list[int]) -> dict:
    """The placed predictors' selection against their original's (the predictors file, in
    fp32) on one sequence's FFN inputs, over all layers: `selected_vs_original` and
    `recall_of_original` as `evaluate` reports them (bench.vs_llamacpp's figures)."""
    from engine.loading.predictors import PredictorSet

    placed, original = engine.sparse.predictors, PredictorSet.load(Path(engine.model_dir))
    tally = _LayerTally()

    def observe(layer: int, pred_input: torch.Tensor, act: torch.Tensor) -> None:
        selected = placed.predict(layer, pred_input.to(placed.fc1[layer].device)).cpu()
        tally.add(selected, act.cpu() != 0, original.predict(layer, pred_input.cpu()))

    previous, engine.model.ffn_observer = engine.model.ffn_observer, observe
    try:
        engine.score(token_ids, "dense")
    finally:
        engine.model.ffn_observer = previous
    figures = tally.figures()
    return {k: figures[k] for k in ("selected_vs_original", "recall_of_original")}


def evaluate(engine, corpus: list[str | Path] | None = None, settings: EvalSettings | None = None,
             progress: Progress | None = None) -> dict:
    """Evaluate an engine loaded in a sparse mode (see the module docstring)."""
    settings = settings or EvalSettings()
    if engine.sparse is None:
        raise UserError("evaluation needs the model loaded in sparse mode")
    model_dir = Path(engine.model_dir)
    text = read_corpus(corpus or [default_corpus(model_dir)])
    windows = corpus_windows(engine.tokenizer, text, min(settings.window, engine.ctx),
                             settings.max_tokens)
    predictors = engine.sparse.predictors  # as the engine runs them (int8 on an int8 CPU tier)
    if predictors is None and not engine.config.is_moe:
        predictors = PredictorSet.load(model_dir)
    # the predictors as their file stores them, computed in fp32 on the CPU
    original = PredictorSet.load(model_dir) if predictors is not None else None
    tallies = [_LayerTally() for _ in range(engine.config.num_layers)]

    def observe(layer: int, pred_input: torch.Tensor, act: torch.Tensor) -> None:
        if predictors is None:  # a mixture of experts: the router chooses, exactly (act = experts)
            fired = (act != 0).cpu()
            tallies[layer].add(fired, fired, fired)
            return
        logits = predictors.logits(layer, pred_input.to(predictors.fc1[layer].device))
        selected = original.logits(layer, pred_input.cpu()) >= original.thresholds[layer]
        tallies[layer].add((logits >= predictors.thresholds[layer]).cpu(), (act != 0).cpu(), selected)

    nll = {m: 0.0 for m in MODES}
    agree = scored = 0
    previous = engine.model.ffn_observer
    # CATS (a SiLU model's calibrated thresholds): dense is the model itself, thresholds off;
    # oracle computes exactly the neurons above them, and its pass shows which fired
    cats = bool(engine.config.cats_thresholds)
    observed = "oracle" if cats else "dense"
    try:
        for i, ids in enumerate(windows):
            target = torch.tensor(ids[1:])
            logits = {}
            for mode in MODES:
                engine.model.ffn_observer = observe if mode == observed else None
                if cats and mode == "dense":  # every neuron, thresholds off (a sparse engine's
                    with _thresholds_off(engine.model):  # plain "dense" score runs its predictors)
                        out = engine.score(ids, "oracle")[:-1].float().cpu()
                else:
                    out = engine.score(ids, mode)[:-1].float().cpu()
                logits[mode] = out
                nll[mode] += float(F.cross_entropy(out, target, reduction="sum"))
            agree += int((logits["sparse"].argmax(-1) == logits["dense"].argmax(-1)).sum())
            scored += len(target)
            if progress:
                progress((i + 1) / len(windows), f"{scored} tokens scored")
    finally:
        engine.model.ffn_observer = previous
    per_layer = [{"layer": i, "threshold": float(predictors.thresholds[i]) if predictors else 0.0, **t.figures()}
                 for i, t in enumerate(tallies)]
    mean = lambda key: sum(layer[key] for layer in per_layer) / len(per_layer)  # noqa: E731
    ppl = {m: math.exp(nll[m] / scored) for m in MODES}
    return {
        "model": str(model_dir),
        "tokens": scored,
        "windows": len(windows),
        "ppl_dense": ppl["dense"],
        "ppl_sparse": ppl["sparse"],
        "ppl_oracle": ppl["oracle"],
        "ppl_sparse_ratio": ppl["sparse"] / ppl["dense"],
        "greedy_agreement": agree / scored,
        "sparsity": mean("sparsity"),
        "recall": mean("recall"),
        "precision": mean("precision"),
        "predicted_sparsity": mean("predicted_sparsity"),
        "selected_vs_original": mean("selected_vs_original"),
        "selected_vs_original_max": max(layer["selected_vs_original"] for layer in per_layer),
        "recall_of_original": mean("recall_of_original"),
        "recall_of_original_min": min(layer["recall_of_original"] for layer in per_layer),
        "predictor_source": predictors.source if predictors else "router",
        "cats": cats,  # SiLU thresholds: ppl_oracle is the thresholded model exactly, ppl_dense the model
        "cpu_weights": engine.sparse.cpu_weights,
        "per_layer": per_layer,
    }
