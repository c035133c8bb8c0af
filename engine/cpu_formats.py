"""The CPU tier's weight formats and what each means for the predictors (torch-free: the
placement's byte counts and the predictor sets both read it)."""

from __future__ import annotations


def predictor_cpu_format(cpu_weights: str) -> str:
    """The format of predictors (other than a file's own 4-bit ones) on a CPU tier: int8 rows
    on a 4-bit tier. At 4 bits a predictor's logits lose their margin around the threshold:
    on 7B shapes that fire at 10%, int4 predictors selected 21% of the neurons and int8 ones
    10.4% (issue #30), and the predictor is a small share of a token's bytes."""
    return "int8" if cpu_weights == "int4" else cpu_weights
