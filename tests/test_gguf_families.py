"""GGUFs of the families users have beyond Llama: Qwen2 (q/k/v biases, unpermuted q/k rows),
imported and checked against transformers on a tiny model built from the published config
(tests/data/real_configs/qwen2.5-0.5b, sizes shrunk)."""

from __future__ import annotations

import json

import pytest
import torch

import gguf_factory
from model_factory import build_tokenizer
from real_config_models import real_config, shrink
from engine import Engine
from engine.loading.gguf_import import import_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread", "exact_kv_cache")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("qwen2")
    config = shrink(real_config("qwen2.5-0.5b"), vocab=300)
    config.update(bos_token_id=0, eos_token_id=1, max_position_embeddings=512)
    torch.manual_seed(5)
    model = Qwen2ForCausalLM(Qwen2Config(**config)).eval()
    with torch.no_grad():  # Qwen2's q/k/v biases start at 0: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf = root / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    build_tokenizer(hf, vocab_size=300)
    return model, hf, root


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_qwen2_gguf_imports_with_its_biases_and_matches_transformers(qwen2, qtype):
    model, hf, root = qwen2
    path = gguf_factory.write_gguf(hf, root / f"qwen2-{qtype}.gguf", qtype=qtype, powerinfer=False, arch="qwen2")
    folder = root / f"imported-{qtype}"
    summary = import_gguf(path, folder)
    config = json.loads((folder / "config.json").read_text())
    assert summary["architecture"] == "qwen2" and config["model_type"] == "qwen2" and config["attention_bias"]
    engine = Engine.load(folder, mode="dense", cpu_weights="fp32", ctx=64)
    assert engine.model.layers[0].qkv_bias is not None and engine.config.tie_word_embeddings
    ids = [0, 5, 17, 42, 99, 123, 250, 7, 64, 3]
    if qtype == "Q8_0":  # the reference reads the values the file holds
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(root, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0]
    ours = engine.score(ids)
    assert (ours - theirs).abs().max().item() < 1e-4 * max(1.0, theirs.abs().max().item())


def test_a_q4_k_m_gguf_imports_and_matches_transformers_gguf_loader(tmp_path):
    """llama-quantize's Q4_K_M types (Q4_K matrices, Q6_K attn_v / ffn_down / head) in a llama
    file: imported as their blocks, decoded once, logits as transformers' GGUF loader's."""
    import model_factory
    from transformers import AutoModelForCausalLM

    hf = model_factory.llama_relu(tmp_path / "hf", hidden=256, ff=512, heads=4, kv_heads=2, act="silu", seed=3)
    path = gguf_factory.write_gguf(hf, tmp_path / "m.gguf", qtype="Q4_K_M", powerinfer=False)
    summary = import_gguf(path, tmp_path / "imported")
    assert set(summary["tensor_types"]) == {"F32", "Q4_K", "Q6_K"}
    engine = Engine.load(tmp_path / "imported", mode="dense", cpu_weights="fp32", ctx=64)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = [0, 5, 17, 42, 99, 123, 250, 7, 64, 3]
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0]
    ours = engine.score(ids)
    assert (ours - theirs).abs().max().item() < 1e-4 * max(1.0, theirs.abs().max().item())
    # the CPU formats take the decoded values: int8 rows, and int4 requantizes the K-quant values
    # into Q4_0 rows (lossy: no kernel reads Q4_K yet; random codes with an offset, as here, are
    # its worst case: 0.956 measured)
    for fmt in ("int8", "int4"):
        with Engine.load(tmp_path / "imported", mode="dense", cpu_weights=fmt, ctx=64) as quantized:
            cos = torch.nn.functional.cosine_similarity(quantized.score(ids), theirs, dim=-1).min().item()
            assert cos > {"int8": 0.999, "int4": 0.9}[fmt], (fmt, cos)
