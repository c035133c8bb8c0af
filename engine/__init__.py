"""Thermocline's inference engine (no Qt here; see docs/ARCHITECTURE.md)."""

from .engine import MODES, Engine, GenerationResult, GenerationStats, TokenEvent
from .errors import BudgetError, ContextFullError, ModelFormatError, UserError
from .sampling import SamplingParams

__all__ = [
    "MODES", "Engine", "GenerationResult", "GenerationStats", "TokenEvent", "SamplingParams",
    "UserError", "ModelFormatError", "BudgetError", "ContextFullError",
]
