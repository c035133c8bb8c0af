"""The dense mode on int8 / 4-bit CPU weights (engine.loading.dense_quant) against references.

Two references: plain fp64 torch over the matrices as stored (dequantized), which isolates
the kernels' own error (the activations quantized to int8 blocks: at most half a step of
1/127 of a block's largest value per element), and the fp32 dense engine over the
checkpoint's weights, which adds the weights' rounding (int8 rows: half a step of 1/127 of a
row's largest weight; Q4_0: half a step of 1/8 of a 32-weight block's largest).
"""

from __future__ import annotations

import pytest
import torch

import model_factory
from engine import Engine, SamplingParams
from engine.errors import UserError
from engine.kernels.reference import activations
from engine.kernels.quantized import Int8Matrix, Q4Matrix
from engine.loading.dense_quant import QuantDenseFfn
from engine.model.layers import DenseFfn

FORMATS = {"int8": Int8Matrix, "int4": Q4Matrix}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _ffn(d: int, n: int, gated: bool, seed: int) -> DenseFfn:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * n if gated else n, d, generator=g) / d ** 0.5
    down_t = torch.randn(n, d, generator=g) / n ** 0.5
    return DenseFfn(gate_up.contiguous(), down_t, gated, "relu", 0.0)


def _fp64_ffn(x, gate_up, down_t, gated, n):
    pre = x.double() @ gate_up.double().T
    act = activations(pre[:, :n] if gated else None, pre[:, n:] if gated else pre, "relu", 0.0)
    return act @ down_t.double()


# d 256 / n 384 (multiples of the int8 activation block, 128): the int8 x int8 products;
# d 96 / n 160: the other paths (one row product per token, blocks converted for many tokens).
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("d, n", [(256, 384), (96, 160)])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_quantized_ffn_against_fp64_of_its_weights_and_of_the_checkpoint(fmt, d, n, gated, tokens):
    dense = _ffn(d, n, gated, seed=d + n + tokens + gated)
    ffn = QuantDenseFfn.from_dense(dense, fmt)
    assert isinstance(ffn.gate_up, FORMATS[fmt]) and isinstance(ffn.down, FORMATS[fmt])
    assert ffn.down.shape == (d, n) and ffn.n_ff == n
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(tokens))
    out = ffn(x, x, 0)
    assert out.shape == (tokens, d) and out.dtype == torch.float32
    # the matrices as stored: only the activations' int8 blocks differ (~0.3% per product)
    stored = _fp64_ffn(x, ffn.gate_up.dequantize(), ffn.down.dequantize().T, gated, n)
    assert _rel(out, stored) < 0.02
    # the checkpoint's fp32 weights: their rounding too
    exact = _fp64_ffn(x, dense.gate_up, dense.down_t, gated, n)
    assert _rel(out, exact) < (0.03 if fmt == "int8" else 0.2)
    # the rows read back for a split into tiers are the stored ones
    torch.testing.assert_close(ffn.down_t, ffn.down.dequantize().T.contiguous())
    assert torch.equal(ffn.up, ffn.gate_up.dequantize()[n:] if gated else ffn.gate_up.dequantize())


def test_quantized_ffn_bytes():
    dense = _ffn(256, 384, True, seed=1)
    int8 = QuantDenseFfn.from_dense(dense, "int8")
    assert int8.nbytes == 2 * 384 * 256 + 2 * 384 * 4 + 256 * 384 + 256 * 4  # int8 rows + an fp32 scale each
    int4 = QuantDenseFfn.from_dense(dense, "int4")
    assert int4.nbytes == (2 * 384 * 256 + 256 * 384) // 32 * 18  # Q4_0: 18 bytes per 32 weights
    assert dense.nbytes == 3 * 384 * 256 * 4


@pytest.fixture(scope="module")
def llama128(tmp_path_factory):
    """A tiny Llama whose widths are multiples of the int8 activation block (the int8 x int8 path)."""
    return model_factory.llama_relu(tmp_path_factory.mktemp("dense_quant") / "llama", hidden=128, ff=256,
                                    heads=4, kv_heads=2, vocab=300)


def _logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    return engine.score(ids).double()


PROMPT = [0] + [(7 * i + 3) % 290 + 5 for i in range(19)]  # 20 tokens: a chat turn's prefill


def test_dense_defaults_to_exact_fp32_weights(llama128):
    engine = Engine.load(llama128, mode="dense")
    layer = engine.model.layers[0]
    assert type(layer.ffn) is DenseFfn and isinstance(layer.qkv, torch.Tensor)
    assert isinstance(engine.model.lm_head, torch.Tensor)
    fp32 = Engine.load(llama128, mode="dense", cpu_weights="fp32")
    assert torch.equal(_logits(engine, PROMPT), _logits(fp32, PROMPT))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dense_engine_on_quantized_weights_against_the_fp32_engine(llama128, fmt):
    ref = Engine.load(llama128, mode="dense", cpu_weights="fp32")
    engine = Engine.load(llama128, mode="dense", cpu_weights=fmt)
    for layer in engine.model.layers:
        assert isinstance(layer.qkv, FORMATS[fmt]) and isinstance(layer.out, FORMATS[fmt])
        assert isinstance(layer.ffn, QuantDenseFfn)
    assert isinstance(engine.model.lm_head, FORMATS[fmt])  # untied head
    want = _logits(ref, PROMPT)
    got = _logits(engine, PROMPT)  # the 20-token prefill through the many-token products
    assert _rel(got, want) < (0.03 if fmt == "int8" else 0.2)
    if fmt == "int8":
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    # The prompt token by token (the decode products) gives the prefill's logits.
    engine.reset()
    steps = torch.cat([engine.model.forward(torch.tensor([t]), i, engine.cache).double()
                       for i, t in enumerate(PROMPT)])
    assert _rel(steps, got) < 0.02
    # Memory counts the format's bytes: a quarter of fp32 or less for every quantized matrix.
    mem, ref_mem = engine.memory()["ram_bytes"], ref.memory()["ram_bytes"]
    embed = engine.model.embed.numel() * 4
    cache = engine.cache.nbytes
    assert (mem - embed - cache) < 0.3 * (ref_mem - embed - cache)
    # and a greedy generation runs end to end
    engine.eos_ids = set()
    out = engine.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0))
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_tied_head_gets_its_own_int8_rows(tmp_path, fmt):
    """Every token reads the head whole: a tied one is read as int8 rows (a quarter of the fp32
    embeddings' bytes), for int4 too (a GGUF's Q8_0 embeddings would be rounded again as 4-bit
    rows); the lookups still read the fp32 embeddings."""
    path = model_factory.llama_relu(tmp_path / "tied", hidden=128, ff=256, tie=True)
    engine = Engine.load(path, mode="dense", cpu_weights=fmt)
    head, embed = engine.model.lm_head, engine.model.embed
    assert isinstance(head, Int8Matrix) and embed.dtype == torch.float32
    assert (head.dequantize() - embed).abs().max().item() <= embed.abs().max().item() / 254 * 1.001
    assert engine.model.head_nbytes == head.nbytes  # counted in the engine's memory
    ref = Engine.load(path, mode="dense")
    assert ref.model.lm_head is ref.model.embed  # fp32: the exact mode keeps the embeddings
    assert _rel(_logits(engine, PROMPT), _logits(ref, PROMPT)) < (0.03 if fmt == "int8" else 0.2)  # as the untied formats above


def test_unknown_format_is_a_user_error(llama128):
    with pytest.raises(UserError, match="int4, int8 or fp32"):
        Engine.load(llama128, mode="dense", cpu_weights="int3")


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_fit_estimate_counts_the_dense_mode_format(llama128, fmt):
    """A dense run on the CPU holds what `models fit --cpu-weights FMT` puts on the CPU with no
    VRAM, less the predictors (dense mode loads none)."""
    import json

    from models_registry.fit import BytesModel, estimate_fit

    config = json.loads((llama128 / "config.json").read_text())
    engine = Engine.load(llama128, mode="dense", ctx=256, cpu_weights=fmt)
    estimate = estimate_fit(config, ctx=256, vram_budget=0, ram_budget=1 << 30, model_dir=llama128,
                            bytes_model=BytesModel(cpu_weights=fmt))
    assert estimate.vram_bytes == 0
    assert estimate.ram_bytes - estimate.predictor_cpu_bytes == pytest.approx(engine.memory()["ram_bytes"], rel=0.02)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_broken_weights_are_refused_not_rounded_away(tmp_path, fmt, value):
    from safetensors.torch import load_file, save_file

    path = model_factory.llama_relu(tmp_path / "broken", hidden=128, ff=256)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][0, :5] = value
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(UserError, match="layer 1's FFN holds NaN or infinite weights: the checkpoint is broken"):
        Engine.load(path, mode="dense", cpu_weights=fmt)
