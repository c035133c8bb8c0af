"""The recommended first model end to end, against the local Hub: a repo with MiniCPM-S-1B-sft's
file layout (config keys as published, sizes shrunk; pytorch_model.bin only, as on its main
branch; no chat_template) and its PowerInfer GGUF repo download to a model that chats in
sparse mode, with predictors read out of the GGUF and no manual step."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from app.cli import main
from gguf_factory import powerinfer_gguf
from hub_server import HubRepo, local_hub, registry_env  # noqa: F401
from model_factory import build_tokenizer
from real_config_models import REAL_CONFIGS

PUBLISHED = REAL_CONFIGS / "minicpm-s-1b-sft" / "config.json"
# Sizes shrunk, ratios kept: heads/kv 3, hidden/dim_model_base 6, ffn/hidden 2.5.
SHRUNK = {"hidden_size": 96, "intermediate_size": 240, "num_hidden_layers": 2, "num_attention_heads": 6,
          "num_key_value_heads": 2, "vocab_size": 300, "dim_model_base": 16, "max_position_embeddings": 256}


def _minicpm_repo(out: Path) -> dict[str, bytes]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads(PUBLISHED.read_text())
    assert "model_type" not in config and config["architectures"] == ["MiniCPMForCausalLM"]
    config.update(SHRUNK)
    out.mkdir(parents=True)
    build_tokenizer(out, vocab_size=300)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    del tok_config["chat_template"]  # as far as we know the repo has none: the catalogue's format applies
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(out / "tokenizer.json"))
    config.update(bos_token_id=ids.token_to_id("<s>"), eos_token_id=ids.token_to_id("</s>"))
    (out / "config.json").write_text(json.dumps(config, indent=4))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": config["bos_token_id"],
                                                             "eos_token_id": config["eos_token_id"]}))
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        hidden_size=96, intermediate_size=240, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=300, tie_word_embeddings=True, hidden_act="relu"))
    state = {k: v.to(torch.bfloat16).clone() for k, v in llama.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, out / "pytorch_model.bin")  # main branch: a pickle only, no lm_head (tied)
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def _generate(model: str, mode: str, capsys, chat: bool = True) -> dict:
    argv = ["generate", "--model", model, "--prompt", "the quick fox", "--temperature", "0",
            "--max-new-tokens", "8", "--mode", mode, "--cpu-weights", "fp32", "--json"] + (["--chat"] if chat else [])
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_minicpm_s_1b_downloads_with_gguf_predictors_and_chats_in_sparse_mode(local_hub, registry_env, tmp_path,
                                                                                capsys):
    files = _minicpm_repo(tmp_path / "minicpm")
    local_hub.add_repo(HubRepo("openbmb/MiniCPM-S-1B-sft", files))
    gguf_path = tmp_path / "MiniCPM-S-1B-sft.gguf"
    # A threshold far below any logit: every neuron predicted active, so sparse mode must give
    # exactly the dense tokens; the predictors' values are checked against the file below.
    expected = powerinfer_gguf(gguf_path, layers=2, d=96, n_ff=240, rank=8, threshold=-1e30, tokens=3000,
                              vocab=6000)  # dense tensors: a file well past the first header read
    local_hub.add_repo(HubRepo("openbmb/MiniCPM-S-1B-sft-gguf", {gguf_path.name: gguf_path.read_bytes()}))
    capsys.readouterr()

    assert main(["models", "download", "minicpm-s-1b", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    model_dir = Path(result["model_dir"])
    assert result["predictors"] == "imported", err
    assert not list(model_dir.glob("*.bin")) and (model_dir / "model.safetensors").is_file()
    assert not (model_dir / "thermocline" / "gguf-predictor").exists()
    ranged = local_hub.requests("GET", gguf_path.name)
    assert ranged and all(r["range"] for r in ranged)
    assert sum(r.get("sent", 0) for r in ranged) < gguf_path.stat().st_size

    from engine.loading.predictors import PredictorSet

    predictors = PredictorSet.load(model_dir, 2, 96, 240)
    for i in range(2):
        assert torch.equal(predictors.fc1[i], torch.from_numpy(expected[f"layers.{i}.fc1.weight"]).float())
        assert torch.equal(predictors.fc2[i], torch.from_numpy(expected[f"layers.{i}.fc2.weight"]))

    dense = _generate("minicpm-s-1b", "dense", capsys)
    sparse = _generate("minicpm-s-1b", "sparse", capsys)
    assert sparse["mode"] == "sparse" and sparse["new_tokens"] > 0
    assert sparse["token_ids"] == dense["token_ids"]
    from engine.runtime.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    assert tok.chat_format == "minicpm" and tok.is_chat_model is True
    framed = tok.encode("<s><用户>the quick fox<AI>", add_special_tokens=False)
    assert sparse["prompt_tokens"] == len(framed)

    listing = json.loads((main(["models", "list", "--json"]), capsys.readouterr().out)[1])
    first = listing["models"][0]
    assert first["id"] == "minicpm-s-1b" and first["status"] == "ready" and first["predictors"] == "imported"
