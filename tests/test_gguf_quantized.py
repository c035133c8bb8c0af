"""A GGUF's Q4_0 / Q8_0 tensors are imported as the checkpoint's quantized tensor kinds
(`NAME.q4_0`, `NAME.t.q4_0`, engine.kernels.tensor_kinds): the checkpoint is the GGUF's
size, every load reads the same values as the F32 import did, and an int4 CPU tier takes
the file's 4-bit codes as they are (cold rows, attention, head, prepared layout)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import gguf_factory as gf
import model_factory as mf
from app.cli import main
from engine import Engine, SamplingParams
from engine.kernels import cpu_q4, q4_format, q4_quantize
from engine.errors import ModelFormatError
from engine.loading.gguf_import import import_gguf
from engine.loading.gguf_reader import reader_class, unpermute
from engine.loading.prepared import PreparedRows, prepared_path
from engine.kernels.quantized import Q4Matrix
from engine.loading.weights import WeightSource
from hub_server import registry_env  # noqa: F401


PROMPT = [0, 5, 9, 17, 33, 100, 7, 8]
RANK = 32
D, FF, HEADS, KV = 64, 160, 4, 2


def _shift_zero_nibbles(path: Path) -> None:
    """Make every Q4_0 block one ggml's quantizer would not write (no nibble 0, so its
    largest magnitude is not -8 d): requantizing its values changes the codes."""
    reader = reader_class()(path, "r+")
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            blocks = t.data.reshape(-1, 18)
            nib = blocks[:, 2:]
            lo, hi = nib & 15, nib >> 4
            lo[lo == 0], hi[hi == 0] = 1, 1
            nib[...] = lo | (hi << 4)
    reader.data.flush()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A PowerInfer-style Q4_0 GGUF of non-reference blocks, imported both ways."""
    root = tmp_path_factory.mktemp("q4gguf")
    hf = mf.llama_relu(root / "hf", dtype=torch.float16)
    g = np.random.default_rng(0)
    preds = ([g.standard_normal((RANK, D)).astype(np.float32) for _ in range(2)],
             [g.standard_normal((FF, RANK)).astype(np.float32) for _ in range(2)])
    path = gf.write_gguf(hf, root / "tiny-q4.powerinfer.gguf", qtype="Q4_0", predictors=preds,
                         sparse_threshold=0.0)
    _shift_zero_nibbles(path)
    quant, f32 = root / "quant", root / "f32"
    import_gguf(path, quant)
    import_gguf(path, f32, quantized=False)
    raw = {t.name: np.asarray(t.data).copy() for t in reader_class()(path, "r").tensors}
    return path, quant, f32, raw


def _data_bytes(safetensors: Path) -> int:
    with open(safetensors, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return safetensors.stat().st_size - 8 - n


def test_quantized_checkpoint_is_the_gguf_size_and_reads_the_same_values(imported):
    path, quant, f32, raw = imported
    # the tensors' bytes are the GGUF's (predictors go to the sidecar, as before)
    gguf_bytes = sum(a.nbytes for name, a in raw.items() if ".fc" not in name)
    assert _data_bytes(quant / "model.safetensors") == gguf_bytes
    assert (quant / "model.safetensors").stat().st_size < 0.2 * (f32 / "model.safetensors").stat().st_size
    a, b = WeightSource(quant), WeightSource(f32)
    assert a.names() == b.names()
    assert a.quant_kind("model.layers.0.mlp.down_proj.weight") == ("Q4_0", True)
    for name in sorted(b.names()):
        assert a.shape(name) == b.shape(name), name
        assert torch.equal(a.get(name), b.get(name)), name
    # the dense path computes the same model: identical logits and greedy ids
    ref, imp = Engine.load(f32), Engine.load(quant)
    for e in (ref, imp):
        e.eos_ids = set()
    assert torch.equal(ref.score(PROMPT), imp.score(PROMPT))
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    assert ref.generate(PROMPT, greedy).token_ids == imp.generate(PROMPT, greedy).token_ids


def _q4(a: np.ndarray, rows: int) -> np.ndarray:
    return a.reshape(rows, -1)


def _rows_of(m) -> np.ndarray:
    """A CPU-tier 4-bit matrix's codes as plain rows (the tier packs them in groups of 8 rows)."""
    from engine.kernels import cpu_q4x8

    assert isinstance(m, Q4Matrix) and m.packed
    return cpu_q4x8.unpack_rows(m.q).numpy()


def test_int4_cpu_tier_maps_the_files_codes_bit_exactly(imported, monkeypatch):
    path, quant, f32, raw = imported
    # oracle: every neuron that fires is computed (the tiny model's predictors are random)
    engine = Engine.load(quant, mode="oracle", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
    engine.eos_ids = set()
    prepared = PreparedRows(prepared_path(quant, "int4"))
    requantized_differs = False
    for i, layer in enumerate(engine.model.layers):
        want = {"gate": _q4(raw[f"blk.{i}.ffn_gate.weight"], FF), "up": _q4(raw[f"blk.{i}.ffn_up.weight"], FF),
                "down_t": _q4(raw[f"blk.{i}.ffn_down_t.weight"], FF)}
        assert torch.equal(layer.ffn.cold.ids, torch.arange(FF))
        for part, codes in want.items():
            assert np.array_equal(getattr(layer.ffn.cold.rows, part).numpy(), codes), (i, part)
            assert np.array_equal(prepared.tensor(f"layers.{i}.{part}").numpy(), codes), (i, part)
            # the F32 import requantized these values into other codes: this is what changed
            deq = q4_format.dequantize_rows_q4(torch.from_numpy(codes), D)
            requantized_differs |= not np.array_equal(q4_quantize.quantize_rows_q4(deq).numpy(), codes)
        # attention: q/k rows unpermuted as whole rows, v and o as they are
        hd = D // HEADS
        q = unpermute(_q4(raw[f"blk.{i}.attn_q.weight"], HEADS * hd), HEADS)
        k = unpermute(_q4(raw[f"blk.{i}.attn_k.weight"], KV * hd), KV)
        v = _q4(raw[f"blk.{i}.attn_v.weight"], KV * hd)
        assert np.array_equal(_rows_of(layer.qkv), np.concatenate([q, k, v]))
        assert np.array_equal(_rows_of(layer.out), _q4(raw[f"blk.{i}.attn_output.weight"], D))
    assert requantized_differs
    assert np.array_equal(_rows_of(engine.model.lm_head), _q4(raw["output.weight"], 300))
    # those codes compute the file's values: with fp32 activations the oracle equals the
    # dense (dequantized) model within float rounding, and greedy ids agree
    dense = Engine.load(f32)
    dense.eos_ids = set()
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    assert (engine.score(PROMPT) - dense.score(PROMPT)).abs().max().item() < 1e-3
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    assert engine.generate(PROMPT, greedy).token_ids == dense.generate(PROMPT, greedy).token_ids
    # a second load maps the prepared rows: the same codes again
    again = Engine.load(quant, mode="sparse", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
    assert again.sparse.prepared_rows is not None
    assert np.array_equal(again.model.layers[1].ffn.cold.rows.up.numpy(), _q4(raw["blk.1.ffn_up.weight"], FF))


def _generate_fails(capsys, model: Path, *words) -> None:
    code = main(["generate", "--model", str(model), "--prompt", "hello", "--max-new-tokens", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(w in err[0] for w in words), err[0]


def test_truncated_or_lying_quantized_tensor_is_one_error_line(imported, tmp_path, capsys):
    _, quant, _, _ = imported
    name = "model.layers.0.mlp.up_proj.weight.q4_0"
    lying = tmp_path / "lying"
    shutil.copytree(quant, lying, ignore=shutil.ignore_patterns("thermocline"))
    # the same bytes said to be rows of 32 bytes: not whole Q4_0 blocks
    mf.rewrite_safetensors_header(quant / "model.safetensors", lying / "model.safetensors",
                    lambda h: h[name].__setitem__("shape", [180, 32]))
    _generate_fails(capsys, lying, name)
    # rows of 18 bytes: whole blocks, but not the shape config.json implies
    mf.rewrite_safetensors_header(quant / "model.safetensors", lying / "model.safetensors",
                    lambda h: h[name].__setitem__("shape", [320, 18]))
    _generate_fails(capsys, lying, "up_proj", "shape")
    # the same bytes as 3-D [rows, 2, one block]: the header alone is refused (WeightSource.shape)
    mf.rewrite_safetensors_header(quant / "model.safetensors", lying / "model.safetensors",
                    lambda h: h[name].__setitem__("shape", [160, 2, 18]))
    _generate_fails(capsys, lying, name, "Q4_0 rows")
    with pytest.raises(ModelFormatError, match="not Q4_0 rows"):
        WeightSource(lying).shape(name[: -len(".q4_0")])
    cut = tmp_path / "cut"
    shutil.copytree(quant, cut, ignore=shutil.ignore_patterns("thermocline"))
    data = (quant / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    _generate_fails(capsys, cut)


def _q6_k_fp64(raw: np.ndarray) -> np.ndarray:
    """An fp64 decode of ggml's block_q6_K written from its layout (ggml-quants.c), not the
    importer's code: per 256 weights ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16]
    (one per 16 weights), fp16 d. Each half of 128 weights uses 64 ql bytes, 32 qh bytes and 8
    scales: weight 32*k + l (k = 0..3, l = 0..31) takes the low (k < 2) or high nibble of
    ql[l + 32*(k % 2)], bits 2k..2k+1 of qh[l], scale 2k + l // 16; value d * scale * (q - 32)."""
    blocks = raw.reshape(-1, 210)
    ql, qh = blocks[:, :128].astype(np.int64), blocks[:, 128:192].astype(np.int64)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float64)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float64)[:, 0]
    out = np.empty((len(blocks), 256), dtype=np.float64)
    for half in range(2):
        lo, hi, sc = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32], scales[:, 8 * half:]
        for k in range(4):
            ql_part = lo[:, 32 * (k % 2):32 * (k % 2) + 32]
            nibble = ql_part & 0xF if k < 2 else ql_part >> 4
            q = nibble | (((hi >> (2 * k)) & 3) << 4)
            scale = np.repeat(sc[:, 2 * k:2 * k + 2], 16, axis=1)  # l < 16: scale 2k, else 2k + 1
            out[:, 128 * half + 32 * k:128 * half + 32 * k + 32] = d[:, None] * scale * (q - 32)
    return out.reshape(-1)


def test_q6_k_output_head_of_a_llama_quantize_q4_0_file_is_read_exactly(tmp_path):
    """llama-quantize writes a Q4_0 file's output head as Q6_K: kept as its blocks (NAME.q6_k,
    a fifth of F32) and read exactly (d * scale * q fits fp32's 24 bits), the rest stays Q4_0
    blocks; an int4 CPU tier quantizes the head a step of rows at a time, to the bytes the
    whole fp32 matrix gives."""
    hf = mf.llama_relu(tmp_path / "hf", hidden=256, ff=256, layers=1, dtype=torch.float16)
    path = gf.write_gguf(hf, tmp_path / "q4-q6k.gguf", qtype="Q4_0", q6_k=("output.weight",), sparse_threshold=0.0)
    import_gguf(path, tmp_path / "m")
    raw = {t.name: t for t in reader_class()(path, "r").tensors}
    assert raw["output.weight"].tensor_type == gguf.GGMLQuantizationType.Q6_K
    want = _q6_k_fp64(np.asarray(raw["output.weight"].data).reshape(-1))
    source = WeightSource(tmp_path / "m")
    assert source.quant_kind("lm_head.weight") == ("Q6_K", False) and source.quant_kind("model.embed_tokens.weight")
    assert source.shape("lm_head.weight") == (300, 256)
    head = source.get("lm_head.weight")
    assert head.dtype == torch.float32
    assert torch.equal(head.double(), torch.from_numpy(want.reshape(300, 256)))  # exact in fp32
    assert torch.equal(source.rows("lm_head.weight", 7, 40), head[7:40])
    logits = Engine.load(tmp_path / "m").score(PROMPT)
    assert torch.isfinite(logits).all()
    int4 = Engine.load(tmp_path / "m", mode="oracle", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
    assert isinstance(int4.model.lm_head, Q4Matrix)
    assert torch.equal(int4.model.lm_head.rows(), q4_quantize.quantize_rows_q4(head))


def test_reference_q4_0_file_decodes_as_its_f32_import_on_the_int4_tier(tmp_path):
    """A file of ggml's reference Q4_0 rounding (what gguf.quants writes): requantizing its
    values gives its codes back, so the F32 import (before the quantized kinds) and the
    quantized one hold the same int4 rows: identical logits and greedy ids."""
    hf = mf.llama_relu(tmp_path / "hf", dtype=torch.float16)
    path = gf.write_gguf(hf, tmp_path / "ref-q4.gguf", qtype="Q4_0", sparse_threshold=0.0)
    import_gguf(path, tmp_path / "quant")
    import_gguf(path, tmp_path / "f32", quantized=False)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    engines = [Engine.load(tmp_path / name, mode="oracle", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
               for name in ("quant", "f32")]
    for e in engines:
        e.eos_ids = set()
    assert torch.equal(engines[0].score(PROMPT), engines[1].score(PROMPT))
    assert engines[0].generate(PROMPT, greedy).token_ids == engines[1].generate(PROMPT, greedy).token_ids


def test_q4_0_block_numbers_have_one_home_and_one_decode():
    """ggml's block_q4_0 sizes live in tensor_kinds (torch-free); the kernels and the placement
    rules take them from there, and a checkpoint's Q4_0 tensor decodes with the kernels' decode."""
    from engine.hotcold import placement
    from engine.kernels import tensor_kinds
    from engine.loading.weights import dequantize_blocks

    home = (tensor_kinds.Q4_0_BLOCK, tensor_kinds.Q4_0_BLOCK_BYTES)
    assert home == (32, 18) == tensor_kinds.QUANT_KINDS["q4_0"][1:]
    assert (q4_format.QK, q4_format.BLOCK_BYTES) == home == (placement.Q4_BLOCK, placement.Q4_BLOCK_BYTES)
    q = q4_quantize.quantize_rows_q4(torch.randn(5, 96, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(dequantize_blocks(q, "q4_0"), q4_format.dequantize_rows_q4(q, 96))
