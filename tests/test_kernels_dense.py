"""The dense decode kernels (matvec, combine) against plain torch, with and without numba."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu


@pytest.fixture(autouse=True)
def numba_for_every_size(monkeypatch):
    monkeypatch.setattr(cpu, "_DENSE_MIN_ELEMENTS", 0)  # small test shapes take the numba path too


# matvec and combine against fp64 on numba and torch: rows `matvec-fp32-*`, `matvec-combine-*` of
# tests/kernel_cases.py.


def test_non_contiguous_operands_fall_back_to_torch():
    w = torch.randn(64, 40)[:, :32]  # a strided view
    x = torch.randn(32)
    assert torch.allclose(cpu.matvec(x, w), w @ x, atol=1e-5)
    a, wt = torch.randn(64), torch.randn(32, 64).t()  # [64, 32], transposed: not contiguous
    assert torch.allclose(cpu.combine(a, wt), a @ wt, atol=1e-5)


def test_without_numba_the_engine_decodes_the_same(llama_dir):
    script = (
        "from engine import Engine, SamplingParams\n"
        f"e = Engine.load({str(llama_dir)!r}); e.eos_ids = set()\n"
        "print(e.generate([0, 5, 9, 17], SamplingParams(max_new_tokens=12, temperature=0)).token_ids)\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    outputs = []
    for disabled in ("0", "1"):
        env = {**os.environ, "PYTHONPATH": root, "THERMOCLINE_NO_NUMBA": disabled}
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.strip().splitlines()[-1])
    assert outputs[0] == outputs[1]
