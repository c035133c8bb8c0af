"""Dense decode speed: our engine against `transformers` generate, same model, same process.

A random-weight ReLU Llama of ~130M parameters, fp32 on the CPU, the same thread count
for both. Prefill and decode tok/s are medians over interleaved repeats; the last line
is one JSON object (`ours_tok_s`, `transformers_tok_s`, `speedup`, ...).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import emit


def build_model(root: Path, hidden: int, layers: int, ff: int, vocab: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import model_factory

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=vocab,
                      hidden_act="relu", max_position_embeddings=2048, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(root, safe_serialization=True)
    model_factory.build_tokenizer(root)
    return root


def time_ours(engine, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    from engine import SamplingParams

    engine.reset()
    engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0))
    stats = engine.last_stats
    assert stats.new_tokens == new_tokens
    return stats.prefill_tok_s, stats.decode_tok_s


def time_transformers(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=2)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return len(prompt) / first, (new_tokens - 1) / max(total - first, 1e-9)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ff", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from engine import Engine

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args.hidden, args.layers, args.ff, args.vocab)
        ours = Engine.load(path, ctx=args.prompt_tokens + args.new_tokens + 8)
        ours.eos_ids = set()
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        params = sum(p.numel() for p in theirs.parameters())
        prompt = [0] + [int(t) for t in torch.randint(3, args.vocab, (args.prompt_tokens - 1,))]
        time_ours(ours, prompt, 4)  # warm-up both
        time_transformers(theirs, prompt, 4)
        runs = {"ours": [], "transformers": []}
        for _ in range(args.repeats):
            runs["ours"].append(time_ours(ours, prompt, args.new_tokens))
            runs["transformers"].append(time_transformers(theirs, prompt, args.new_tokens))

    def median(name: str, index: int) -> float:
        return statistics.median(r[index] for r in runs[name])

    weight_bytes = params * 4
    result = {
        "model_params": params,
        "dtype": "float32",
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "ours_prefill_tok_s": round(median("ours", 0), 1),
        "transformers_prefill_tok_s": round(median("transformers", 0), 1),
        "ours_tok_s": round(median("ours", 1), 2),
        "transformers_tok_s": round(median("transformers", 1), 2),
        "speedup": round(median("ours", 1) / median("transformers", 1), 3),
        "prefill_speedup": round(median("ours", 0) / median("transformers", 0), 3),
        # gpt-fast's honesty: the bandwidth each decode speed implies (weights read once per token).
        "ours_implied_gbps": round(weight_bytes * median("ours", 1) / 1e9, 2),
        "transformers_implied_gbps": round(weight_bytes * median("transformers", 1) / 1e9, 2),
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
