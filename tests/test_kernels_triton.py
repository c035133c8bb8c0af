"""Triton sparse FFN kernels: what the kernel case table does not check. Their numerics (the
sparse FFN by logits, by the layer's logits through row ids and with no predictor, over fp16,
bf16, fp32 and 4-bit rows, under the default launch configuration and small packed, small
masked and tiny tiles; the down projection over row splits, bit for bit on a second run; the
predictor) are rows of tests/kernel_cases.py against its fp64 reference. Here: rows that must
not be read, strided and batched inputs, exact zeros, refusals, compiled code, CUDA graphs.

Without CUDA the kernels run under the Triton interpreter on CPU tensors; with CUDA (and
TRITON_INTERPRET unset) the same tests run on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton_ffn import (
    LaunchConfig,
    available,
    down_proj_triton,
    ffn_activations_triton,
    predictor_triton,
    sparse_ffn_triton,
)
from kernel_cases import TRITON_LAUNCH, ffn_reference, relative_error

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not available(), reason="needs CUDA or TRITON_INTERPRET=1")

SMALL = LaunchConfig(**TRITON_LAUNCH["small-packed"])
CONFIGS = {"packed": SMALL, "masked": LaunchConfig(**TRITON_LAUNCH["small-masked"])}


def ref_ffn(x, gate, up, down_t, computed, activation, act_threshold=0.0):
    """The kernel table's fp64 FFN (y, its scale, the activations) over the neurons where `computed`."""
    return ffn_reference(*[None if w is None else w.cpu() for w in (x, gate, up, down_t, computed)], activation,
                         act_threshold)


def close(y, ref, scale=None, bound=1e-4):
    """The kernel table's measure and bound: `ref` a Reference (its y and scale), or y fp64 with its scale."""
    ref, scale = (ref.y, ref.scale) if scale is None else (ref, scale)
    err = relative_error(y, ref, scale)
    assert err <= bound, f"error {err:.3g} > {bound:g}"


def make_layer(d, n, dtype, gated=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rows():
        return (torch.randn(n, d, generator=g) / d**0.5).to(dtype).to(DEVICE)

    gate = rows() if gated else None
    up, down_t = rows(), rows()
    x = torch.randn(d, generator=g).to(DEVICE)
    logits = torch.randn(n, generator=g).to(DEVICE)
    return x, gate, up, down_t, logits


@pytest.mark.parametrize("config", ["packed", "masked"])
def test_skipped_rows_are_never_read(config):
    """Gate/up rows of unpredicted neurons, and up rows of neurons whose gate does not
    fire, are not read: NaN stored there must not reach the output."""
    d, n = 96, 200
    x, gate, up, down_t, logits = make_layer(d, n, torch.float16, seed=29)
    predicted = logits >= 0.0
    fires = (gate.double() @ x.double()) > 0
    ref = ref_ffn(x, gate, up, down_t, predicted, "relu")
    gate, up = gate.clone(), up.clone()
    gate[~predicted] = float("nan")
    up[~(predicted & fires)] = float("nan")
    y = sparse_ffn_triton(x, gate, up, down_t, logits, 0.0, "relu", config=CONFIGS[config])
    close(y, ref)


def test_strided_rows_from_a_bundle():
    """gate/up/down rows of a neuron stored together ([n, 3, d]) work without a copy."""
    d, n = 64, 128
    x, gate, up, down_t, logits = make_layer(d, n, torch.float16, seed=7)
    bundle = torch.stack([gate, up, down_t], dim=1)  # [n, 3, d]
    y = sparse_ffn_triton(x, bundle[:, 0], bundle[:, 1], bundle[:, 2], logits, 0.0, "relu",
                          config=SMALL)
    close(y, ref_ffn(x, gate, up, down_t, logits >= 0.0, "relu"))


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_input_dtypes_and_batch_of_one(x_dtype):
    x, gate, up, down_t, logits = make_layer(130, 200, torch.bfloat16, seed=11)
    x = x.to(x_dtype)
    y = sparse_ffn_triton(x.reshape(1, -1), gate, up, down_t, logits, 0.2, "fatrelu", 0.1,
                          config=SMALL)
    close(y, ref_ffn(x, gate, up, down_t, logits >= 0.2, "fatrelu", 0.1))


@pytest.mark.parametrize("config", ["packed", "masked"])
def test_activations_are_exact_per_neuron(config):
    """act [n]: the activation where predicted, exactly 0 elsewhere."""
    x, gate, up, _, logits = make_layer(130, 256, torch.float16, seed=3)
    act = ffn_activations_triton(x, gate, up, logits, 0.5, "relu2", config=CONFIGS[config])
    ref = ref_ffn(x, gate, up, up, logits >= 0.5, "relu2")
    assert torch.equal(act.cpu() == 0, ref.acts == 0)
    close(act, ref.acts, ref.acts_scale)


@pytest.mark.parametrize("config", ["packed", "masked"])
def test_nothing_predicted_and_empty_partition(config):
    x, gate, up, down_t, logits = make_layer(96, 128, torch.float16)
    y = sparse_ffn_triton(x, gate, up, down_t, logits, float("inf"), "relu",
                          config=CONFIGS[config])
    assert torch.equal(y, torch.zeros_like(y))
    empty = up[:0]  # no hot rows at all (VRAM budget 0)
    y = sparse_ffn_triton(x, empty, empty, empty, logits[:0], 0.0, "relu")
    assert y.shape == (96,) and not y.any()


def test_down_projection_ignores_rows_of_inactive_neurons():
    """Rows with act == 0 are skipped, not multiplied: inf/nan there must not leak."""
    d, n = 64, 128
    down_t = torch.randn(n, d).half()
    act = torch.randn(n)
    dead = torch.arange(n) % 3 != 0
    act[dead] = 0.0
    down_t[dead] = float("nan")
    for cfg in (CONFIGS["packed"], CONFIGS["masked"]):
        y = down_proj_triton(act.to(DEVICE), down_t.to(DEVICE), config=cfg)
        live_a, live_rows = act[~dead].double(), down_t[~dead].double()
        close(y, live_a @ live_rows, float((live_a.abs() @ live_rows.abs()).max()))


def test_predictor_feeds_the_ffn_threshold():
    """End to end: logits from the predictor decide which neurons the FFN computes."""
    d, n, rank = 96, 200, 32
    x, gate, up, down_t, _ = make_layer(d, n, torch.float16, seed=19)
    g = torch.Generator().manual_seed(2)
    fc1 = (torch.randn(rank, d, generator=g) / d**0.5).half().to(DEVICE)
    fc2 = (torch.randn(n, rank, generator=g) / rank**0.5).half().to(DEVICE)
    logits = predictor_triton(x, fc1, fc2)
    y = sparse_ffn_triton(x, gate, up, down_t, logits, 0.1, "relu")
    close(y, ref_ffn(x, gate, up, down_t, logits >= 0.1, "relu"))


# ---------------------------------------------------------------- errors
def test_bad_arguments_are_rejected():
    x, gate, up, down_t, logits = make_layer(64, 128, torch.float16)
    with pytest.raises(ValueError, match="activation"):
        sparse_ffn_triton(x, gate, up, down_t, logits, 0.0, "gelu")
    with pytest.raises(ValueError, match="gate"):
        sparse_ffn_triton(x, gate[:, :32], up, down_t, logits, 0.0, "relu")
    with pytest.raises(ValueError, match="down_t"):
        sparse_ffn_triton(x, gate, up, down_t[:64], logits, 0.0, "relu")
    with pytest.raises(ValueError, match="x must have"):
        sparse_ffn_triton(x[:32], gate, up, down_t, logits, 0.0, "relu")
    with pytest.raises(ValueError, match="pred_logits"):
        sparse_ffn_triton(x, gate, up, down_t, logits[:10], 0.0, "relu")
    with pytest.raises(ValueError, match="row_ids"):
        sparse_ffn_triton(x, gate, up, down_t, None, 0.0, "relu",
                          row_ids=torch.arange(128, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="pred_logits"):
        sparse_ffn_triton(x, gate, up, down_t, (logits > 0).int(), 0.0, "relu")
    with pytest.raises(ValueError, match="contiguous"):
        sparse_ffn_triton(x, gate, up.t().contiguous().t(), down_t, logits, 0.0, "relu")


# ---------------------------------------------------------------- compiled code
def test_kernels_compile_for_sm90():
    """The interpreter never compiles: lower a variant of each kernel to an sm_90 cubin
    (triton ships ptxas, no GPU needed), with no register spills and 128-bit weight loads."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        assert os.path.exists(get_ptxas(90).path)
    except Exception as e:  # noqa: BLE001 - no NVIDIA backend in this triton build
        pytest.skip(f"no ptxas: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-m", "bench.triton_aot", "--quick", "--json"],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    variants = json.loads(run.stdout)["variants"]
    assert len(variants) == 4
    assert all(v["spill_bytes"] == 0 and v["vector_loads"] > 0 for v in variants)


# ---------------------------------------------------------------- CUDA only
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay():
    """Static grids, no host sync: the whole sparse FFN replays from a CUDA graph."""
    d, n = 130, 256
    x, gate, up, down_t, logits = make_layer(d, n, torch.float16, seed=23)
    sparse_ffn_triton(x, gate, up, down_t, logits, 0.3, "relu")  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = sparse_ffn_triton(x, gate, up, down_t, logits, 0.3, "relu")
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(d, generator=g))
        logits.copy_(torch.randn(n, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        close(y, ref_ffn(x, gate, up, down_t, logits >= 0.3, "relu"))
