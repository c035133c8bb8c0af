"""Options shared by the commands that load a model."""

from __future__ import annotations

import argparse

from engine.errors import UserError
from engine.units import parse_size


def size_arg(text: str) -> int:
    """argparse type for sizes: bad values become a usage error (exit code 2)."""
    try:
        return parse_size(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_options(parser: argparse.ArgumentParser, *, sampling: bool = True) -> None:
    parser.add_argument("--model", default="demo", help="model folder or catalogue id (default: demo)")
    parser.add_argument("--mode", default="dense", choices=("dense", "sparse", "hybrid", "oracle"))
    parser.add_argument("--vram-budget", type=size_arg, default=None, metavar="SIZE",
                        help="bytes of fast-device memory for weights and cache (0, 512MiB, 4GiB)")
    parser.add_argument("--ram-budget", type=size_arg, default=None, metavar="SIZE",
                        help="bytes of RAM for what stays on the CPU")
    parser.add_argument("--ctx", type=int, default=None,
                        help="context length in tokens (default: 2048, or less if the model was trained on less)")
    parser.add_argument("--device", default=None, help="fast device (cuda, cuda:1, cpu); default: best found")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--cpu-weights", default="int8", choices=("int4", "int8", "fp32"),
                        help="format of the weights on the CPU tier in sparse and hybrid modes: cold FFN "
                             "rows, attention, untied output head, predictors (int8: 4x fewer bytes; "
                             "int4: llama.cpp's Q4_0 blocks, 7x fewer; fp32: exact)")
    if sampling:
        parser.add_argument("--max-new-tokens", type=int, default=256)
        parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
        parser.add_argument("--top-k", type=int, default=None)
        parser.add_argument("--top-p", type=float, default=None)
        parser.add_argument("--min-p", type=float, default=None)
        parser.add_argument("--repetition-penalty", type=float, default=None)
        parser.add_argument("--seed", type=int, default=None)
        parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def load_engine(args: argparse.Namespace):
    from engine import Engine

    return Engine.load(args.model, mode=args.mode, ctx=args.ctx, vram_budget=args.vram_budget,
                       ram_budget=args.ram_budget, device=args.device, threads=args.threads,
                       cold_quant=args.cpu_weights)


def sampling_params(args: argparse.Namespace, engine):
    """Command-line values over the model's generation_config.json over our defaults."""
    from engine import SamplingParams

    values = dict(engine.generation_defaults)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed, stop=list(args.stop), **values)
