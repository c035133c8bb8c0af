"""`thermocline profile`: activation counts and predictor training pairs from calibration text."""

from __future__ import annotations

import argparse
import json

from engine.errors import UserError
from engine.units import format_size, parse_size

from .progress_bar import ProgressBar


def _size(text: str) -> int:
    """parse_size for argparse: a bad size is a usage error (one line, exit 2)."""
    try:
        return parse_size(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "profile", help="count neuron activations and collect predictor training data")
    parser.add_argument("--model", default="demo", help="model folder or catalogue id (default: demo)")
    parser.add_argument("--corpus", nargs="+", required=True, metavar="FILE",
                        help="calibration text files (UTF-8)")
    parser.add_argument("--max-tokens", type=int, default=200_000, help="tokens to profile")
    parser.add_argument("--max-pairs-bytes", type=_size, default=parse_size("2GiB"),
                        metavar="SIZE", help="disk cap for predictor training pairs (default 2GiB)")
    parser.add_argument("--window", type=int, default=512, help="tokens per forward pass")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--target-sparsity", type=float, default=None, metavar="FRACTION",
                        help="a SiLU (SwiGLU) model's opt-in sparse mode (CATS): calibrate per-layer thresholds on "
                             "|SiLU(gate)| so that this share of its FFN neurons is skipped (e.g. 0.5)")
    parser.add_argument("--restart", action="store_true", help="ignore a saved partial profile")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from app.open_model import open_engine
    from engine.calibration.profiling import ProfileSettings, profile

    if args.max_tokens < 2:
        raise UserError("--max-tokens must be at least 2")
    if args.window < 2:
        raise UserError("--window must be at least 2")
    engine = open_engine(args.model, mode="dense", ctx=args.window, device=args.device,
                         threads=args.threads)
    bar = ProgressBar("profile", quiet=False)
    settings = ProfileSettings(max_tokens=args.max_tokens, max_pairs_bytes=args.max_pairs_bytes,
                               window=args.window, target_sparsity=args.target_sparsity)
    result = profile(engine, args.corpus, settings, progress=bar, restart=args.restart)
    bar.done()
    summary = result.to_dict()
    if args.json:
        print(json.dumps(summary))
        return 0
    if result.resumed_from_tokens:
        print(f"resumed a saved profile at {result.resumed_from_tokens} tokens")
    print(f"profiled {result.tokens} tokens in {result.windows} windows; "
          f"{format_size(result.pair_bytes)} of predictor pairs in {result.folder}")
    for i, s in enumerate(result.sparsity):
        print(f"  layer {i:3d}: sparsity {s * 100:5.1f}%  pairs {result.pair_rows[i]}")
    print(f"mean sparsity {summary['mean_sparsity'] * 100:.1f}%")
    return 0
