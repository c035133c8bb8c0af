"""`thermocline models import FILE.gguf`: PowerInfer-style GGUFs written here with ggml's
`gguf` package from a tiny model (F16 and Q4_0, predictors, ffn_down_t, PWRI magic)
import and decode; damaged or lying files are refused with one error line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import gguf_factory as gf
import model_factory as mf
from app.cli import main
from engine import Engine, SamplingParams
from engine.loading.gguf_reader import reader_class
from engine.kernels import cpu_q4
from engine.kernels.q4_format import row_bytes
from engine.loading.prepared import prepared_path
from engine.loading.predictors import PredictorSet
from hub_server import registry_env  # noqa: F401


PROMPT = [0, 5, 9, 17, 33, 100, 7, 8]
RANK = 32


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny ReLU llama stored in fp16 (what an F16 GGUF holds), and predictors."""
    root = tmp_path_factory.mktemp("gguf")
    hf = mf.llama_relu(root / "hf", dtype=torch.float16)
    g = np.random.default_rng(0)
    preds = ([g.standard_normal((RANK, 64)).astype(np.float32) for _ in range(2)],
             [g.standard_normal((160, RANK)).astype(np.float32) for _ in range(2)])
    return hf, preds


def _write(hf_model, tmp_path, qtype, **kw):
    hf, preds = hf_model
    return gf.write_gguf(hf, tmp_path / f"tiny-{qtype}.powerinfer.gguf", qtype=qtype, predictors=preds,
                         sparse_threshold=0.25, **kw)


def _import(capsys, path, *extra):
    code = main(["models", "import", str(path), "--json", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_f16_powerinfer_gguf_decodes_as_the_safetensors_model(registry_env, hf_model, tmp_path, capsys):
    path = _write(hf_model, tmp_path, "F16")
    code, out, err = _import(capsys, path)
    assert code == 0, err
    info = json.loads(out)
    assert info["id"] == "local/tiny-F16" and info["powerinfer"] and info["predictors"]
    assert info["sparse_threshold"] == pytest.approx(0.25)
    model = info["path"]
    ref, imp = Engine.load(hf_model[0]), Engine.load(model)
    for e in (ref, imp):
        e.eos_ids = set()
    assert torch.equal(ref.score(PROMPT), imp.score(PROMPT))
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    assert ref.generate(PROMPT, greedy).token_ids == imp.generate(PROMPT, greedy).token_ids
    text = "the quick brown fox héllo wörld ✓"
    assert imp.tokenizer.encode(text) == ref.tokenizer.encode(text)
    assert imp.tokenizer.decode(imp.tokenizer.encode(text)).endswith(text)
    # the predictors came along, with PowerInfer's threshold
    predictors = PredictorSet.load(model, 2, 64, 160)
    assert predictors.thresholds == [pytest.approx(0.25)] * 2 and predictors.ranks == [RANK, RANK]
    assert np.array_equal(predictors.fc1[1].numpy(), hf_model[1][0][1].astype(np.float16).astype(np.float32))
    sparse = Engine.load(model, mode="sparse", ram_budget=1 << 30)
    sparse.eos_ids = set()
    assert len(sparse.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0)).token_ids) == 4
    # the sparse load prepared its int8 rows in the model's sidecar; `models remove` takes them too
    prepared = prepared_path(model, "int8")
    assert sparse.sparse.prepared_path == prepared and prepared.is_file()
    del sparse
    assert main(["models", "remove", "local/tiny-F16"]) == 0
    assert not prepared.exists() and not Path(model).exists()


def test_q4_0_gguf_rows_are_the_engines_4bit_rows(registry_env, hf_model, tmp_path, capsys):
    path = _write(hf_model, tmp_path, "Q4_0")
    code, out, err = _import(capsys, path)
    assert code == 0, err
    model = json.loads(out)["path"]
    f16_ref = Engine.load(hf_model[0]).score(PROMPT)
    q4 = Engine.load(model)
    logits = q4.score(PROMPT)
    # Q4_0 weights (embeddings and head too) against the fp16 model: within 0.3 per logit
    # (measured 0.10), cosine above 0.95 (measured 0.979)
    assert (logits - f16_ref).abs().max().item() < 0.3
    assert torch.nn.functional.cosine_similarity(logits, f16_ref, dim=-1).min().item() > 0.95
    # with 4-bit CPU rows the engine holds the file's own Q4_0 bytes: no requantisation loss
    engine = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=1 << 30, cpu_weights="int4")
    m = reader_class()(path, "r")
    raw = {t.name: np.asarray(t.data) for t in m.tensors}
    for i, layer in enumerate(engine.model.layers):
        rows = layer.ffn.cold.rows
        assert torch.equal(layer.ffn.cold.ids, torch.arange(160))
        assert np.array_equal(rows.up.numpy(), raw[f"blk.{i}.ffn_up.weight"].reshape(160, row_bytes(64)))
        assert np.array_equal(rows.gate.numpy(), raw[f"blk.{i}.ffn_gate.weight"].reshape(160, row_bytes(64)))
        assert np.array_equal(rows.down_t.numpy(), raw[f"blk.{i}.ffn_down_t.weight"].reshape(160, row_bytes(64)))
    # the kernels over those bytes compute the dequantized model: exactly with fp32
    # activations, within the activation's int8 rounding with the int8 x 4-bit kernels
    approx = engine.score(PROMPT, "oracle")
    assert (approx - logits).abs().max().item() < 0.05
    assert torch.nn.functional.cosine_similarity(approx, logits, dim=-1).min().item() > 0.999
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
        assert (engine.score(PROMPT, "oracle") - logits).abs().max().item() < 1e-3


def _refused(capsys, path, *words):
    code, out, err = _import(capsys, path)
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def _tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def test_truncated_and_lying_files_are_refused(registry_env, hf_model, tmp_path, capsys):
    good = _write(hf_model, tmp_path, "Q4_0")
    data = good.read_bytes()

    def variant(name, mutate):
        path = tmp_path / f"{name}.gguf"
        shutil.copy(good, path)
        reader = reader_class()(path, "r+")
        mutate(reader)
        reader.data.flush()
        del reader
        return path

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    _refused(capsys, cut, "truncated")
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:100])
    _refused(capsys, head, "truncated")
    # a tensor whose offset points past the end of the file
    far = variant("far", lambda r: _tensor(r, "blk.1.ffn_up.weight").field.parts[-1].__setitem__(0, 1 << 40))
    _refused(capsys, far, "blk.1.ffn_up.weight", "outside")
    # a tensor said to be larger than the data it has (its row count doubled)
    big = variant("big", lambda r: _tensor(r, "output.weight").field.parts[3].__setitem__(1, 600))
    _refused(capsys, big)
    # a type we cannot read (Q8_1, an activation type) written over a Q4_0 one
    qk = variant("qk", lambda r: _tensor(r, "blk.0.attn_v.weight").field.parts[4].__setitem__(0, 9))
    _refused(capsys, qk, "blk.0.attn_v.weight", "Q8_1")
    # a type id that does not exist
    bad_type = variant("badtype", lambda r: _tensor(r, "blk.0.attn_v.weight").field.parts[4].__setitem__(0, 999))
    _refused(capsys, bad_type)
    # two tensors over the same bytes
    overlap = variant("overlap", lambda r: _tensor(r, "blk.0.ffn_up.weight").field.parts[-1].__setitem__(
        0, _tensor(r, "blk.0.ffn_gate.weight").field.parts[-1][0]))
    _refused(capsys, overlap, "overlap")
    # not a GGUF at all
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 64)
    _refused(capsys, junk, "not a GGUF")
    # nothing was left behind in the models folder
    assert main(["models", "list", "--json"]) == 0
    assert "local/" not in capsys.readouterr().out


def test_unsupported_architecture_and_plain_llama_activation(registry_env, hf_model, tmp_path, capsys):
    hf, _ = hf_model
    falcon = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(falcon), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(capsys, falcon, "falcon")
    plain = gf.write_gguf(hf, tmp_path / "plain.gguf", qtype="Q8_0", powerinfer=False)
    # a plain llama file is SwiGLU, as llama.cpp computes it (Llama 2/3, Mistral, SmolLM2)
    code, out, err = _import(capsys, plain)
    assert code == 0, err
    assert json.loads((Path(json.loads(out)["path"]) / "config.json").read_text())["hidden_act"] == "silu"
    code, out, err = _import(capsys, plain, "--activation", "relu", "--name", "plain-relu")
    assert code == 0, err
    imported = Engine.load(json.loads(out)["path"]).score(PROMPT)
    # Q8_0 (ffn_down requantized nowhere: the engine transposes the exact values)
    assert (imported - Engine.load(hf).score(PROMPT)).abs().max().item() < 0.02
