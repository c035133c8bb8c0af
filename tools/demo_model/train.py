"""Train Thermocline's demo model: a small ReLU Llama from scratch on Jane Austen's novels.

The FFN is Llama's gated one with `hidden_act="relu"`: act = relu(gate.x) * (up.x), so a
neuron is silent exactly when its gate pre-activation is <= 0. Plain ReLU training leaves
roughly half of them firing; to reach the >= 80 % sparsity that makes sparse inference pay,
we add a sparsity penalty on the gate (ProSparse-style), switched on after a warm-up and
steered by a feedback controller toward `--target-sparsity` instead of a hand-tuned ramp.
The penalty is the positive share of each layer's gate mass, mean(relu(g)) / mean(|g|), which
is scale-free: shrinking the gate weights (and growing `up` to compensate) cannot satisfy it,
only moving pre-activations below zero can.

Checkpoints are safetensors + JSON (no pickle) in `--work`; a rerun resumes from there.
`--max-chars` and `--steps` give the seconds-long mode the tests use.

    python -m tools.demo_model.train --corpus /tmp/austen --work /tmp/demo_work \\
        --out resources/demo --steps 6000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from .data import dialogue_pairs, encode_documents, read_paragraphs, sample_batch
from .tokenizer import BOS, EOS, PAD, save_tokenizer, train_tokenizer

SAMPLE_PROMPTS = (
    "It is a truth universally acknowledged",
    "Emma was not sorry to see",
    "User: What do you think of Mr. Darcy?\nAssistant:",
)


class RecordingReLU(torch.nn.Module):
    """ReLU that keeps its last input, for the sparsity penalty and the sparsity figure."""

    def __init__(self):
        super().__init__()
        self.last_input: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_input = x
        return torch.relu(x)


def build_model(args, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.ctx or args.seq_len,
        hidden_act="relu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    acts = []
    for layer in model.model.layers:
        layer.mlp.act_fn = RecordingReLU()
        acts.append(layer.mlp.act_fn)
    return model, acts


def sparsity_penalty(acts) -> tuple[torch.Tensor, float]:
    """Mean over layers of the positive share of gate mass, and the measured sparsity."""
    penalties, zeros, total = [], 0, 0
    for act in acts:
        g = act.last_input
        penalties.append(torch.relu(g).mean() / (g.abs().mean() + 1e-6))
        zeros += int((g <= 0).sum())
        total += g.numel()
    return torch.stack(penalties).mean(), zeros / total


def progress_of(state: dict, args) -> float:
    """Fraction of the run done: by steps, or by wall time when --max-minutes is the tighter
    limit, so the schedule completes on a machine busier than expected."""
    done = state["step"] / args.steps
    if args.max_minutes:
        done = max(done, state["elapsed_s"] / (args.max_minutes * 60))
    return min(1.0, done)


def lr_at(step: int, progress: float, args) -> float:
    """Linear warm-up, then cosine decay to a tenth of --lr at the end of the run."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, args):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )


# ---- checkpoints: safetensors for tensors, JSON for the rest -------------------------------

def save_checkpoint(work: Path, model, opt, state: dict) -> None:
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}  # tied to the embedding
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        n = names[id(p)]
        tensors[f"opt.exp_avg.{n}"] = s["exp_avg"]
        tensors[f"opt.exp_avg_sq.{n}"] = s["exp_avg_sq"]
        state.setdefault("opt_steps", {})[n] = float(s["step"])
    tmp = work / "checkpoint.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, work / "checkpoint.safetensors")
    (work / "checkpoint.json.tmp").write_text(json.dumps(state), encoding="utf-8")
    os.replace(work / "checkpoint.json.tmp", work / "checkpoint.json")


def load_checkpoint(work: Path, model, opt) -> dict | None:
    if not (work / "checkpoint.json").exists():
        return None
    state = json.loads((work / "checkpoint.json").read_text(encoding="utf-8"))
    tensors = load_file(str(work / "checkpoint.safetensors"))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")},
                          strict=False)
    model.tie_weights()
    for n, p in model.named_parameters():
        if f"opt.exp_avg.{n}" in tensors:
            opt.state[p] = {
                "step": torch.tensor(state["opt_steps"][n]),
                "exp_avg": tensors[f"opt.exp_avg.{n}"],
                "exp_avg_sq": tensors[f"opt.exp_avg_sq.{n}"],
            }
    return state


# ---- evaluation while training -------------------------------------------------------------

@torch.no_grad()
def heldout_loss(model, acts, stream: np.ndarray, seq_len: int, windows: int) -> tuple[float, float]:
    model.eval()
    n = min(windows, max(1, (len(stream) - 1) // seq_len))
    losses, sparsities = [], []
    for i in range(n):
        chunk = torch.from_numpy(stream[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64))
        logits = model(input_ids=chunk[None, :-1]).logits[0]
        losses.append(float(torch.nn.functional.cross_entropy(logits, chunk[1:])))
        sparsities.append(sparsity_penalty(acts)[1])
    model.train()
    return float(np.mean(losses)), float(np.mean(sparsities))


@torch.no_grad()
def samples(model, tok: Tokenizer, max_new_tokens: int, seed: int) -> list[str]:
    model.eval()
    out = []
    gen = torch.Generator().manual_seed(seed)
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt).ids
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids[-model.config.max_position_embeddings:]])).logits[0, -1]
            probs = torch.softmax(logits / 0.8, dim=-1)
            top = torch.topk(probs, 40)
            nxt = int(top.indices[torch.multinomial(top.values, 1, generator=gen)])
            if nxt == tok.token_to_id(EOS):
                break
            ids.append(nxt)
        out.append(tok.decode(ids))
    model.train()
    return out


# ---- export --------------------------------------------------------------------------------

def export(model, tok: Tokenizer, out: Path, args, summary: dict) -> None:
    """Write the model folder in Hugging Face layout (weights, tokenizer, configs)."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    final = copy.deepcopy(model)
    for layer in final.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    dtype = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    final = final.to(dtype)
    final.config.dtype = dtype
    final.save_pretrained(str(out), safe_serialization=True)
    gen = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
           "pad_token_id": tok.token_to_id(PAD), "do_sample": True, "temperature": 0.7,
           "top_k": 40, "max_new_tokens": 128}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    save_tokenizer(tok, out, model_max_length=final.config.max_position_embeddings)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n",
                                               encoding="utf-8")


# ---- main ----------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train the demo ReLU Llama model.")
    p.add_argument("--corpus", type=Path, required=True, help="folder with train.txt, heldout.txt")
    p.add_argument("--work", type=Path, required=True, help="checkpoints, token cache, log")
    p.add_argument("--out", type=Path, required=True, help="exported model folder")
    p.add_argument("--max-chars", type=int, default=None, help="use only this much text (tests)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ctx", type=int, default=None,
                   help="context length in config.json (default --seq-len: RoPE positions past the "
                        "trained windows measure far worse perplexity)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--target-sparsity", type=float, default=0.88)
    p.add_argument("--sparsity-start", type=float, default=0.15,
                   help="fraction of the run before the sparsity penalty starts")
    p.add_argument("--penalty-init", type=float, default=0.01)
    p.add_argument("--penalty-max", type=float, default=5.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-time budget: the schedule ends and the model is exported by then")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float16", "float32", "bfloat16"), default="float16")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def log(work: Path, msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    with open(work / "train.log", "a", encoding="utf-8") as f:
        f.write(line + "\n")


def prepare_data(args) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """Tokenizer and token streams, built once and cached in --work."""
    tok_path = args.work / "tokenizer.json"
    train_cache, held_cache = args.work / "train_tokens.npy", args.work / "heldout_tokens.npy"
    paras = read_paragraphs(args.corpus / "train.txt", args.max_chars)
    held = read_paragraphs(args.corpus / "heldout.txt", args.max_chars)
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer(paras, args.vocab_size)
        tok.save(str(tok_path))
    if not train_cache.exists():
        docs = paras + dialogue_pairs(paras)
        np.random.default_rng(args.seed).shuffle(docs)
        np.save(train_cache, encode_documents(tok, docs))
        np.save(held_cache, encode_documents(tok, held))
    # np.load of .npy without allow_pickle: plain arrays only.
    return tok, np.load(train_cache), np.load(held_cache)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    tok, train_stream, held_stream = prepare_data(args)
    model, acts = build_model(args, tok.get_vocab_size())
    opt = make_optimizer(model, args)
    state = load_checkpoint(args.work, model, opt) or {
        "step": 0, "penalty": args.penalty_init, "sparsity_ema": 0.0, "elapsed_s": 0.0}
    n_params = sum(p.numel() for p in model.parameters())
    log(args.work, f"params {n_params/1e6:.2f}M, train tokens {len(train_stream)}, "
                   f"heldout tokens {len(held_stream)}, resuming at step {state['step']}")
    model.train()
    t0, t_last = time.time(), time.time()
    elapsed0 = state["elapsed_s"]
    while state["step"] < args.steps:
        step = state["step"]
        progress = progress_of(state, args)
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng(args.seed * 1_000_003 + step)  # resumable data order
        batch = torch.from_numpy(sample_batch(train_stream, args.batch, args.seq_len, rng))
        logits = model(input_ids=batch[:, :-1]).logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               batch[:, 1:].reshape(-1))
        penalty, sparsity = sparsity_penalty(acts)
        use_penalty = progress >= args.sparsity_start
        loss = ce + (state["penalty"] * penalty if use_penalty else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["sparsity_ema"] = 0.9 * state["sparsity_ema"] + 0.1 * sparsity
        if use_penalty:  # feedback: push harder while below target, ease off above it
            factor = 1.02 if state["sparsity_ema"] < args.target_sparsity else 0.98
            state["penalty"] = float(min(args.penalty_max, state["penalty"] * factor))
        state["step"] = step + 1
        state["elapsed_s"] = elapsed0 + time.time() - t0
        if state["step"] % 10 == 0 or state["step"] == args.steps:
            dt = time.time() - t_last
            t_last = time.time()
            log(args.work, f"step {state['step']}/{args.steps} ce {ce.item():.3f} "
                           f"sparsity {sparsity:.3f} penalty_w {state['penalty']:.3f} "
                           f"lr {lr:.2e} ({dt:.1f}s/10 steps)")
        if state["step"] % args.eval_every == 0 or state["step"] == args.steps:
            loss_h, sp_h = heldout_loss(model, acts, held_stream, args.seq_len, windows=16)
            state["heldout_loss"], state["heldout_sparsity"] = loss_h, sp_h
            log(args.work, f"eval step {state['step']}: heldout ppl {math.exp(loss_h):.2f} "
                           f"sparsity {sp_h:.3f}")
            for text in samples(model, tok, 48, seed=state["step"]):
                log(args.work, "sample: " + text.replace("\n", "\\n"))
        if state["step"] % args.checkpoint_every == 0:
            save_checkpoint(args.work, model, opt, state)
        if progress_of(state, args) >= 1.0 and state["step"] < args.steps:
            log(args.work, f"time limit reached at step {state['step']}")
            break
    save_checkpoint(args.work, model, opt, state)
    loss_h, sp_h = heldout_loss(model, acts, held_stream, args.seq_len, windows=32)
    summary = {"steps": state["step"], "params": n_params, "heldout_ppl": math.exp(loss_h),
               "heldout_gate_sparsity": sp_h, "train_seconds": state["elapsed_s"],
               "train_tokens_seen": state["step"] * args.batch * args.seq_len,
               "config": {k: v for k, v in vars(args).items() if not isinstance(v, Path)}}
    export(model, tok, args.out, args, summary)
    log(args.work, f"exported to {args.out}: {json.dumps(summary)}")
    return summary


if __name__ == "__main__":
    main()
