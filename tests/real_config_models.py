"""Tiny random models with the exact keys of the published configs (tests/data/real_configs),
sizes shrunk, saved under the tensor names each family publishes, with a reference
`transformers` model computing what the family's own code computes.

Each builder returns (model folder, reference model, facts) where the reference is fp32,
in eval mode, and has the family's quirks applied (FATReLU, dReLU, muP scales folded into
its weights, TurboSparse's predictor mask).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from model_factory import WORDS, build_tokenizer

# The published config files with the notes of where each was read (SOURCE), kept in the repository
# so a fresh clone's suite builds its models from them.
REAL_CONFIGS = Path(__file__).resolve().parent / "data" / "real_configs"

# Sizes of the tiny models; every other key keeps the published value.
TINY = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4}


def real_config(name: str) -> dict:
    return json.loads((REAL_CONFIGS / name / "config.json").read_text(encoding="utf-8"))


def shrink(config: dict, vocab: int) -> dict:
    """The published config with tiny sizes (the same keys; GQA kept where it was)."""
    out = dict(config)
    out.update(TINY, vocab_size=vocab)
    if "num_key_value_heads" in config:
        grouped = config["num_key_value_heads"] != config["num_attention_heads"]
        out["num_key_value_heads"] = 2 if grouped else 4
    return out


class FatRelu(torch.nn.Module):
    """FATReLU as ProSparse/MiniCPM-S define it: values below the threshold become 0."""

    def __init__(self, threshold: float):
        super().__init__()
        self.threshold = threshold

    def forward(self, x):
        return torch.where(x >= self.threshold, x, torch.zeros_like(x))


def build_sentencepiece(out: Path) -> int:
    """A tiny sentencepiece model (unk 0, <s> 1, </s> 2 as Llama's) -> its piece count."""
    import sentencepiece as spm

    model = io.BytesIO()
    sentences = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor()
    processor.Load(str(out / "tokenizer.model"))
    return processor.GetPieceSize()


def _llama_reference(config: dict, seed: int, tie: bool = False):
    """A transformers Llama with the tiny config's numbers (ReLU until patched)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"], num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"], vocab_size=config["vocab_size"], hidden_act="relu",
        max_position_embeddings=config["max_position_embeddings"], rms_norm_eps=config["rms_norm_eps"],
        rope_theta=float(config.get("rope_theta", 10000.0)), tie_word_embeddings=tie,
        initializer_range=config.get("initializer_range", 0.02), bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


def _mistral_reference(config: dict, seed: int):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"], num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"], vocab_size=config["vocab_size"], hidden_act="relu",
        max_position_embeddings=config["max_position_embeddings"], rms_norm_eps=config["rms_norm_eps"],
        rope_theta=float(config.get("rope_theta", 10000.0)), sliding_window=config.get("sliding_window"),
        initializer_range=config.get("initializer_range", 0.02), bos_token_id=1, eos_token_id=2,
    )
    return MistralForCausalLM(cfg).eval()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
            if "rotary_emb" not in k}


def _write(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def relullama(out: Path, seed: int = 10):
    """ReluLLaMA-7B's config: transformers' Llama runs it as published."""
    config = shrink(real_config("relullama-7b"), vocab=300)
    ref = _llama_reference(config, seed)
    _write(out, config, _state(ref))
    build_tokenizer(out, vocab_size=300)
    return out, ref, config


def prosparse(out: Path, seed: int = 11):
    """ProSparse-Llama-2-7B (`sparsellama`, fatrelu + hidden_act_param): Llama with FATReLU."""
    config = shrink(real_config("prosparse-llama-2-7b"), vocab=300)
    ref = _llama_reference(config, seed)
    state = _state(ref)
    for layer in ref.model.layers:
        layer.mlp.act_fn = FatRelu(config["hidden_act_param"])
    _write(out, config, state)
    build_tokenizer(out, vocab_size=300)
    return out, ref, config


def minicpm(out: Path, seed: int = 12):
    """MiniCPM-S-1B-sft (no model_type, fatrelu 0.03, muP scales, tied head): our checkpoint
    has the published tensors (no lm_head.weight); the reference is a transformers Llama
    with the scales folded into its weights."""
    config = shrink(real_config("minicpm-s-1b-sft"), vocab=300)
    base = _llama_reference(config, seed)
    state = _state(base)
    del state["lm_head.weight"]  # the published checkpoint ties the head to the embeddings
    _write(out, config, state)
    build_tokenizer(out, vocab_size=300)

    residual = config["scale_depth"] / math.sqrt(config["num_hidden_layers"])
    logit = config["dim_model_base"] / config["hidden_size"]
    folded = dict(state)
    folded["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * config["scale_emb"]
    folded["lm_head.weight"] = state["model.embed_tokens.weight"] * logit
    for i in range(config["num_hidden_layers"]):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            key = f"model.layers.{i}.{name}"
            folded[key] = state[key] * residual
    ref = _llama_reference(config, seed)
    ref.load_state_dict(folded, strict=False)
    for layer in ref.model.layers:
        layer.mlp.act_fn = FatRelu(config["hidden_act_param"])
    return out, ref, config


def _drelu(model) -> None:
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = (lambda m: lambda x: m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x))))(mlp)


def bamboo(out: Path, seed: int = 13):
    """Bamboo-base (`bamboo`, dReLU, sliding window, 32768 positions) with only a
    sentencepiece `tokenizer.model` and its special_tokens_map.json."""
    out.mkdir(parents=True, exist_ok=True)
    pieces = build_sentencepiece(out)
    (out / "special_tokens_map.json").write_text(
        (REAL_CONFIGS / "bamboo-base" / "special_tokens_map.json").read_text(encoding="utf-8"), encoding="utf-8")
    config = shrink(real_config("bamboo-base"), vocab=pieces)
    ref = _mistral_reference(config, seed)
    _write(out, config, _state(ref))
    _drelu(ref)
    return out, ref, config


def turbosparse(out: Path, seed: int = 14, rank: int = 12, padding: int = 62):
    """TurboSparse-Mistral: Bamboo's layout with predictors in the checkpoint
    (`mlp.predictor.fc1/fc2`), ChatML tokens added to a sentencepiece model, and a config
    vocabulary `padding` rows past the tokenizer's (32064 vs 32002 published). The padded
    head rows are made to win every argmax, so a sampler that reads them shows.

    The reference masks each FFN neuron with the predictor, as the published code does:
    relu(gate) * relu(up) * [fc2(relu(fc1(x_before_norm))) > 0]."""
    out.mkdir(parents=True, exist_ok=True)
    pieces = build_sentencepiece(out)
    (out / "added_tokens.json").write_text(json.dumps({"<|im_end|>": pieces, "<|im_start|>": pieces + 1}))
    (out / "special_tokens_map.json").write_text(
        (REAL_CONFIGS / "turbosparse-mistral" / "special_tokens_map.json").read_text(encoding="utf-8"),
        encoding="utf-8")
    config = shrink(real_config("turbosparse-mistral"), vocab=pieces + 2 + padding)
    ref = _mistral_reference(config, seed)
    with torch.no_grad():  # padded rows +-50x copies of real ones: one of them tops every argmax
        head, real = ref.lm_head.weight, pieces + 2
        rows = head[: padding // 2] * 50
        head[real : real + padding // 2], head[real + padding // 2 : real + 2 * (padding // 2)] = rows, -rows
    state = _state(ref)
    g = torch.Generator().manual_seed(seed)
    d, n = config["hidden_size"], config["intermediate_size"]
    predictors = []
    for i in range(config["num_hidden_layers"]):
        fc1, fc2 = torch.randn(rank, d, generator=g) * 0.3, torch.randn(n, rank, generator=g) * 0.3
        state[f"model.layers.{i}.mlp.predictor.fc1.weight"] = fc1
        state[f"model.layers.{i}.mlp.predictor.fc2.weight"] = fc2
        predictors.append((fc1, fc2))
    _write(out, config, state)

    mask = {"on": True}  # the published model always masks; off: plain dReLU (our dense mode)
    for layer, (fc1, fc2) in zip(ref.model.layers, predictors):
        seen = {}
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, args, seen=seen: seen.update(x=args[0]))
        mlp = layer.mlp

        def forward(x, m=mlp, seen=seen, fc1=fc1, fc2=fc2):
            fires = (torch.relu(seen["x"] @ fc1.T) @ fc2.T) > 0 if mask["on"] else 1.0
            return m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x)) * fires)

        mlp.forward = forward
    return out, ref, {**config, "tokenizer_vocab": pieces + 2, "predictors": predictors, "mask": mask}
