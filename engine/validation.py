"""Checks of values that come from a user or a client, at the one place they enter.

The command line, the window and the server all pass generation parameters, context
lengths, thread counts, devices and prompts through these functions, so NaN, negative,
zero, out-of-range values and a device this build cannot use give one clear `UserError`
instead of a traceback or a silently wrong answer. Torch is imported only to check a device.
"""

from __future__ import annotations

import math
import os

from engine.errors import UserError

MIN_CTX = 8
MAX_NEW_TOKENS = 1 << 20
SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes [0, 2**64)


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value):
        raise UserError(f"{name} must be a finite number, not {value}")
    return value


def _integer(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UserError(f"{name} must be a whole number, not {value!r}")
    return value


def check_sampling(p) -> None:
    """Every field of a `SamplingParams`; raises UserError naming the first bad one."""
    n = _integer(p.max_new_tokens, "max new tokens")
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise UserError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, not {n}")
    if _number(p.temperature, "temperature") < 0:
        raise UserError("temperature must be >= 0 (0 means greedy)")
    if _integer(p.top_k, "top-k") < 0:
        raise UserError(f"top-k must be >= 0 (0 means off), not {p.top_k}")
    if not 0 < _number(p.top_p, "top-p") <= 1:
        raise UserError(f"top-p must be in (0, 1], not {p.top_p}")
    if not 0 <= _number(p.min_p, "min-p") < 1:
        raise UserError(f"min-p must be in [0, 1), not {p.min_p}")
    if _number(p.repetition_penalty, "repetition penalty") <= 0:
        raise UserError(f"repetition penalty must be > 0, not {p.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):  # (the command line has no such options)
        if not -2 <= _number(getattr(p, name, 0.0), name.replace("_", " ")) <= 2:
            raise UserError(f"{name.replace('_', ' ')} must be between -2 and 2, not {getattr(p, name)}")
    logit_bias = getattr(p, "logit_bias", {})
    if not isinstance(logit_bias, dict):
        raise UserError("logit bias must map token ids to numbers")
    for token, bias in logit_bias.items():
        if _integer(token, "a logit bias's token id") < 0:
            raise UserError(f"logit bias: token id {token} is negative")
        if not -100 <= _number(bias, "a logit bias") <= 100:
            raise UserError(f"logit bias of token {token} must be between -100 and 100, not {bias}")
    grammar = getattr(p, "grammar", None)
    if grammar is not None and getattr(grammar, "kind", None) not in ("json_schema", "lark"):
        raise UserError(f"grammar must be a JSON schema or a Lark grammar, not {grammar!r}"[:200])
    if p.seed is not None and not 0 <= _integer(p.seed, "seed") < SEED_LIMIT:
        raise UserError(f"seed must be between 0 and 2**64 - 1, not {p.seed}")
    if not isinstance(p.stop, (list, tuple)) or not all(isinstance(s, str) for s in p.stop):
        raise UserError("stop must be a list of strings")
    for s in p.stop:
        check_text(s, "a stop string")


def check_ctx(ctx, name: str = "the context length") -> int | None:
    """A context length the user asked for (None: the model's default, decided later)."""
    if ctx is None:
        return None
    ctx = _integer(ctx, name)
    if ctx < MIN_CTX:
        raise UserError(f"{name} must be at least {MIN_CTX} tokens, not {ctx}")
    return ctx


def check_threads(threads, name: str = "the thread count") -> int | None:
    if threads is None:
        return None
    threads = _integer(threads, name)
    most = 4 * (os.cpu_count() or 1)
    if not 1 <= threads <= most:
        raise UserError(f"{name} must be between 1 and {most} on this machine, not {threads}")
    return threads


def resolve_device(name: str | None):
    """`cpu`, `cuda` or `cuda:N` as a torch.device this build and machine can use."""
    if name is None:
        return None
    import torch

    try:
        dev = torch.device(str(name).strip().lower())
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise UserError(f"device {name!r} is not supported: use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no usable CUDA GPU"
        raise UserError(f"device {name!r} was asked for, but this Thermocline runs on {build}; "
                        "use --device cpu (or install the GPU version)")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise UserError(f"device {name!r} does not exist: this machine has {count} CUDA GPU(s)")
    return dev


def check_text(text, what: str) -> str:
    """Text that can be encoded: a str without lone surrogates (what invalid UTF-8 on the
    command line, or a `\\udcxx` escape in JSON, turns into)."""
    if not isinstance(text, str):
        raise UserError(f"{what} must be text, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{what} is not valid UTF-8 (at character {exc.start}); "
                        "check the terminal's or the file's encoding") from None
    return text


def kv_bytes_per_token(config, device_type: str = "cpu") -> int:
    """Bytes one position of context costs: K and V of every layer (in the CPU cache's format,
    fp16 unless THERMOCLINE_KV_CACHE=fp32; 16-bit on CUDA), plus its RoPE row."""
    from engine.kv_storage import cpu_kv_bytes

    elt = cpu_kv_bytes() if device_type == "cpu" else 2
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * elt + 2 * config.head_dim * 4 + 8


def check_kv_fits(config, ctx: int, device: str | None) -> None:
    """Refuse a context whose cache alone cannot fit in this machine's memory (RAM plus free
    VRAM), before anything is allocated: `--ctx 1000000000` is an error, not a 32 GB malloc."""
    import psutil

    need = ctx * kv_bytes_per_token(config, "cuda" if device and device.startswith("cuda") else "cpu")
    have = psutil.virtual_memory().available
    if device and device.startswith("cuda"):
        import torch

        have += torch.cuda.mem_get_info(torch.device(device))[0]
    if need > have:
        from engine.units import format_size

        per_token = need // ctx
        raise UserError(f"context {ctx:,} needs {format_size(need)} for its cache alone and this machine has "
                        f"{format_size(have)} available; lower --ctx (at most about {have // per_token:,} tokens)")
