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


def disk_words_per_s(plan) -> float:
    from engine.hotcold.placement import words_per_second

    return round(words_per_second(plan), 1)


def disk_speed_line(plan) -> str:
    """What `place` and `models fit` say of a placement that reads neurons from disk."""
    from engine.units import format_rate, format_size

    return (f"reads {format_size(int(plan.disk_read_per_token))} from disk per token · runs from disk at about "
            f"{format_rate(disk_words_per_s(plan))} words a second")


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
                        help="format of the weights on the CPU in every mode: attention, FFN rows, untied "
                             "output head, predictors (int8: 4x fewer bytes than fp32, as fast as llama.cpp's "
                             "Q8_0; int4: llama.cpp's Q4_0 blocks, 7x fewer; fp32: the checkpoint's exact "
                             "weights, the dense reference)")
    if sampling:
        parser.add_argument("--max-new-tokens", type=int, default=256)
        parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
        parser.add_argument("--top-k", type=int, default=None)
        parser.add_argument("--top-p", type=float, default=None)
        parser.add_argument("--min-p", type=float, default=None)
        parser.add_argument("--repetition-penalty", type=float, default=None)
        parser.add_argument("--seed", type=int, default=None)
        parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def check_options(args: argparse.Namespace) -> None:
    """Every option checked before the model loads (seconds): a bad value is one `error:` line.
    The checks are the engine's own (engine.validation), which the window and server use too."""
    from engine.validation import check_ctx, check_text, check_threads, resolve_device

    check_ctx(getattr(args, "ctx", None), "--ctx")
    check_threads(getattr(args, "threads", None), "--threads")
    resolve_device(getattr(args, "device", None))
    if getattr(args, "mode", None) == "dense" and (args.vram_budget is not None or args.ram_budget is not None):
        raise UserError("budgets apply to the sparse and hybrid modes, where neurons are placed; dense mode "
                        "keeps every weight on one device: drop --vram-budget/--ram-budget or use --mode "
                        "sparse or hybrid")
    if getattr(args, "prompt", None) is not None:
        check_text(args.prompt, "--prompt")
    if hasattr(args, "max_new_tokens"):
        from types import SimpleNamespace

        from engine.validation import check_sampling

        defaults = dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
        check_sampling(SimpleNamespace(**_sampling_fields(args, defaults)))  # no torch import yet


def load_engine(args: argparse.Namespace, kernels: str = "wait"):
    """The engine for the command's options. `kernels` "background" (the terminal chat,
    `generate`): on a first start the answer comes on slower paths while the fast CPU kernels
    compile (app.kernel_words)."""
    import sys

    check_options(args)  # before importing the engine (torch): a bad option fails in a blink
    from app.open_model import open_engine

    options = dict(mode=args.mode, ctx=args.ctx, vram_budget=args.vram_budget, ram_budget=args.ram_budget,
                   device=args.device, threads=args.threads, cpu_weights=args.cpu_weights)
    if kernels != "wait":
        options["kernels"] = kernels
    engine = open_engine(args.model, **options)
    for note in getattr(engine, "warnings", ()):
        sys.stderr.write(f"warning: {note}\n")
    return engine


def sampling_params(args: argparse.Namespace, engine):
    """Command-line values over the model's generation_config.json over our defaults."""
    params = _given_sampling(args, engine.generation_defaults)
    params.validate()  # the model's generation_config.json is outside text too
    return params


def _sampling_fields(args: argparse.Namespace, defaults: dict) -> dict:
    values = dict(defaults)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return dict(values, max_new_tokens=args.max_new_tokens, seed=args.seed, stop=list(args.stop))


def _given_sampling(args: argparse.Namespace, defaults: dict):
    from engine import SamplingParams

    return SamplingParams(**_sampling_fields(args, defaults))
