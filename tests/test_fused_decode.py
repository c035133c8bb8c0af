"""The fused decode (one compiled call per CPU layer, engine.runtime.fused_decode) against the
unfused path it replaces (THERMOCLINE_FUSED_DECODE=0, the reference), on tiny models with the
real configs' keys: same logits to float rounding, same greedy tokens, same counters, and
the unfused path wherever the fused call does not apply."""

from __future__ import annotations

import shutil

import pytest
import torch

import real_config_models as rc
from engine import Engine, SamplingParams
from engine.errors import UserError
from engine.kernels import cpu as cpu_kernels
from engine.kernels import cpu_numba, cpu_q4
from engine.runtime import fused_decode

from test_sparse import PROMPT, RAM, random_predictors, vram_for

pytestmark = pytest.mark.skipif(not cpu_numba.HAS_AVX2, reason="the fused decode runs on AVX2 hosts")

# hidden 256: int8 products with int8 activations (d % 128) and 4-bit tiles (8 blocks a row);
# hidden 64 (rc.TINY): int8 x fp32 and the plain 4-bit product
WIDE = {"hidden_size": 256, "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4}
FAMILIES = {"relullama": rc.relullama, "prosparse": rc.prosparse, "bamboo": rc.bamboo, "minicpm": rc.minicpm}
STEPS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> a folder with random predictors (a predictor firing for about half the neurons)."""
    root = tmp_path_factory.mktemp("fused")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, build in FAMILIES.items():
            mp.setattr(rc, "TINY", WIDE if name != "relullama" else rc.TINY)
            path, _, _ = build(root / name)
            config = Engine.load(path).config
            random_predictors(config, rank=128 if name != "relullama" else 16).save(path)
            out[name] = path
    return out


@pytest.fixture(autouse=True)
def dense_kernels_at_every_size(monkeypatch):
    """The unfused path leaves fp32 matrices under 1 MB to torch's product, the fused call runs
    cpu_numba's at every size (as both do at real sizes): the same kernel on both sides, or the
    fp16 KV cache would turn their different rounding into whole fp16 steps."""
    monkeypatch.setattr(cpu_kernels, "_DENSE_MIN_ELEMENTS", 0)


def _steps(engine, fused: bool, monkeypatch) -> torch.Tensor:
    """Logits of PROMPT decoded one token at a time from an empty cache."""
    monkeypatch.setenv(fused_decode.FUSED_ENV, "1" if fused else "0")
    engine.reset()
    return torch.cat([engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT)])


def _generate(engine, fused: bool, monkeypatch):
    monkeypatch.setenv(fused_decode.FUSED_ENV, "1" if fused else "0")
    engine.reset()
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=STEPS, temperature=0))
    counters = engine.sparse.counters if engine.sparse is not None else None
    fractions = counters.fractions() if counters is not None else None
    counts = (counters.considered, int(counters.computed), int(counters.computed_hot)) if counters else None
    return result.token_ids, fractions, counts


def _calls(engine) -> list[int]:
    return [layer.fused.calls if layer.fused is not None else 0 for layer in engine.model.layers]


def _check_same(engine, monkeypatch, bound: float = 1e-5):
    engine.eos_ids = set()
    engine.wait_kernels()
    fused_decode.wait_compiled_behind()  # a mixture's calls compile behind the first decode
    for plan in [layer.fused for layer in engine.model.layers] + [engine.model.fused_head]:
        if plan is not None:
            plan.calls = 0
    unfused = _steps(engine, False, monkeypatch)
    assert sum(_calls(engine)) == 0  # the switch off: not one fused call
    fused = _steps(engine, True, monkeypatch)
    assert all(c == len(PROMPT) for c in _calls(engine))  # (a re-placement rebuilt plans start at 0)
    assert engine.model.fused_head.calls == len(PROMPT)
    scale = unfused.abs().max().item()
    assert scale > 0.05  # the comparison means something
    assert (fused - unfused).abs().max().item() <= bound * max(1.0, scale)
    ids0, fr0, n0 = _generate(engine, False, monkeypatch)
    ids1, fr1, n1 = _generate(engine, True, monkeypatch)
    assert len(ids1) == STEPS and ids1 == ids0
    if n1 is not None:  # the same neurons computed, but for a logit at the threshold that rounding flips
        assert n1[0] == n0[0] and abs(n1[1] - n0[1]) <= 1e-3 * n0[0] and abs(n1[2] - n0[2]) <= 1e-3 * n0[0]
        assert 0.0 < fr1[0] < 1.0


@pytest.mark.parametrize("threshold, active", [(-1e9, 1.0), (1e9, 0.0)])
def test_the_counters_count_what_the_fused_call_computes(models, tmp_path, threshold, active, monkeypatch,
                                                         one_torch_thread):
    path = tmp_path / "m"
    shutil.copytree(models["prosparse"], path)
    config = Engine.load(path).config
    random_predictors(config, threshold=threshold).save(path)
    engine = Engine.load(path, mode="sparse", ram_budget=RAM, cpu_weights="int8")
    engine.eos_ids = set()
    ids, fractions, (considered, computed, _) = _generate(engine, True, monkeypatch)
    assert considered == (STEPS - 1) * config.num_layers * config.intermediate_size  # the first from the prompt
    assert fractions[0] == active and computed == active * considered
    assert _calls(engine) == [STEPS - 1] * config.num_layers  # the load's warm-up is not counted


def _exact_cache_for_fp32(weights: str, monkeypatch) -> None:
    """fp32 rows: the two paths' products sum in different orders (the fused call's and the
    dense kernel's vector widths), which differ in the last fp32 bit; an fp16 KV cache turns a
    last-bit difference at a rounding boundary into a whole fp16 step (2^-11) and the logits
    then differ by more than fp32 rounding (1.4e-5 seen on an AVX-512 host). The quantized rows
    share one kernel on both paths, so they keep the fp16 cache."""
    if weights == "fp32":
        monkeypatch.setenv("THERMOCLINE_KV_CACHE", "fp32")


@pytest.mark.parametrize("weights", ["int8", "int4", "fp32"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparse_decode_fused_equals_unfused(models, family, weights, monkeypatch, one_torch_thread):
    _exact_cache_for_fp32(weights, monkeypatch)
    engine = Engine.load(models[family], mode="sparse", ram_budget=RAM, cpu_weights=weights)
    _check_same(engine, monkeypatch)
    assert all(layer.fused.why == "" for layer in engine.model.layers)


@pytest.mark.parametrize("weights", ["int8", "int4", "fp32"])
@pytest.mark.parametrize("family", ["relullama", "minicpm", "bamboo"])
def test_dense_decode_fused_equals_unfused(models, family, weights, monkeypatch, one_torch_thread):
    _exact_cache_for_fp32(weights, monkeypatch)
    engine = Engine.load(models[family], mode="dense", cpu_weights=weights)
    _check_same(engine, monkeypatch)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_fp32_kv_cache_fused_equals_unfused(models, mode, weights, monkeypatch, one_torch_thread):
    monkeypatch.setenv("THERMOCLINE_KV_CACHE", "fp32")
    kw = {"ram_budget": RAM} if mode == "sparse" else {}
    engine = Engine.load(models["prosparse"], mode=mode, cpu_weights=weights, **kw)
    assert engine.cache.k[0].dtype == torch.float32
    _check_same(engine, monkeypatch)


def test_fused_decode_is_one_specialisation(models, monkeypatch, one_torch_thread):
    """Every storage runs through the same compiled layer function (one compile, one cache entry)."""
    for weights in ("int8", "int4", "fp32"):
        engine = Engine.load(models["minicpm"], mode="sparse", ram_budget=RAM, cpu_weights=weights)
        _steps(engine, True, monkeypatch)
    dl = fused_decode.kernels()
    assert len(dl.decode_layer.signatures) == 1 and len(dl.decode_head.signatures) == 1


@pytest.mark.parametrize("hot_weights", ["", "int4"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_hot_rows_on_the_cpu_stand_in_are_fused_and_moves_rebuild_the_call(models, weights, hot_weights,
                                                                           monkeypatch, one_torch_thread):
    """Hybrid with the CPU as the fast device: fp32 (or 4-bit) hot rows beside the cold ones,
    then neurons moved between the tiers, each placement's arguments rebuilt at the next token."""
    monkeypatch.setenv("THERMOCLINE_HOT_WEIGHTS", hot_weights)
    # the exact KV cache: fp16's rounding steps magnify the last bit the two paths may differ by
    monkeypatch.setenv("THERMOCLINE_KV_CACHE", "fp32")
    hybrid = Engine.load(models["prosparse"], mode="hybrid", vram_budget=0, ram_budget=RAM, cpu_weights=weights)
    for fraction in (0.5, 0.2, 0.0):
        hybrid.set_budgets(vram=vram_for(hybrid, fraction))
        hot = [len(layer.ffn.hot) for layer in hybrid.model.layers]
        assert (sum(hot) > 0) == (fraction > 0)
        _check_same(hybrid, monkeypatch)
        assert all(layer.fused.why == "" for layer in hybrid.model.layers)
        if fraction:
            assert hybrid.sparse.counters.fractions()[1] > 0.0


def test_oracle_and_observers_take_the_unfused_path(models, tmp_path, monkeypatch, one_torch_thread):
    oracle = Engine.load(models["relullama"], mode="oracle", ram_budget=RAM, cpu_weights="int8")
    _steps(oracle, True, monkeypatch)
    assert _calls(oracle) == [0, 0] and "oracle" in oracle.model.layers[0].fused.why
    # an FFN observer (calibration) sees every layer's activations: unfused
    engine = Engine.load(models["relullama"], mode="sparse", ram_budget=RAM, cpu_weights="int8")
    seen = []
    engine.model.ffn_observer = lambda layer, x, acts: seen.append(layer)
    _steps(engine, True, monkeypatch)
    assert _calls(engine) == [0, 0] and len(seen) == 2 * len(PROMPT)


def test_falcon_takes_the_unfused_path(tiny_models, monkeypatch, one_torch_thread):
    engine = Engine.load(tiny_models["falcon_new"], mode="dense", cpu_weights="int8")
    fused, unfused = _steps(engine, True, monkeypatch), _steps(engine, False, monkeypatch)
    assert _calls(engine) == [0] * len(engine.model.layers)
    assert "Falcon" in engine.model.layers[0].fused.why or "LayerNorm" in engine.model.layers[0].fused.why
    assert torch.equal(fused, unfused)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_int4_matrices_fused_packed_and_as_rows(models, mode, monkeypatch, one_torch_thread):
    """The CPU tier's 4-bit matrices are packed in groups of 8 rows (cpu_q4x8) and the fused call
    reads them so; the same matrices as plain rows (a GGUF's, unpacked) take the row kernels,
    and both decode as the unfused path."""
    from engine.kernels import cpu_q4x8
    from engine.kernels.quantized import Q4Matrix

    dl = fused_decode.kernels()
    kw = {"ram_budget": RAM} if mode == "sparse" else {}
    engine = Engine.load(models["prosparse"], mode=mode, cpu_weights="int4", **kw)
    mats = [m for layer in engine.model.layers for m in (layer.qkv, layer.out)] + [engine.model.lm_head]
    assert all(isinstance(m, Q4Matrix) and m.packed for m in mats)
    _check_same(engine, monkeypatch)
    assert {layer.fused.args[10] for layer in engine.model.layers} == {dl.M_Q4X8}  # qkv's kind
    packed = _steps(engine, True, monkeypatch)
    for layer in engine.model.layers:
        layer.qkv, layer.out = (Q4Matrix(cpu_q4x8.unpack_rows(m.q), m.cols) for m in (layer.qkv, layer.out))
    _check_same(engine, monkeypatch)
    assert {layer.fused.args[10] for layer in engine.model.layers} <= {dl.M_Q4, dl.M_Q4_TILES}
    # the same integer products: the two layouts' logits differ by the fp32 sums' order only
    rows = _steps(engine, True, monkeypatch)
    assert (packed - rows).abs().max().item() <= 1e-4 * max(1.0, rows.abs().max().item())


@pytest.mark.parametrize("packed", [True, False])
def test_q4_1_matrices_are_fused(models, packed, monkeypatch, one_torch_thread):
    """A Q4_1 GGUF's matrices (SmolLM2's), kept as Q4_0 rows plus block offsets (Q4MinMatrix),
    packed as the dense mode keeps them or as plain rows: fused, and decoded as the unfused path."""
    from engine.kernels import cpu_q4_1
    from engine.kernels.quantized import Q4MinMatrix

    def q4_1(m):  # the matrix's values rounded to Q4_1 blocks: what a Q4_1 file decodes to
        w = m.dequantize().numpy()
        return Q4MinMatrix.exact(torch.from_numpy(cpu_q4_1.dequantize_blocks(cpu_q4_1.quantize_blocks(w)).copy()),
                                 packed=packed)

    dl = fused_decode.kernels()
    engine = Engine.load(models["prosparse"], mode="dense", cpu_weights="int4")
    for layer in engine.model.layers:
        layer.qkv, layer.out, layer.ffn.gate_up, layer.ffn.down = map(
            q4_1, (layer.qkv, layer.out, layer.ffn.gate_up, layer.ffn.down))
        # ReLU, not ProSparse's FATReLU at 0.01: its step turns one neuron that the two paths'
        # rounding puts either side of 0.01 into a 1e-3 logit change (one token of 8 on an AMD
        # host); at 0 the activation is continuous and the paths differ by rounding only
        layer.ffn.threshold = 0.0
    _check_same(engine, monkeypatch)
    kinds = {dl.M_Q4MIN_X8} if packed else {dl.M_Q4MIN, dl.M_Q4MIN_TILES}
    assert {layer.fused.args[10] for layer in engine.model.layers} <= kinds  # qkv's kind


def test_int4_with_fp32_activations_takes_the_unfused_path(models, monkeypatch, one_torch_thread):
    engine = Engine.load(models["relullama"], mode="sparse", ram_budget=RAM, cpu_weights="int4")
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    _steps(engine, True, monkeypatch)
    assert _calls(engine) == [0, 0]


def test_a_bad_switch_value_is_refused(models, monkeypatch, capsys, tmp_path):
    from app.cli import main

    monkeypatch.setenv(fused_decode.FUSED_ENV, "maybe")
    with pytest.raises(UserError, match=fused_decode.FUSED_ENV):
        Engine.load(models["relullama"])
    model = tmp_path / "m"
    shutil.copytree(models["relullama"], model)
    assert main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fused_decode.FUSED_ENV in err[0]


def test_the_compiled_layer_is_cached_under_the_stamps_of_the_kernels_it_copies():
    """Its disk cache goes stale when cpu_numba, cpu_q4, cpu_q4x8 or q4_tiles change, not only this file."""
    from engine.kernels import cpu_q4x8, decode_layer, q4_tiles

    locator = decode_layer.decode_layer._cache._impl.locator
    stamp = locator.get_source_stamp()
    files = [decode_layer.__file__, cpu_numba.__file__, cpu_q4.__file__, cpu_q4x8.__file__, q4_tiles.__file__]
    assert len(stamp) == len(files) and len(set(stamp)) == len(files)
    # other files' functions keep numba's own locator
    assert not isinstance(cpu_numba.ffn_rows._cache._impl.locator, decode_layer._StampedWithKernels)


def test_a_sliding_window_shorter_than_the_context_takes_the_unfused_path(models, tmp_path, monkeypatch,
                                                                          one_torch_thread):
    import json

    path = tmp_path / "bamboo"
    shutil.copytree(models["bamboo"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 5}))
    engine = Engine.load(path, mode="sparse", ram_budget=RAM, cpu_weights="int8", ctx=64)
    assert engine.cache.rolling
    fused, unfused = _steps(engine, True, monkeypatch), _steps(engine, False, monkeypatch)
    assert _calls(engine) == [0, 0] and "window" in engine.model.layers[0].fused.why
    assert torch.equal(fused, unfused)


# ------------------------------------------------------------------ mixtures of experts
# hidden 256: the router's and the predictors' int8 x int8 products and 4-bit tiles, as WIDE
MOE_SIZES = {"hidden": 256, "heads": 4, "kv_heads": 2, "experts": 8, "active": 2, "ff": 64, "layers": 2}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """SmallThinker (ReGLU experts routed on the layer input, sigmoid weights) and TurboSparse-Mixtral
    (dReLU experts with their predictors, routed on the FFN's input, softmax), from the real configs."""
    import smallthinker_factory as sf
    import turbosparse_mixtral_factory as tf

    root = tmp_path_factory.mktemp("fused_moe")
    st = sf.smallthinker(root / "st", seed=3, **{**MOE_SIZES, "head_dim": 32})
    tsm = tf.turbosparse_mixtral(root / "tsm", seed=4, **MOE_SIZES)
    return {"smallthinker": st, "turbosparse-mixtral": tsm}


# The two paths' RMSNorms differ in the last fp32 bit (torch's fp32 mean and rsqrt; the fused
# call's fp64 sum), as for the dense layers; the 4-bit kernels quantize the activations to int8
# per block of 32, where a last-bit difference at a rounding boundary moves one int8 step of one
# block (measured 1.6e-4 of the logits' scale, once in 8 tokens, with hot rows beside the cold).
INT4_FLIP = 5e-4


def _split_experts(engine) -> int:
    """Experts whose neurons the placement split between the tiers."""
    return sum(0 < layer.ffn.hot.neurons(e) < layer.ffn.n_ff
               for layer in engine.model.layers for e in range(layer.ffn.num_experts))


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("family", ["smallthinker", "turbosparse-mixtral"])
def test_moe_decode_fused_equals_unfused(moe_models, family, weights, monkeypatch, one_torch_thread):
    """One compiled call per mixture layer (router, top-k, the chosen experts' predicted or gated
    rows, the fired neurons' up and down rows) against TieredMoe's unfused decode."""
    engine = Engine.load(moe_models[family], mode="sparse", ram_budget=RAM, cpu_weights=weights)
    _check_same(engine, monkeypatch)
    assert all(layer.fused.why == "" and layer.fused.moe is not None for layer in engine.model.layers)
    assert engine.sparse.counters.expert_bytes > 0


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("family", ["smallthinker", "turbosparse-mixtral"])
def test_moe_split_experts_on_the_cpu_stand_in_are_fused_and_moves_rebuild_the_call(moe_models, family, weights,
                                                                                    monkeypatch, one_torch_thread):
    """Hybrid with the CPU as the fast device: whole and split experts (fp32 hot rows beside the
    CPU tier's), then neurons moved, each placement's expert table rebuilt at the next token."""
    monkeypatch.setenv("THERMOCLINE_KV_CACHE", "fp32")  # fp32 hot rows: the exact cache (see above)
    hybrid = Engine.load(moe_models[family], mode="hybrid", vram_budget=0, ram_budget=RAM, cpu_weights=weights)
    for fraction in (0.3, 0.0):  # the second: every hot neuron moved back, the table rebuilt
        hybrid.set_budgets(vram=vram_for(hybrid, fraction))
        assert (_split_experts(hybrid) > 0) == (fraction > 0)
        _check_same(hybrid, monkeypatch, INT4_FLIP if weights == "int4" else 1e-5)
        assert all(layer.fused.why == "" for layer in hybrid.model.layers)
        hot_rows = sum(int(layer.fused.args[-1][1, :, 0].sum()) for layer in hybrid.model.layers)  # the table's
        assert hot_rows == sum(len(layer.ffn.hot.unit_ids(layer.ffn.n_ff)) for layer in hybrid.model.layers)
        assert (hot_rows > 0) == (fraction > 0)


def _prompt_logits(engine, fused: bool, monkeypatch) -> torch.Tensor:
    """Logits of every position of PROMPT read as one prompt."""
    monkeypatch.setenv(fused_decode.FUSED_ENV, "1" if fused else "0")
    engine.reset()
    return engine.model.forward(torch.tensor(PROMPT), 0, engine.cache, all_logits=True)


def _prompt_calls(engine) -> list[int]:
    return [getattr(getattr(layer.ffn, "fused_prompt", None), "calls", 0) for layer in engine.model.layers]


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("family", ["smallthinker", "turbosparse-mixtral"])
def test_moe_prompt_experts_in_one_call_equal_the_unfused_path(moe_models, family, weights, monkeypatch,
                                                               one_torch_thread):
    """A prompt's experts in one compiled call (each token alone on a thread: fused_decode.moe_prompt)
    against TieredMoe's expert-by-expert path: the same logits at every position, in the sparse
    mode and with experts split between the tiers (the CPU standing in for the fast one); a
    placement that moves neurons rebuilds the call's table."""
    monkeypatch.setenv("THERMOCLINE_KV_CACHE", "fp32")  # fp32 hot rows: the exact cache (see above)
    sparse = Engine.load(moe_models[family], mode="sparse", ram_budget=RAM, cpu_weights=weights)
    hybrid = Engine.load(moe_models[family], mode="hybrid", vram_budget=0, ram_budget=RAM, cpu_weights=weights)
    for engine, fractions in ((sparse, (None,)), (hybrid, (0.3, 0.0))):
        engine.wait_kernels()  # a first start's preparation hands the mixture's kernels over at its end
        fused_decode.wait_compiled_behind()  # and where numba's cache lacks them they compile behind the decode
        for fraction in fractions:
            if fraction is not None:
                engine.set_budgets(vram=vram_for(engine, fraction))
                assert (_split_experts(engine) > 0) == (fraction > 0)
            for layer in engine.model.layers:  # (a placement that moved neurons builds new plans, at 0)
                if getattr(layer.ffn, "fused_prompt", None) is not None:
                    layer.ffn.fused_prompt.calls = 0
            unfused = _prompt_logits(engine, False, monkeypatch)
            assert _prompt_calls(engine) == [0, 0]  # the switch off: the expert-by-expert path
            fused = _prompt_logits(engine, True, monkeypatch)
            assert _prompt_calls(engine) == [1, 1]
            scale = unfused.abs().max().item()
            assert scale > 0.05 and unfused.shape[0] == len(PROMPT)
            bound = INT4_FLIP if weights == "int4" else 1e-5
            assert (fused - unfused).abs().max().item() <= bound * max(1.0, scale)
    dl = fused_decode.kernels()
    assert len(dl.moe_experts_tokens.signatures) == 1  # every storage and both families: one specialisation


def test_moe_prefetch_and_oracle(moe_models, monkeypatch, one_torch_thread):
    """The prefetch thread's reads start before attention: unfused. The oracle computes every
    neuron of the chosen experts (no predictor) and is fused as such."""
    engine = Engine.load(moe_models["turbosparse-mixtral"], mode="sparse", ram_budget=RAM, cpu_weights="int8")
    engine.sparse.set_prefetch(True)
    fused, unfused = _steps(engine, True, monkeypatch), _steps(engine, False, monkeypatch)
    assert _calls(engine) == [0, 0] and torch.equal(fused, unfused)
    engine.sparse.set_prefetch(False)
    oracle = Engine.load(moe_models["turbosparse-mixtral"], mode="oracle", ram_budget=RAM, cpu_weights="int8")
    _check_same(oracle, monkeypatch)
    assert oracle.model.layers[0].fused.args is not None
    dl = fused_decode.kernels()
    assert len(dl.decode_moe_layer.signatures) == 1  # every storage and both families: one specialisation
