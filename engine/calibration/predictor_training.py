"""Training the per-layer activation predictors from profiled pairs.

Each layer gets PowerInfer's predictor shape, logits = fc2(relu(fc1(x))) with no biases
(the sidecar format has none), trained on the pairs `profiling` stored: x is the
predictor input, the label says which neurons fired. The loss is binary cross-entropy with
the positive class weighted up by the layer's negative/positive ratio (square-rooted and
capped), because at 80-90 % sparsity an unweighted loss learns to predict "off" and loses
recall, while the full ratio drowns precision.

Rank per layer (`rank="auto"`): half the hidden size, scaled down where the layer is
sparser (fewer neurons to name per token) and where its firing is more skewed (a few hot
neurons carry most of it, which a small rank captures), within bounds (see `auto_rank`).

Threshold per layer: on held-back pairs, the highest threshold whose recall still reaches
the target (plus a small margin for unseen text), i.e. the sparsest prediction that keeps
`target_recall` of the real firings.

Finished layers are saved under `profile/predictors/` so an interrupted run resumes with
the next layer. Inputs are standardised per feature while training; the scale is folded
into fc1 at the end, so the saved predictor takes the raw input.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from engine.errors import UserError
from engine.calibration.profiling import load_pairs, profile_dir, read_profile_state
from engine.hotcold.activation_stats import ActivationStats
from engine.arch import read_config
from engine.loading.predictors import PredictorSet

Progress = Callable[[float, str], None]
PARTIAL_DIR = "predictors"
MIN_RANK, MAX_RANK = 128, 1024


@dataclass
class TrainSettings:
    target_recall: float = 0.95
    # Thresholds are set for target + margin on the held-back pairs: recall on unseen text
    # comes out lower (demo model: 0.947 on held-out text for exactly 0.95 on held-back pairs).
    recall_margin: float = 0.01
    rank: int | None = None  # None: auto
    epochs: int = 40
    batch_size: int = 256
    lr: float = 3e-3
    weight_decay: float = 1e-4
    val_fraction: float = 0.1
    max_pos_weight: float = 8.0
    patience: int = 3  # epochs without validation improvement before stopping
    device: str = "cpu"
    seed: int = 0


@dataclass
class LayerReport:
    layer: int
    rank: int
    threshold: float
    recall: float
    precision: float
    actual_sparsity: float
    predicted_sparsity: float
    val_rows: int
    epochs: int

    def to_dict(self) -> dict:
        return asdict(self)


def auto_rank(d: int, n_ff: int, sparsity: float, skew: float) -> int:
    """Predictor rank from a layer's sparsity and skew (both in [0, 1]).

    Half the hidden size for a layer firing 25 % or more, shrinking with the square root of
    the firing rate and by up to half with the skew; rounded up to a multiple of 16, and kept
    between 128 (below it precision collapses: measured on the demo model, rank 32 gave 0.45)
    and 1024 (PowerInfer's 7B predictors are about that size), within min(d, n_ff).
    """
    density = max(1.0 - sparsity, 1e-3)
    scale = min(1.0, max(0.25, math.sqrt(density / 0.25)))
    scale *= 1.0 - 0.5 * min(max(skew, 0.0), 1.0)
    rank = math.ceil(d / 2 * scale / 16) * 16
    limit = min(d, n_ff)
    return int(max(min(MIN_RANK, limit), min(rank, MAX_RANK, limit)))


def firing_skew(counts: torch.Tensor) -> float:
    """How concentrated firing is: the share of all firings made by the busiest 10 % of the
    neurons, rescaled so uniform firing gives 0 and all firing in that 10 % gives 1."""
    total = float(counts.sum())
    if total <= 0:
        return 0.0
    k = max(1, counts.numel() // 10)
    share = float(torch.topk(counts.double(), k).values.sum()) / total
    uniform = k / counts.numel()
    return max(0.0, (share - uniform) / (1.0 - uniform))


def choose_threshold(logits: torch.Tensor, labels: torch.Tensor, target_recall: float) -> float:
    """Highest t with recall(logits >= t) >= target over all (row, neuron) elements."""
    positives = logits[labels]
    if positives.numel() == 0:
        return float(logits.max()) + 1.0  # nothing fires: predict nothing
    need = math.ceil(target_recall * positives.numel())
    # the need-th largest positive logit: exactly `need` positives are at or above it
    return float(torch.topk(positives, need).values[-1])


def prediction_metrics(logits: torch.Tensor, labels: torch.Tensor, threshold: float) -> dict:
    predicted = logits >= threshold
    tp = float((predicted & labels).sum())
    pos, pred = float(labels.sum()), float(predicted.sum())
    n = labels.numel()
    return {
        "recall": tp / pos if pos else 1.0,
        "precision": tp / pred if pred else 1.0,
        "actual_sparsity": 1.0 - pos / n,
        "predicted_sparsity": 1.0 - pred / n,
    }


class LowRankPredictor(torch.nn.Module):
    def __init__(self, d: int, n_ff: int, rank: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, rank, bias=False)
        self.fc2 = torch.nn.Linear(rank, n_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def train_layer(x: torch.Tensor, labels: torch.Tensor, rank: int, settings: TrainSettings,
                progress: Callable[[float], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Train one layer's predictor; returns fc1 [rank, d], fc2 [n_ff, rank] and figures."""
    device = torch.device(settings.device)
    gen = torch.Generator().manual_seed(settings.seed)
    n = x.shape[0]
    if n < 10:
        raise UserError(f"only {n} profiled tokens: profile more text (--max-tokens)")
    order = torch.randperm(n, generator=gen)
    n_val = max(1, int(n * settings.val_fraction))
    val_idx, train_idx = order[:n_val], order[n_val:]
    scale = x[train_idx].pow(2).mean(0).sqrt().clamp_min(1e-6)  # per-feature RMS
    xs = (x / scale).to(device)
    y = labels.to(device)
    density = float(y[train_idx].float().mean())
    pos_weight = min(settings.max_pos_weight, math.sqrt((1 - density) / max(density, 1e-6)))
    pos_weight = max(1.0, pos_weight)

    torch.manual_seed(settings.seed)
    net = LowRankPredictor(x.shape[1], labels.shape[1], rank).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight, device=device))
    steps_per_epoch = math.ceil(len(train_idx) / settings.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=settings.lr, pct_start=0.1,
                                                total_steps=settings.epochs * steps_per_epoch)
    best, best_state, stale, epochs_run = float("inf"), None, 0, 0
    for epoch in range(settings.epochs):
        net.train()
        perm = train_idx[torch.randperm(len(train_idx), generator=gen)].to(device)
        for start in range(0, len(perm), settings.batch_size):
            idx = perm[start : start + settings.batch_size]
            loss = loss_fn(net(xs[idx]), y[idx].float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        epochs_run = epoch + 1
        with torch.no_grad():
            net.eval()
            val_loss = float(loss_fn(net(xs[val_idx.to(device)]), y[val_idx.to(device)].float()))
        if progress:
            progress(epochs_run / settings.epochs)
        if val_loss < best - 1e-4:
            best, stale = val_loss, 0
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        else:
            stale += 1
            if stale >= settings.patience:
                break
    net.load_state_dict(best_state)
    with torch.no_grad():
        val_logits = net(xs[val_idx.to(device)]).cpu()
    val_labels = labels[val_idx]
    threshold = choose_threshold(val_logits, val_labels,
                                 min(1.0, settings.target_recall + settings.recall_margin))
    figures = prediction_metrics(val_logits, val_labels, threshold)
    figures.update(threshold=threshold, val_rows=int(n_val), epochs=epochs_run)
    fc1 = (net.fc1.weight.detach().cpu() / scale).contiguous()  # fold the input scale in
    fc2 = net.fc2.weight.detach().cpu().contiguous()
    return fc1, fc2, figures


def train_predictors(model_dir: str | Path, settings: TrainSettings | None = None,
                     progress: Progress | None = None, restart: bool = False) -> list[LayerReport]:
    """Train every layer's predictor from the profile and save the model's PredictorSet."""

    settings = settings or TrainSettings()
    if not 0.0 < settings.target_recall <= 1.0:
        raise UserError(f"--target-recall must be in (0, 1], not {settings.target_recall}")
    if settings.rank is not None and settings.rank < 1:
        raise UserError(f"--rank must be a positive number or auto, not {settings.rank}")
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is available")
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    if cfg.is_moe:
        raise UserError(f"{model_dir.name} is a mixture of experts: its router chooses the experts and the "
                        "kernels skip the neurons that do not fire, so it needs no predictors")
    state = read_profile_state(model_dir)
    if state is None or not state.get("complete"):
        raise UserError(f"{model_dir} has no finished profile: run "
                        "`thermocline profile --model M --corpus FILE` first")
    stats = ActivationStats.load(model_dir)
    partial = profile_dir(model_dir) / PARTIAL_DIR
    partial.mkdir(parents=True, exist_ok=True)
    key = json.dumps({"profile": state["fingerprint"], **asdict(settings), "device": None})
    reports, fc1s, fc2s = [], [], []
    started = time.monotonic()
    for layer in range(cfg.num_layers):
        done = _load_partial(partial, layer, key) if not restart else None
        if done is None:
            counts = stats.counts[layer]
            sparsity = 1.0 - float(counts.sum()) / (stats.tokens * cfg.n_ff)
            rank = settings.rank or auto_rank(cfg.hidden_size, cfg.n_ff, sparsity, firing_skew(counts))
            x, labels = load_pairs(model_dir, layer)

            def epoch_progress(f, layer=layer):
                if progress:
                    progress((layer + f) / cfg.num_layers, _eta_text(layer, f, cfg.num_layers, started))

            fc1, fc2, fig = train_layer(x, labels, rank, settings,
                                        epoch_progress)
            done = (fc1, fc2, fig)
            _save_partial(partial, layer, key, *done)
        fc1, fc2, fig = done
        fc1s.append(fc1)
        fc2s.append(fc2)
        reports.append(LayerReport(layer=layer, rank=fc1.shape[0], threshold=fig["threshold"],
                                   recall=fig["recall"], precision=fig["precision"],
                                   actual_sparsity=fig["actual_sparsity"],
                                   predicted_sparsity=fig["predicted_sparsity"],
                                   val_rows=fig["val_rows"], epochs=fig["epochs"]))
        if progress:
            progress((layer + 1) / cfg.num_layers, _eta_text(layer + 1, 0.0, cfg.num_layers, started))
    extra = {"trained_with": asdict(settings), "profile_tokens": stats.tokens,
             "layers": [r.to_dict() for r in reports]}
    PredictorSet(fc1=fc1s, fc2=fc2s, thresholds=[r.threshold for r in reports],
                 source="thermocline", extra=extra).save(model_dir)
    return reports


def _eta_text(layer: int, fraction: float, layers: int, started: float) -> str:
    done = layer + fraction
    elapsed = time.monotonic() - started
    eta = elapsed / done * (layers - done) if done > 0 else float("nan")
    eta_text = f"{int(eta) // 60}m{int(eta) % 60:02d}s" if math.isfinite(eta) else "?"
    return f"layer {min(layer + 1, layers)}/{layers}, ETA {eta_text}"


def _save_partial(folder: Path, layer: int, key: str, fc1: torch.Tensor, fc2: torch.Tensor,
                  figures: dict) -> None:
    path = folder / f"layer_{layer:03d}.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file({"fc1": fc1, "fc2": fc2}, str(tmp),
              metadata={"key": key, "figures": json.dumps(figures)})
    os.replace(tmp, path)


def _load_partial(folder: Path, layer: int, key: str):
    from safetensors import safe_open

    path = folder / f"layer_{layer:03d}.safetensors"
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        if meta.get("key") != key:
            return None  # trained with other settings or from another profile
        tensors = load_file(str(path))
        return tensors["fc1"], tensors["fc2"], json.loads(meta["figures"])
    except (OSError, ValueError, KeyError):
        return None
