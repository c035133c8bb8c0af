"""Thermocline's inference engine (no Qt here; see docs/ARCHITECTURE.md).

Names are imported lazily, so light modules (`engine.units`, `engine.errors`) can be used
without loading torch: the model registry and the window's start-up rely on that.
"""

import os
import sys
from importlib import import_module

# torch's OpenMP workers spin after each op and take the cores from the numba kernels that
# run next (measured: cold-row kernel median 27 ms spinning, 1.6 ms passive). Only takes
# effect when torch is not loaded yet; a value the user set wins.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {
    "MODES": "engine.runtime.engine", "Engine": "engine.runtime.engine", "GenerationResult": "engine.runtime.engine",
    "GenerationStats": "engine.runtime.engine", "TokenEvent": "engine.runtime.engine",
    "SamplingParams": "engine.runtime.sampling",
    "UserError": "engine.errors", "ModelFormatError": "engine.errors", "BudgetError": "engine.errors",
    "ContextFullError": "engine.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
