"""SmallThinker decode: Thermocline's expert tiers against llama.cpp on the same weights, one run.

One random model with SmallThinker-4BA0.6B's layer shapes (bench.moe_decode's checkpoint:
d 1536, 12 query / 2 KV heads of 128, 32 ReGLU experts of 768 neurons, 4 chosen per
token; layers and vocabulary cut for time) is written as an HF folder (bf16 safetensors,
the engine's input) and as a GGUF of llama.cpp's `smallthinker` architecture (f16, through
the `gguf` package: the experts stacked into `ffn_{gate,up,down}_exps`, the router as
`ffn_gate_inp`, sigmoid gating, tied head), which llama-cpp-python quantizes to Q8_0 and
Q4_0. bf16 values are exact in f16, so both engines read the same weights.

llama.cpp runs the chosen experts densely (every row of the 4 experts), which is the
peer the issue names: "llama.cpp dense on the same weights". Ours runs `sparse` mode
(everything on the CPU tier; inside a chosen expert the up and down rows of neurons whose
relu(gate) is 0 are not read) with int8 rows (against Q8_0) and 4-bit Q4_0 rows (against
Q4_0); `dense:f16` pairs our dense fp32 mode with llama.cpp's f16; `int8+prefetch:Q8_0`
runs ours with the pre-attention prefetch of cold experts (engine.moe_tiers.ColdPrefetcher)
forced on, to measure what it buys on this CPU. Both engines decode the
same forced token sequence one token at a time (forward + argmax; see `forced_tokens`),
and the share of steps whose argmax agrees is reported as a numerics check. Each
measurement is its own process with the same threads; the engines alternate for
`--repeats` rounds, and each figure is the median. The gates fire about 20% of a chosen
expert's neurons, as trained ReGLU experts do (bench.moe_decode.build_checkpoint says how).
Needs the `bench` extra. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import add_placeholder_vocab, emit, llama_cpp_missing, peak_rss

PROMPT = [1] + list(range(260, 275))  # ids that are ordinary pieces in both vocabularies


# ----------------------------------------------------------------------- model files
def write_gguf(path: Path, hf: Path, cfg: dict) -> None:
    """The HF folder's weights as an f16 GGUF of llama.cpp's smallthinker architecture."""
    import gguf
    import torch
    from safetensors.torch import load_file

    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    w = gguf.GGUFWriter(str(path), "smallthinker")
    w.add_name("thermocline-moe-bench")
    w.add_context_length(4096)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["moe_ffn_hidden_size"])
    w.add_expert_feed_forward_length(cfg["moe_ffn_hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["moe_num_primary_experts"])
    w.add_expert_used_count(cfg["moe_num_active_primary_experts"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_placeholder_vocab(w, vocab)

    def add(name, t):
        arr = t.float().numpy() if t.dim() == 1 else t.to(torch.float16).numpy()
        w.add_tensor(name, arr)  # norms in f32

    attn = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm", "block_sparse_moe.primary_router": "ffn_gate_inp"}
    for shard in sorted(hf.glob("model-*.safetensors")):
        t = load_file(str(shard))
        if "model.embed_tokens.weight" in t:
            add("token_embd.weight", t["model.embed_tokens.weight"])
            add("output_norm.weight", t["model.norm.weight"])
        for i in sorted({int(k.split(".")[2]) for k in t if k.startswith("model.layers.")}):
            p = f"model.layers.{i}."
            for hf_name, gg in attn.items():
                add(f"blk.{i}.{gg}.weight", t[p + hf_name + ".weight"])
            for part in ("gate", "up", "down"):  # [E, rows, cols], as llama.cpp's converter stacks them
                stacked = torch.stack([t[p + f"block_sparse_moe.experts.{e}.{part}.weight"]
                                       for e in range(cfg["moe_num_primary_experts"])])
                add(f"blk.{i}.ffn_{part}_exps.weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(workdir: Path, layers: int, vocab: int, seed: int, smoke: bool, quantize: bool) -> tuple[dict, dict]:
    """The model files (reused when workdir already holds them for the same settings); the
    quantized GGUFs only with `quantize` (llama.cpp quantizes them)."""
    from bench.moe_decode import build_checkpoint
    from bench.vs_llamacpp import quantize_gguf

    stamp = {"layers": layers, "vocab": vocab, "seed": seed, "smoke": smoke, "version": 1}
    marker = workdir / "stamp.json"
    files = {"hf": workdir / "hf", "f16": workdir / "model-f16.gguf"}
    if quantize:
        files.update({"Q8_0": workdir / "model-q8_0.gguf", "Q4_0": workdir / "model-q4_0.gguf"})
    if marker.exists() and json.loads(marker.read_text()) == stamp and all(p.exists() for p in files.values()):
        return files, json.loads((files["hf"] / "config.json").read_text())
    workdir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    _, cfg = build_checkpoint(files["hf"], layers, vocab, seed, smoke)
    write_gguf(files["f16"], files["hf"], cfg)
    for kind in ("Q8_0", "Q4_0") if quantize else ():
        quantize_gguf(files["f16"], files[kind], kind)
    marker.write_text(json.dumps(stamp))
    return files, cfg


# ----------------------------------------------------------------------- workers
def forced_tokens(count: int, vocab: int, seed: int) -> list[int]:
    """The decode inputs, the same for both engines: random ordinary pieces. (These random
    weights' tied head mostly repeats the last token; fed back greedily, one token would
    choose the same experts at every step and keep them in cache. Forcing varied tokens
    makes the router choose as it would over real text.)"""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(259, vocab, size=count)]


def worker_llama(path: Path, threads: int, tokens: int, seed: int) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    load = {"load_s": time.perf_counter() - t0, "load_peak_rss": peak_rss()}
    vocab = llm.n_vocab()

    def last_logits():  # llama-cpp-python keeps no scores without logits_all: read the context's
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    llm.eval(PROMPT[:4])  # warm-up: first touch of the mapped weights

    def prefill() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(PROMPT)
        last_logits()
        return time.perf_counter() - t

    load["ttft_s"] = min(prefill() for _ in range(2))
    llm.reset()
    llm.eval(PROMPT)
    top = [int(np.argmax(last_logits()))]
    forced = forced_tokens(tokens, vocab, seed)
    t = time.perf_counter()
    for tok in forced:
        llm.eval([tok])
        top.append(int(np.argmax(last_logits())))
    return {"decode_tok_s": tokens / (time.perf_counter() - t), "top": top, **load}




def fused_ab(model, cache, sparse, start: int, tokens: list[int], block: int = 4) -> dict:
    """The same process and minute, the fused decode (one compiled call per layer) against the
    unfused path (THERMOCLINE_FUSED_DECODE=0), alternating in blocks of `block` tokens: median
    ms per token of each."""
    import torch

    from engine.runtime import fused_decode

    times: dict[str, list[float]] = {"fused": [], "unfused": []}
    before = os.environ.get(fused_decode.FUSED_ENV)
    try:
        for b in range(0, len(tokens), block):
            side = "fused" if (b // block) % 2 == 0 else "unfused"
            os.environ[fused_decode.FUSED_ENV] = "1" if side == "fused" else "0"
            for i, tok in enumerate(tokens[b:b + block], start=start + b):
                sparse.at_token_boundary()
                t = time.perf_counter()
                model.forward(torch.tensor([tok]), i, cache)
                times[side].append(time.perf_counter() - t)
    finally:
        if before is None:
            os.environ.pop(fused_decode.FUSED_ENV, None)
        else:
            os.environ[fused_decode.FUSED_ENV] = before
    fused = sum(layer.fused is not None and layer.fused.moe is not None for layer in model.layers)
    return {"fused_ms_per_token": 1e3 * statistics.median(times["fused"]),
            "unfused_ms_per_token": 1e3 * statistics.median(times["unfused"]), "fused_moe_layers": fused}


def worker_ours(root: Path, cpu_weights: str, threads: int, tokens: int, seed: int, ab_tokens: int = 0) -> dict:
    """The engine's decode step (engine.Engine._generate's loop body) over the forced tokens."""
    import torch

    from engine import Engine, SamplingParams
    from engine.runtime import fused_decode

    torch.set_num_threads(threads)
    cpu_weights, _, option = cpu_weights.partition("+")
    kwargs = {} if cpu_weights == "dense" else {"mode": "sparse", "cpu_weights": cpu_weights}
    t0 = time.perf_counter()
    engine = Engine.load(root, ctx=256, threads=threads, **kwargs)
    # a second load where the model was prepared before (main runs one untimed load first)
    load = {"load_s": time.perf_counter() - t0, "load_peak_rss": peak_rss(),
            "placed_ram": engine.memory()["ram_bytes"] if engine.sparse is not None else None,
            "prepared": getattr(engine.sparse, "prepared_experts", None) is not None}
    if engine.sparse is not None:  # "+prefetch": read the chosen cold experts while attention runs
        engine.sparse.set_prefetch(option == "prefetch")
    engine.eos_ids = set()
    engine.generate(PROMPT[:4], SamplingParams(max_new_tokens=2, temperature=0))  # warm-up: kernels compiled
    fused_decode.wait_compiled_behind()  # and the mixture's layer calls, where numba's cache lacked them

    def prefill() -> float:  # time to first token: the prompt's prefill and its first token
        engine.reset()
        engine.generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0))
        return engine.last_stats.ttft_s

    load["ttft_s"] = min(prefill() for _ in range(2))
    engine.reset()
    sparse, model, cache = engine.sparse, engine.model, engine.cache
    if sparse is not None:
        sparse.begin_generation()
    logits = model.forward(torch.tensor(PROMPT), 0, cache)
    top = [int(torch.argmax(logits[-1]))]
    forced = forced_tokens(tokens, engine.config.vocab_size, seed)
    t = time.perf_counter()
    for i, tok in enumerate(forced):
        if sparse is not None:
            sparse.at_token_boundary()
        logits = model.forward(torch.tensor([tok]), len(PROMPT) + i, cache)
        top.append(int(torch.argmax(logits[-1])))
    out = {"decode_tok_s": tokens / (time.perf_counter() - t), "top": top, **load}
    if sparse is not None:
        c = sparse.counters
        steps = c.experts_chosen // (engine.config.experts_per_token * engine.config.num_layers)
        out["expert_MB_per_token"] = c.expert_bytes / steps / 1e6
        out["fired_share_in_chosen"] = c.computed / (steps * engine.config.num_layers
                                                     * engine.config.experts_per_token
                                                     * engine.config.intermediate_size)
        out["prefetched_MB_per_token"] = c.prefetched_bytes / steps / 1e6
        out["prefetch_wait_ms_per_token"] = 1e3 * c.prefetch_wait_s / steps
        if ab_tokens:
            more = forced_tokens(ab_tokens, engine.config.vocab_size, seed + 1)
            out.update(fused_ab(model, cache, sparse, len(PROMPT) + len(forced), more))
    return out


def spawn(args: list[str]) -> dict:
    from bench.vs_llamacpp import worker_env

    out = subprocess.run([sys.executable, "-m", "bench.moe_vs_llamacpp", *args], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, env=worker_env())
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def expert_bytes(cfg: dict, fmt: str) -> int:
    """Bytes of one whole expert (3 x n rows of d) in a row format."""
    from engine.hotcold.placement import cpu_matrix_bytes

    rows, d = 3 * cfg["moe_ffn_hidden_size"], cfg["hidden_size"]
    return cpu_matrix_bytes(rows * d, rows, fmt)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, required=False, help="keep the model files here between runs")
    parser.add_argument("--pairs", default="int8:Q8_0,int4:Q4_0,dense:f16",
                        help="ours:theirs pairs; ours is a CPU weight format (or dense), theirs a GGUF kind")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the benchmark runs (CI)")
    parser.add_argument("--fused-ab", type=int, default=0, metavar="N",
                        help="after the timed decode, N more tokens alternating fused and unfused decode (ours)")
    args = parser.parse_args(argv)
    if args.worker:
        kind, _, fmt = args.worker.partition(":")
        if kind == "prepare":  # the untimed first load, which writes the prepared files
            from engine import Engine

            fmt = fmt.partition("+")[0]
            Engine.load(args.path, ctx=256, threads=args.threads,
                        **({} if fmt == "dense" else {"mode": "sparse", "cpu_weights": fmt}))
            print(json.dumps({}))
            return 0
        if kind == "llama":
            out = worker_llama(args.path, args.threads, args.tokens, args.seed)
        else:
            out = worker_ours(args.path, fmt, args.threads, args.tokens, args.seed, args.fused_ab)
        print(json.dumps(out))
        return 0

    import tempfile

    if args.smoke:
        args.layers, args.vocab, args.tokens, args.repeats = 2, 512, 3, 1
    llama_skipped = llama_cpp_missing()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="moe_vs_llamacpp_"))
    t0 = time.perf_counter()
    files, cfg = build(workdir, args.layers, args.vocab, args.seed, args.smoke, quantize=llama_skipped is None)
    build_s = time.perf_counter() - t0
    pairs = [p.split(":") for p in args.pairs.split(",")]
    if args.smoke:
        args.fused_ab = args.fused_ab and 8
    common = ["--threads", str(args.threads), "--tokens", str(args.tokens), "--seed", str(args.seed),
              "--fused-ab", str(args.fused_ab)]
    runs: dict[str, list[dict]] = {}
    for ours in sorted({p[0].partition("+")[0] for p in pairs} - {"dense"}):
        spawn(["--worker", f"prepare:{ours}", "--path", str(files["hf"]), *common])
    load_before = os.getloadavg()
    for _ in range(args.repeats):  # alternate, so load changes hit both engines alike
        for ours, theirs in pairs:
            runs.setdefault(f"ours_{ours}", []).append(
                spawn(["--worker", f"ours:{ours}", "--path", str(files["hf"]), *common]))
            if llama_skipped is None:
                runs.setdefault(f"llama_{theirs}", []).append(
                    spawn(["--worker", "llama", "--path", str(files[theirs]), *common]))

    def med(name, key="decode_tok_s"):
        return statistics.median(r[key] for r in runs[name])

    k, layers = cfg["moe_num_active_primary_experts"], args.layers
    result = {
        "shape": f"SmallThinker-4BA0.6B layers x {layers}, vocab {args.vocab} (random weights)",
        "threads": args.threads, "decode_tokens": args.tokens, "repeats": args.repeats,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "build_s": round(build_s, 1),
        "llama_cpp_skipped": llama_skipped,
        "decode_tok_s": {name: round(med(name), 2) for name in runs},
        "runs_tok_s": {name: [round(r["decode_tok_s"], 2) for r in rs] for name, rs in runs.items()},
    }
    for ours, theirs in pairs:
        a, b = f"ours_{ours}", f"llama_{theirs}"
        if llama_skipped is None:
            result[f"speedup_{ours}_vs_{theirs}"] = round(med(a) / med(b), 3)
        if ours != "dense":
            whole = layers * k * expert_bytes(cfg, ours.partition("+")[0])
            read = med(a, "expert_MB_per_token") * 1e6
            result[f"{ours}_expert_MB_per_token"] = round(read / 1e6, 3)
            result[f"{ours}_chosen_experts_whole_MB"] = round(whole / 1e6, 3)
            result[f"{ours}_second_level_saving"] = round(1 - read / whole, 4)
            result[f"{ours}_fired_share_in_chosen"] = round(med(a, "fired_share_in_chosen"), 4)
            if args.fused_ab:
                for key in ("fused_ms_per_token", "unfused_ms_per_token"):
                    result[f"{ours}_{key}"] = round(med(a, key), 3)
                result[f"{ours}_fused_speedup_in_process"] = round(med(a, "unfused_ms_per_token")
                                                                   / med(a, "fused_ms_per_token"), 3)
                result[f"{ours}_fused_moe_layers"] = runs[a][0]["fused_moe_layers"]
            if ours.endswith("+prefetch"):
                result[f"{ours}_prefetched_MB_per_token"] = round(med(a, "prefetched_MB_per_token"), 3)
                result[f"{ours}_prefetch_wait_ms_per_token"] = round(med(a, "prefetch_wait_ms_per_token"), 3)
        if ours != "dense":  # the second load (prepared files mapped), its memory, time to first token
            result[f"{ours}_load_s"] = round(med(a, "load_s"), 3)
            result[f"{ours}_prepared"] = all(r["prepared"] for r in runs[a])
            result[f"{ours}_load_rss_over_placed"] = round(med(a, "load_peak_rss") / runs[a][0]["placed_ram"], 3)
            result[f"{ours}_placed_MB"] = round(runs[a][0]["placed_ram"] / 1e6, 1)
            result[f"{ours}_ttft_s"] = round(med(a, "ttft_s"), 4)
        if llama_skipped is not None:
            continue
        if ours != "dense":
            result[f"load_ratio_{ours}_vs_{theirs}"] = round(med(a, "load_s") / med(b, "load_s"), 3)
            result[f"ttft_ratio_{ours}_vs_{theirs}"] = round(med(a, "ttft_s") / med(b, "ttft_s"), 3)
            result[f"llama_{theirs}_load_peak_MB"] = round(med(b, "load_peak_rss") / 1e6, 1)
        # same weights and inputs, different rounding: how often the two argmaxes agree
        top_a, top_b = runs[a][0]["top"], runs[b][0]["top"]
        result[f"top1_agree_{ours}_vs_{theirs}"] = round(sum(x == y for x, y in zip(top_a, top_b)) / len(top_a), 3)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
