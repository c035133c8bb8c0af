"""The FFN activations: their names, the spellings configs use, and the kernels' codes.

One home for these facts (no torch here: the registry and the CLI read them too). The torch
computation every path shares is `engine.kernels.reference.activations`.

  relu     gated: relu(g) * u            ungated: relu(u)
  fatrelu  as relu, but values below the threshold become 0 (ProSparse's FATReLU)
  drelu    gated: relu(g) * relu(u)      ungated: relu(u)
  relu2    gated: relu(g)^2 * u          ungated: relu(u)^2
"""

from __future__ import annotations

NAMES = ("relu", "fatrelu", "drelu", "relu2")

# Activation names as configs spell them (lower case) -> ours.
ALIASES = {
    "relu": "relu",
    "fatrelu": "fatrelu",
    "relu2": "relu2",
    "relu_squared": "relu2",
    "squared_relu": "relu2",
    "drelu": "drelu",
}

# The integer the numba and Triton kernels branch on.
CODES = {"relu": 0, "fatrelu": 1, "drelu": 2, "relu2": 3}
IDENTITY_CODE = 4  # Triton only: the predictor's fc2 has no activation


def check(activation: str) -> None:
    if activation not in NAMES:
        raise ValueError(f"unknown activation {activation!r}; expected one of {NAMES}")
