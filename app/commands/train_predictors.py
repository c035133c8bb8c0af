"""`thermocline train-predictors`: per-layer activation predictors from a profile."""

from __future__ import annotations

import json

from .progress_bar import ProgressBar


def _rank(text: str):
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"rank must be auto or a positive integer, not {text!r}") from None
    if value < 1:
        raise ValueError(f"rank must be auto or a positive integer, not {text!r}")
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser("train-predictors", help="train activation predictors")
    parser.add_argument("--model", default="demo", help="model folder or catalogue id (default: demo)")
    parser.add_argument("--target-recall", type=float, default=0.95,
                        help="share of firing neurons each layer's predictor must catch")
    parser.add_argument("--rank", default="auto", help="predictor rank: auto (per layer) or N")
    parser.add_argument("--epochs", type=int, default=40, help="at most; stops early when validation stalls")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--restart", action="store_true", help="retrain layers already done")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=run)


def run(args) -> int:
    import torch

    from engine.errors import UserError
    from engine.calibration.predictor_training import TrainSettings, train_predictors
    from models_registry.resolve import resolve_model

    try:
        rank = _rank(args.rank)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.epochs < 1:
        raise UserError("--epochs must be at least 1")
    if not 0 < args.target_recall <= 1:  # also refuses nan
        raise UserError(f"--target-recall must be in (0, 1], not {args.target_recall}")
    from engine.validation import check_threads, resolve_device

    resolve_device(args.device)
    if check_threads(args.threads, "--threads"):
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    settings = TrainSettings(target_recall=args.target_recall, rank=rank, epochs=args.epochs,
                             device=args.device)
    bar = ProgressBar("train-predictors")
    reports = train_predictors(model_dir, settings, progress=bar, restart=args.restart)
    bar.done()
    if args.json:
        print(json.dumps({"model": str(model_dir), "layers": [r.to_dict() for r in reports]}))
        return 0
    print(f"predictors saved in {model_dir}/thermocline/predictors.safetensors")
    print("layer  rank  recall  precision  sparsity  predicted  threshold")
    for r in reports:
        print(f"{r.layer:5d} {r.rank:5d}  {r.recall:6.3f}  {r.precision:9.3f}  "
              f"{r.actual_sparsity * 100:7.1f}%  {r.predicted_sparsity * 100:8.1f}%  {r.threshold:9.3f}")
    return 0
