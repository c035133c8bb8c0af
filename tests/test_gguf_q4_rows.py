"""First loads of Q4_0 GGUFs at int4 keep the file's 4-bit rows as they are, for blocks
ggml's reference quantizer would not write (scales max|w| / 7, no code 0: an imatrix
file's blocks are not reference-rounded either, and a dequantize-requantize round trip
changes them). A plain llama.cpp file's `ffn_down` has its blocks along the intermediate
dimension: its neuron rows are requantized (the one lossy step), while the float hot rows
of the fast tier take its exact values; the FFN is never staged whole in fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf_factory as gf
import model_factory as mf
from engine import Engine, SamplingParams
from engine.kernels import q4_format, q4_quantize
from engine.loading.gguf_import import import_gguf
from engine.loading.gguf_reader import reader_class, unpermute
from engine.loading.prepared import PreparedRows, prepared_path
from engine.kernels.quantized import Q4Matrix
from test_sparse import vram_for


PROMPT = [0, 5, 9, 17, 33, 100, 7, 8]
D, FF, HEADS, KV, VOCAB = 64, 160, 4, 2, 300


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A plain llama.cpp-layout GGUF (ffn_down, no predictors) in Q4_0 of non-reference
    blocks, imported; the same model's F16 file imported as the reference."""
    root = tmp_path_factory.mktemp("q4rows")
    hf = mf.llama_relu(root / "hf", dtype=torch.float16)
    path = gf.write_gguf(hf, root / "tiny-q4.gguf", qtype="Q4_0", powerinfer=False, q4_scales="symmetric")
    f16 = gf.write_gguf(hf, root / "tiny-f16.gguf", qtype="F16", powerinfer=False)
    notes = import_gguf(path, root / "q4", activation="relu")["notes"]
    assert len(notes) == 1 and "requantizes the down projection" in notes[0]
    import_gguf(f16, root / "f16", activation="relu")
    import_gguf(path, root / "q4-f32", activation="relu", quantized=False)  # the file's exact values
    raw = {t.name: np.asarray(t.data).copy() for t in reader_class()(path, "r").tensors}
    return root, raw


def _rows(raw: dict, name: str, rows: int) -> np.ndarray:
    return raw[name].reshape(rows, -1)


def _deq(codes: np.ndarray, cols: int) -> torch.Tensor:
    return q4_format.dequantize_rows_q4(torch.from_numpy(np.ascontiguousarray(codes)), cols)


def test_non_reference_blocks_are_not_a_round_trip(plain):
    """The premise: these blocks change when their values are requantized (so the tests
    below fail if the load takes that round trip), and no code is 0."""
    _, raw = plain
    codes = _rows(raw, "blk.0.ffn_up.weight", FF)
    nib = codes.reshape(FF, -1, 18)[:, :, 2:]
    assert ((nib & 15) != 0).all() and ((nib >> 4) != 0).all()
    assert not np.array_equal(q4_quantize.quantize_rows_q4(_deq(codes, D)).numpy(), codes)


def test_plain_q4_0_gguf_keeps_its_rows_and_requantizes_only_down(plain):
    root, raw = plain
    model = root / "q4"
    engine = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
    engine.eos_ids = set()
    prepared = PreparedRows(prepared_path(model, "int4"))
    for i, layer in enumerate(engine.model.layers):
        rows = layer.ffn.cold.rows
        assert torch.equal(layer.ffn.cold.ids, torch.arange(FF))
        for part in ("gate", "up"):
            codes = _rows(raw, f"blk.{i}.ffn_{part}.weight", FF)
            assert np.array_equal(getattr(rows, part).numpy(), codes), (i, part)
            assert np.array_equal(prepared.tensor(f"layers.{i}.{part}").numpy(), codes), (i, part)
        # down: blocks along the intermediate dimension; its neuron rows are ggml's rounding of its values
        down = _deq(_rows(raw, f"blk.{i}.ffn_down.weight", D), FF)
        want = q4_quantize.quantize_rows_q4(down.t().contiguous()).numpy()
        assert np.array_equal(rows.down_t.numpy(), want)
        assert np.array_equal(prepared.tensor(f"layers.{i}.down_t").numpy(), want)
        # attention and head: the file's rows (q/k unpermuted as whole rows)
        hd = D // HEADS
        q = unpermute(_rows(raw, f"blk.{i}.attn_q.weight", HEADS * hd), HEADS)
        k = unpermute(_rows(raw, f"blk.{i}.attn_k.weight", KV * hd), KV)
        v = _rows(raw, f"blk.{i}.attn_v.weight", KV * hd)
        # (the CPU tier packs whole-read matrices: the same bytes, interleaved; rows() unpacks)
        assert isinstance(layer.qkv, Q4Matrix) and layer.qkv.packed and layer.out.packed
        assert np.array_equal(layer.qkv.rows().numpy(), np.concatenate([q, k, v]))
        assert np.array_equal(layer.out.rows().numpy(), _rows(raw, f"blk.{i}.attn_output.weight", D))
    assert np.array_equal(engine.model.lm_head.rows().numpy(), _rows(raw, "output.weight", VOCAB))
    # against the file's exact values (dense, fp32): only the down rows' requantization and
    # the activations' int8 rounding move the logits (measured 0.012 max; 0.010 with fp32 activations)
    exact = Engine.load(root / "q4-f32")
    exact.eos_ids = set()
    logits, want = engine.score(PROMPT), exact.score(PROMPT)
    assert (logits - want).abs().max().item() < 0.05
    # against the F16 file: the 4-bit weights' error (measured 0.11 max, cosine 0.973; the
    # logits spread 0.16): the bounds of test_gguf_import's Q4_0 file
    f16 = Engine.load(root / "f16")
    f16.eos_ids = set()
    ref = f16.score(PROMPT)
    assert (logits - ref).abs().max().item() < 0.3
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=-1).min().item() > 0.95
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    assert engine.generate(PROMPT, greedy).token_ids == exact.generate(PROMPT, greedy).token_ids
    # a second load maps the prepared rows: the same bytes
    again = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
    assert again.sparse.prepared_rows is not None
    assert np.array_equal(again.model.layers[1].ffn.cold.rows.gate.numpy(), _rows(raw, "blk.1.ffn_gate.weight", FF))


def test_float_hot_rows_of_a_q4_0_file_are_its_exact_values(plain):
    """Neurons the fast tier takes (the CPU stands in, fp32) hold the file's values, the down
    rows read from ffn_down's blocks (not the requantized rows); the rest stay the file's
    4-bit rows."""
    root, raw = plain
    probe = Engine.load(root / "q4", mode="oracle", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
    budget = vram_for(probe, 0.5)
    engine = Engine.load(root / "q4", mode="oracle", vram_budget=budget, ram_budget=1 << 30, cpu_weights="int4")
    hot_seen = 0
    for i, layer in enumerate(engine.model.layers):
        hot, cold = layer.ffn.hot, layer.ffn.cold
        ids = hot.ids.cpu()
        hot_seen += len(ids)
        for part in ("gate", "up"):
            codes = _rows(raw, f"blk.{i}.ffn_{part}.weight", FF)
            assert torch.equal(getattr(hot, part).float().cpu(), _deq(codes, D)[ids]), (i, part)
            assert np.array_equal(getattr(cold.rows, part).numpy(), codes[cold.ids.numpy()]), (i, part)
        down = _deq(_rows(raw, f"blk.{i}.ffn_down.weight", D), FF)
        assert torch.equal(hot.down_t.float().cpu(), down.t()[ids]), i
    assert hot_seen > 0


def test_predictors_keep_their_file_precision(tmp_path):
    """PowerInfer's Q4_0 files quantize the predictors too: they are stored as the file's
    Q4_0 rows and the int4 tier computes with those bytes; an F16 file's stay F16 (half of the
    fp32 the import used to write)."""
    from safetensors import safe_open

    from engine.loading.predictors import PredictorSet
    from engine.loading.sidecar import sidecar_dir

    hf = mf.llama_relu(tmp_path / "hf", dtype=torch.float16)
    g = np.random.default_rng(0)
    preds = ([g.standard_normal((32, D)).astype(np.float32) for _ in range(2)],
             [g.standard_normal((FF, 32)).astype(np.float32) for _ in range(2)])
    for qtype in ("Q4_0", "F16"):
        path = gf.write_gguf(hf, tmp_path / f"p-{qtype}.powerinfer.gguf", qtype=qtype, predictors=preds,
                             sparse_threshold=0.0, q4_scales="symmetric")
        model = tmp_path / qtype
        import_gguf(path, model)
        raw = {t.name: np.asarray(t.data).copy() for t in reader_class()(path, "r").tensors}
        stored = sidecar_dir(model) / "predictors.safetensors"
        with safe_open(str(stored), framework="pt") as f:
            dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
        if qtype == "F16":
            assert set(dtypes.values()) == {"F16"}
            assert stored.stat().st_size < 2 * 2 * 32 * (D + FF) * 2 + 4096  # 2 bytes a weight (+ header)
            loaded = PredictorSet.load(model, 2, D, FF)
            assert loaded.fc1[0].dtype == torch.float16
            assert np.array_equal(loaded.fc2[1].numpy(), raw["blk.1.fc2.weight"])
            continue
        assert set(dtypes) == {f"layers.{i}.fc{k}.weight.q4_0" for i in range(2) for k in (1, 2)}
        engine = Engine.load(model, mode="sparse", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
        for i in range(2):
            for k, rows in ((1, 32), (2, FF)):
                w = getattr(engine.sparse.predictors, f"fc{k}")[i]
                assert isinstance(w, Q4Matrix) and np.array_equal(w.rows().numpy(), _rows(raw, f"blk.{i}.fc{k}.weight", rows))
        engine.eos_ids = set()
        assert len(engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0)).token_ids) == 4
        # the fp32 tier reads them dequantized: the file's values
        fp32 = Engine.load(model, mode="sparse", vram_budget=0, ram_budget=1 << 30, cpu_weights="fp32")
        assert torch.equal(fp32.sparse.predictors.fc1[0], _deq(_rows(raw, "blk.0.fc1.weight", 32), D))


def test_stored_blocks_decode_stepwise_to_the_whole_decode(plain, tmp_path, monkeypatch):
    """WeightSource.get decodes a quantized weight a step of rows at a time (the whole-tensor
    decode's temporaries were three times an embedding's fp32 copy): the same values, for
    rows and for a transposed kind, and transposed_rows reads any column range exactly."""
    from safetensors.torch import save_file

    from engine.loading import weights
    from engine.loading.weights import WeightSource

    monkeypatch.setattr(weights, "_DEQUANT_ROWS", 7)
    root, _ = plain
    quant, exact = WeightSource(root / "q4"), WeightSource(root / "q4-f32")
    for name in sorted(exact.names()):
        assert torch.equal(quant.get(name), exact.get(name)), name
    q = q4_quantize.quantize_rows_q4(torch.randn(45, 96, generator=torch.Generator().manual_seed(1)))
    save_file({"w.t.q4_0": q, "v.q4_0": q.clone()}, str(tmp_path / "model.safetensors"))
    src = WeightSource(tmp_path)
    full = q4_format.dequantize_rows_q4(q, 96)
    assert torch.equal(src.get("w"), full.t()) and torch.equal(src.get("v"), full)
    for lo, hi in ((0, 96), (5, 40), (32, 64), (90, 96)):
        assert torch.equal(src.transposed_rows("v", lo, hi), full[:, lo:hi].t())
    assert torch.equal(src.transposed_rows("w", 3, 20), full[3:20])
