"""The default budgets: how much of the GPU's free memory and of the available RAM a model
may take when the user sets no budget. One policy for the engine (CLI loads without
`--vram-budget/--ram-budget`) and the window's fit estimate (`models_registry.fit`).

Torch-free: the registry imports it.
"""

from __future__ import annotations

GiB = 1024**3

# What a default budget leaves free: CUDA context, activations and allocator slack on the
# GPU; the OS, the app and page cache in RAM.
VRAM_RESERVE = 768 * 1024**2
RAM_RESERVE_FRACTION = 0.15
RAM_RESERVE_MIN = 2 * GiB


def usable_vram(vram_free: int) -> int:
    """VRAM a model may take out of what the GPU has free now (0 without a GPU)."""
    return max(0, vram_free - VRAM_RESERVE) if vram_free > 0 else 0


def usable_ram(ram_available: int) -> int:
    """RAM a model may take out of what the OS reports available now."""
    return max(0, ram_available - max(RAM_RESERVE_MIN, int(ram_available * RAM_RESERVE_FRACTION)))
