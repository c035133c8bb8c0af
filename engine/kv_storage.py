"""How the KV cache is stored on the CPU: fp16 by default, fp32 as the exact reference.

A CPU layer computes in fp32 but keeps its keys and values in fp16 (llama.cpp's default):
half the bytes per token of context, and half the bytes each decoded token reads in a long
chat (the fused decode attention kernel reads fp16 in place). `THERMOCLINE_KV_CACHE=fp32`
keeps them in fp32, the exact reference the transformers comparisons pin. CUDA layers keep
their cache in their 16-bit compute dtype either way.

One setting for the engine's `KVCache`, its placement and memory checks, and the registry's
fit estimate. Torch-free: the registry imports it.
"""

from __future__ import annotations

import os

from engine.errors import UserError

KV_CACHE_ENV = "THERMOCLINE_KV_CACHE"
CPU_KV_FORMATS = {"fp16": 2, "fp32": 4}  # format -> bytes per stored element
DEFAULT_CPU_KV = "fp16"


def cpu_kv_format(value: str | None = None) -> str:
    """The CPU cache's format: `value`, else the environment's, else fp16."""
    if value is None:
        value = os.environ.get(KV_CACHE_ENV, "")
    value = value.strip().lower() or DEFAULT_CPU_KV
    if value not in CPU_KV_FORMATS:
        raise UserError(f"{KV_CACHE_ENV}={value!r} is not a KV cache format: choose fp16 (the default) "
                        "or fp32 (the exact reference, twice the memory per token of context)")
    return value


def cpu_kv_bytes(value: str | None = None) -> int:
    """Bytes of one stored key or value element on the CPU."""
    return CPU_KV_FORMATS[cpu_kv_format(value)]
