"""The FFN activations: their names, the spellings configs use, and the kernels' codes.

One home for these facts (no torch here: the registry and the CLI read them too). The torch
computation every path shares is `engine.kernels.reference.activations`.

  relu     gated: relu(g) * u            ungated: relu(u)
  fatrelu  as relu, but values below the threshold become 0 (ProSparse's FATReLU)
  drelu    gated: relu(g) * relu(u)      ungated: relu(u)
  relu2    gated: relu(g)^2 * u          ungated: relu(u)^2
  silu     gated: silu(g) * u            ungated: silu(u)   (SwiGLU: Llama 2/3, Mistral, Qwen2)
           with a threshold t > 0, values with |silu(g)| < t become 0 (CATS: the opt-in sparse
           mode of a SiLU model; at t = 0 it is the dense model)

The first four are the ReLU family (`SPARSE`): their zeros are the model's own. A SiLU model
has no zeros unless a threshold is calibrated (`engine.calibration.profiling`), so it runs dense.
"""

from __future__ import annotations

NAMES = ("relu", "fatrelu", "drelu", "relu2", "silu")
SPARSE = ("relu", "fatrelu", "drelu", "relu2")  # zeros without a calibrated threshold

# Activation names as configs spell them (lower case) -> ours.
ALIASES = {
    "relu": "relu",
    "fatrelu": "fatrelu",
    "relu2": "relu2",
    "relu_squared": "relu2",
    "squared_relu": "relu2",
    "drelu": "drelu",
    "silu": "silu",
    "swish": "silu",
}

# The integer the numba and Triton kernels branch on.
CODES = {"relu": 0, "fatrelu": 1, "drelu": 2, "relu2": 3, "silu": 5}
IDENTITY_CODE = 4  # Triton only: the predictor's fc2 has no activation


def check(activation: str) -> None:
    if activation not in NAMES:
        raise ValueError(f"unknown activation {activation!r}; expected one of {NAMES}")


def is_sparse(activation: str, threshold: float = 0.0, cats: tuple[float, ...] = ()) -> bool:
    """Whether the FFN's activations have zeros to skip: the ReLU family always, SiLU only
    with a calibrated CATS threshold (one for the model, or per layer)."""
    return activation in SPARSE or (activation == "silu" and (threshold > 0 or any(t > 0 for t in cats)))


def dense_only_words(config) -> str:
    """Why a model of this activation runs dense, and what a sparse one would gain (the CLI's
    note and the window's words; `config` is an engine.config.ModelConfig)."""
    return (f"its {config.activation} (SwiGLU) activations are never zero, so every FFN neuron is computed "
            "(dense); a ReLU-family model of its size computes only the 10-30% of FFN rows that fire "
            "(ProSparse-7B is 89% sparse), which on the CPU is up to about 2x llama.cpp's speed. "
            "Opt in to CATS sparsity (about half the FFN skipped, at a measured perplexity cost) with "
            "`thermocline profile --target-sparsity 0.5` then `thermocline train-predictors`")
