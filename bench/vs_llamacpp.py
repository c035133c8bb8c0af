"""Thermocline's CPU engine against llama.cpp on the same weights, in one run.

One random model of 7B layer shapes (d 4096, 11008 neurons, 32 heads, 32k vocabulary, a
few layers to fit in memory) is written as an HF folder (fp16 safetensors, the engine's
input) and as a GGUF (f16, llama architecture, through the `gguf` package), which
llama-cpp-python quantizes to Q8_0 and Q4_0 (`llama_model_quantize`).

The weights carry exact predictors that fire at a chosen rate: each gate matrix is low
rank, W_gate = A P (A [n, r], P [r, d]), so fc1 = [P; -P], fc2 = [A, -A] gives
fc2 relu(fc1 h) = A P h, whose sign is the gate's (RMSNorm only rescales h) at threshold 0.
Every embedding shares one direction e (the first row of P) and A's first column is one
negative value: a bias that sets how often a neuron fires (`--active`). The output and
down projections are scaled down so the residual stream keeps that direction.
llama.cpp's llama architecture runs SiLU where these weights are a ReLU model: its dense
work and bytes are the same, which is what is timed.

Each measurement runs in its own process (`--worker`), llama.cpp's and ours alike, with the
same threads. Figures: decode tok/s (greedy over a fixed prompt), time to first token of a
20-token prompt, time of a 200-token prefill, load time; ratios are ours over llama.cpp's
(for times: llama.cpp's over ours, so > 1 is faster everywhere). Needs the `bench` extra
(`pip install -e '.[bench]'`). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import add_placeholder_vocab, emit, llama_cpp_missing, peak_rss

SHORT, LONG = 20, 200  # prompt lengths of the TTFT and prefill figures


@dataclass(frozen=True)
class Shape:
    d: int
    n_ff: int
    heads: int
    vocab: int


# ReluLLaMA-7B's layers, and tiny ones for --smoke (the test suite's check that the benchmark
# runs end to end; its figures mean nothing)
SHAPES = {"7B": Shape(4096, 11008, 32, 32000), "smoke": Shape(128, 512, 4, 512)}


# ----------------------------------------------------------------------- weights
def _ppf(p: float) -> float:
    """Standard normal quantile (no scipy): bisection on erf."""
    from math import erf, sqrt

    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + erf(mid / sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def weight_parts(shape: Shape, layers: int, rank: int, active: float, seed: int,
                 probs: list[np.ndarray] | None = None):
    """The model a part at a time, in the order it is drawn: first (the globals, None, None),
    then per layer (its HF-named fp16 tensors, fc1, fc2: its exact predictor, fp32). With
    `probs` (per layer, each neuron's firing probability) the neurons fire at those rates
    instead of all at `active` (bench.hybrid: a power law for the hot/cold split). One layer
    at a time is all a streamed build holds (`build`: 32 layers of 7B shapes are 12.9 GB)."""
    import torch

    D, N_FF, VOCAB = shape.d, shape.n_ff, shape.vocab

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    e = torch.nn.functional.normalize(randn(D), dim=0)
    # Embeddings: a random part and the shared direction e, of equal norm after RMSNorm.
    emb = randn(VOCAB, D, std=10.0)
    emb += (10.0 * D ** 0.5) * e
    yield ({"model.embed_tokens.weight": emb.half(), "model.norm.weight": torch.ones(D).half(),
            "lm_head.weight": randn(VOCAB, D, std=0.02).half()}, None, None)
    del emb
    # Normalised hidden state x = s e + x_perp with s = |x_perp| = sqrt(d / 2). P's other
    # rows are random unit vectors: P_k x ~ N(0, 1/2) from x_perp plus N(0, 1/2) from their
    # own small component along e. A_i's other entries ~ N(0, a^2): the gate's noise has std
    # a sqrt(r - 1); the bias -b s fires a neuron with probability `active` when
    # b s = z(1 - active) * that std.
    a = 0.05
    noise_std = a * (rank - 1) ** 0.5
    b = _ppf(1 - active) * noise_std / (D / 2) ** 0.5
    for i in range(layers):
        p = f"model.layers.{i}."
        P = torch.nn.functional.normalize(randn(rank, D), dim=1)
        P[0] = e
        A = randn(N_FF, rank, std=a)
        if probs is None:
            A[:, 0] = -b
        else:  # b_i from each neuron's own rate; a neuron that always fires gets a large negative bias
            p_fire = torch.from_numpy(np.clip(probs[i], 1e-6, 1 - 1e-6)).float()
            A[:, 0] = -torch.special.ndtri(1 - p_fire) * noise_std / (D / 2) ** 0.5
        tensors = {}
        tensors[p + "self_attn.q_proj.weight"] = randn(D, D, std=0.02).half()
        tensors[p + "self_attn.k_proj.weight"] = randn(D, D, std=0.02).half()
        tensors[p + "self_attn.v_proj.weight"] = randn(D, D, std=0.02).half()
        tensors[p + "self_attn.o_proj.weight"] = randn(D, D, std=0.002).half()
        tensors[p + "mlp.gate_proj.weight"] = (A @ P).half()
        tensors[p + "mlp.up_proj.weight"] = randn(N_FF, D, std=0.02).half()
        tensors[p + "mlp.down_proj.weight"] = randn(D, N_FF, std=0.002).half()
        tensors[p + "input_layernorm.weight"] = torch.ones(D).half()
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(D).half()
        yield tensors, torch.cat([P, -P]), torch.cat([A, -A], dim=1)


def make_weights(shape: Shape, layers: int, rank: int, active: float, seed: int,
                 probs: list[np.ndarray] | None = None) -> tuple[dict, list, list]:
    """HF-named fp16 tensors, and the exact predictors (fc1, fc2 per layer, fp32), all at once
    (`weight_parts`' numbers)."""
    tensors, fc1s, fc2s = {}, [], []
    for part, fc1, fc2 in weight_parts(shape, layers, rank, active, seed, probs):
        tensors.update(part)
        if fc1 is not None:
            fc1s.append(fc1)
            fc2s.append(fc2)
    return tensors, fc1s, fc2s


def _write_folder(root: Path, shape: Shape, fc1s: list, fc2s: list, layers: int) -> None:
    """config.json, the tokenizer and the predictors of an HF folder (the weights are written apart)."""
    from engine.loading.predictors import PredictorSet

    (root / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "relu",
        "hidden_size": shape.d, "intermediate_size": shape.n_ff, "num_hidden_layers": layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.heads, "vocab_size": shape.vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "float16",
    }))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import model_factory  # a small byte-level BPE: prompts are token ids here

    model_factory.build_tokenizer(root)
    PredictorSet(fc1s, fc2s, [0.0] * layers).save(root)


def write_hf(root: Path, shape: Shape, tensors: dict, fc1s: list, fc2s: list, layers: int) -> None:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"))
    _write_folder(root, shape, fc1s, fc2s, layers)


# HF names (under model.layers.N.) -> GGUF names (under blk.N.)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}
GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def _gguf_order(layers: int) -> list[tuple[str, str]]:
    """(GGUF name, HF name) of every tensor, in the file's order: the globals, then layer by layer
    (the order `weight_parts` draws them, so a streamed build writes each part as it comes)."""
    order = list((gg, hf) for hf, gg in GGUF_GLOBALS.items())
    for i in range(layers):
        order += [(f"blk.{i}.{gg}.weight", f"model.layers.{i}.{hf}.weight") for hf, gg in GGUF_NAMES.items()]
    return order


def _hf_shape(shape: Shape, hf: str) -> tuple[int, ...]:
    """The shape of an HF-named tensor of `weight_parts`."""
    D, N_FF = shape.d, shape.n_ff
    if hf in ("model.embed_tokens.weight", "lm_head.weight"):
        return (shape.vocab, D)
    if hf.endswith("norm.weight"):
        return (D,)
    return {"mlp.gate_proj": (N_FF, D), "mlp.up_proj": (N_FF, D), "mlp.down_proj": (D, N_FF)}.get(
        hf.split(".", 3)[3].rsplit(".", 1)[0], (D, D))


def _gguf_array(t) -> np.ndarray:
    arr = t.numpy()
    return arr.astype(np.float32) if arr.ndim == 1 else arr  # norms in f32


class GgufStream:
    """An f16 GGUF of these shapes written tensor by tensor in `_gguf_order`: the header (shapes
    known from `shape`) first, then each tensor's data as it is handed over; an SPM vocabulary
    of the model's size llama.cpp loads."""

    def __init__(self, path: Path, shape: Shape, layers: int):
        import gguf

        D, N_FF, HEADS, VOCAB = shape.d, shape.n_ff, shape.heads, shape.vocab
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_name("thermocline-bench")
        w.add_context_length(4096)
        w.add_embedding_length(D)
        w.add_block_count(layers)
        w.add_feed_forward_length(N_FF)
        w.add_head_count(HEADS)
        w.add_head_count_kv(HEADS)
        w.add_rope_dimension_count(D // HEADS)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        add_placeholder_vocab(w, VOCAB)
        self.order = _gguf_order(layers)
        for gg, hf in self.order:
            dims = _hf_shape(shape, hf)
            dtype = np.dtype(np.float32 if len(dims) == 1 else np.float16)
            w.add_tensor_info(gg, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self.w, self.next = w, 0

    def write(self, tensors: dict) -> None:
        """The data of the next tensors in the file's order, from HF-named tensors."""
        while self.next < len(self.order) and self.order[self.next][1] in tensors:
            self.w.write_tensor_data(_gguf_array(tensors[self.order[self.next][1]]))
            self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            raise RuntimeError(f"GGUF incomplete: {self.order[self.next][0]} not written")
        self.w.close()


def write_gguf(path: Path, shape: Shape, tensors: dict, layers: int) -> None:
    """f16 GGUF of the same weights (`GgufStream`, from every tensor at once)."""
    out = GgufStream(path, shape, layers)
    out.write(tensors)
    out.close()


def write_streamed(root: Path, gguf_path: Path | None, shape: Shape, parts, layers: int) -> None:
    """The HF folder (one safetensors shard per part, and the index) and the f16 GGUF from
    `weight_parts`, a part at a time: the build holds one layer's tensors, and the predictors."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    out = GgufStream(gguf_path, shape, layers) if gguf_path is not None else None
    weight_map, fc1s, fc2s = {}, [], []
    for k, (tensors, fc1, fc2) in enumerate(parts):
        shard = f"model-{k:05d}-of-{layers + 1:05d}.safetensors"
        save_file(tensors, str(root / shard))
        weight_map.update({name: shard for name in tensors})
        if out is not None:
            out.write(tensors)
        if fc1 is not None:
            fc1s.append(fc1)
            fc2s.append(fc2)
        del tensors
    if out is not None:
        out.close()
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _write_folder(root, shape, fc1s, fc2s, layers)


def quantize_gguf(src: Path, dst: Path, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {kind} failed ({rc})")


def build(workdir: Path, shape: Shape, layers: int, rank: int, active: float, seed: int, quantize: bool,
          keep_f16: bool = True, kinds: tuple[str, ...] = ("Q8_0", "Q4_0")) -> dict:
    """The model files (reused when workdir already holds them for the same settings); the
    quantized GGUFs of `kinds` only with `quantize` (llama.cpp quantizes them). Without
    `keep_f16` the f16 GGUF is removed once quantized (32 layers of 7B shapes: 12.9 GB of disk)."""
    stamp = {"layers": layers, "rank": rank, "active": active, "seed": seed, "shape": shape.__dict__, "version": 2}
    marker = workdir / "stamp.json"
    files = {"hf": workdir / "hf", "f16": workdir / "model-f16.gguf"}
    if quantize:
        files.update({kind: workdir / f"model-{kind.lower()}.gguf" for kind in kinds})
    f16 = files["f16"]
    if not keep_f16 and quantize:
        del files["f16"]
    if marker.exists() and json.loads(marker.read_text()) == stamp and all(p.exists() for p in files.values()):
        return files
    workdir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    if files["hf"].is_dir():  # an older build's folder (another layout, other weights): nothing of it is kept
        shutil.rmtree(files["hf"])
    # a layer at a time (32 layers of 7B shapes are 12.9 GB of fp16: one layer is 0.4 GB)
    write_streamed(files["hf"], f16, shape, weight_parts(shape, layers, rank, active, seed), layers)
    for kind in kinds if quantize else ():
        quantize_gguf(f16, files[kind], kind)
    if "f16" not in files:
        f16.unlink()
    marker.write_text(json.dumps(stamp))
    return files


# ----------------------------------------------------------------------- workers
def prompts(seed: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """(short prompt, long prompt, decode prompt): token ids past the specials and bytes."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(300, vocab, size=LONG + 64)]
    return [1] + ids[: SHORT - 1], [1] + ids[: LONG - 1], [1] + ids[LONG : LONG + 7]


def worker_llama(path: Path, shape: Shape, threads: int, decode_tokens: int, seed: int) -> dict:
    import llama_cpp

    short, long, dprompt = prompts(seed, shape.vocab)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    llm.eval(short[:4])  # warm-up (first-touch of the mapped weights)

    def prefill(tokens):
        llm.reset()  # eval drops the cache past n_tokens, so this starts from an empty cache
        t = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - t

    ttft = min(prefill(short) for _ in range(2))
    pre = min(prefill(long) for _ in range(2))
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        # the last evaluated token's logits: `llm.scores` stays empty without logits_all,
        # so reading it would feed token 0 every step
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

    llm.reset()
    llm.eval(dprompt)
    tok = greedy()
    fed = []
    t = time.perf_counter()
    for _ in range(decode_tokens):
        llm.eval([tok])
        fed.append(tok)
        tok = greedy()
    decode = decode_tokens / (time.perf_counter() - t)
    return {"load_s": load_s, "ttft_s": ttft, "prefill_s": pre, "decode_tok_s": decode,
            "decode_distinct_tokens": len(set(fed))}


def worker_ours(root: Path, shape: Shape, mode: str, cpu_weights: str, threads: int, decode_tokens: int,
                seed: int) -> dict:
    import torch

    from engine import Engine, SamplingParams

    torch.set_num_threads(threads)
    short, long, dprompt = prompts(seed, shape.vocab)
    t0 = time.perf_counter()
    kwargs = {"cpu_weights": cpu_weights} if cpu_weights else {}  # plain `dense`: the engine's fp32 reference
    engine = Engine.load(root, mode=mode, ctx=512, threads=threads, **kwargs)
    load_s = time.perf_counter() - t0
    # the kernels the load left loading on its thread (the first computation waits for them)
    engine.wait_kernels()
    ready_s = time.perf_counter() - t0
    load_rss = peak_rss()  # this process's so far: imports and the load (issue #14)
    placed = engine.memory()["ram_bytes"] or None  # dense mode: all of it (weights and KV cache) on the CPU
    engine.eos_ids = set()

    def run(tokens, new):
        engine.reset()
        engine.generate(tokens, SamplingParams(max_new_tokens=new, temperature=0))
        return engine.last_stats

    run(short[:4], 2)  # warm-up
    ttft = min(run(short, 1).ttft_s for _ in range(2))
    pre = min(run(long, 1).ttft_s for _ in range(2))
    stats = run(dprompt, decode_tokens + 1)
    selection = {}
    if engine.sparse is not None:  # the placed predictors against their fp32 original (issue #30)
        from engine.calibration.evaluation import selection_vs_original

        selection = {k: round(v, 4) for k, v in selection_vs_original(engine, long).items()}
    read = bytes_per_token(engine, stats.ffn_active_fraction) if engine.sparse is not None else None
    return {**selection, "bytes_per_token": read, "load_s": load_s, "kernels_ready_s": ready_s, "ttft_s": ttft, "prefill_s": pre, "decode_tok_s": stats.decode_tok_s,
            "ffn_active_fraction": round(stats.ffn_active_fraction, 4), "load_peak_rss": load_rss,
            "placed_ram": placed, "load_rss_over_placed": round(load_rss / placed, 3) if placed else None,
            "prepared": (getattr(engine.sparse, "prepared_dense", None) if engine.sparse is not None
                         else getattr(engine, "dense_prepared", None)) is not None}


def bytes_per_token(engine, active: float) -> int:
    """Bytes one decoded token reads of our placed weights: every attention matrix and the head
    whole, the predictors whole, and the `active` share of the FFN's rows (gate, up, down of the
    neurons computed). Excludes the KV cache and the embedding row (a few KB at these prompts)."""
    from engine.kernels.quantized import matrix_nbytes

    model = engine.model
    total = 0 if model.lm_head is model.embed else matrix_nbytes(model.lm_head)
    for i, layer in enumerate(model.layers):
        total += matrix_nbytes(layer.qkv) + matrix_nbytes(layer.out)
        ffn = layer.ffn
        predictors = getattr(getattr(getattr(ffn, "context", None), "_hooks", None), "predictors", None)
        if predictors is not None:
            total += matrix_nbytes(predictors.fc1[i]) + matrix_nbytes(predictors.fc2[i])
        total += int(active * ffn.nbytes)
    return total


def gguf_bytes_per_token(path: Path) -> int:
    """Bytes one decoded token of llama.cpp reads: every tensor but the embeddings (one row of them)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")


def worker_env() -> dict:
    """The environment of a measured worker: this one without PYTHONDONTWRITEBYTECODE, so the
    engine's modules run from compiled bytecode as in an install (pip compiles them; a
    checkout run with that variable set compiles every lazily imported module from source in
    each process: ~60 ms of every measured load)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def spawn(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.vs_llamacpp", *args], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, env=worker_env())
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _best(old: dict | None, new: dict) -> dict:
    """Per figure, the better of two rounds (shorter times, higher token rate)."""
    if old is None:
        return new
    best = {k: (max(v, new[k]) if k == "decode_tok_s" else min(v, new[k]) if k.endswith("_s") else v)
            for k, v in old.items()}
    if new.get("load_s", float("inf")) < old.get("load_s", float("inf")):
        # the load's memory figures and whether it mapped a prepared file belong to that load
        best.update({k: v for k, v in new.items() if not k.endswith("_s") and k != "ffn_active_fraction"})
    return best


def machine() -> dict:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    have = set(flags.split())
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "avx2": "avx2" in have, "avx512f": "avx512f" in have,
            "avx512_vnni": "avx512_vnni" in have, "avx_vnni": "avx_vnni" in have,
            "loadavg_before": os.getloadavg()}




def _spawn_bandwidth(threads: int, smoke: bool) -> float:
    """`_read_bandwidth` in its own process, so no worker inherits the probe's memory peak."""
    return spawn(["--worker", "bandwidth", "--threads", str(threads), *(["--smoke"] if smoke else [])])["read_gbps"]


def _read_bandwidth(threads: int, nbytes: int) -> float:
    """The host's read bandwidth now, GB/s, on the runs' threads (bench.ffn's measure)."""
    import torch

    from bench.ffn import machine_bandwidth

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return machine_bandwidth("cpu", nbytes)["read_gbps"]
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=256, help="gate rank; predictors have 2x this hidden size")
    parser.add_argument("--active", type=float, default=0.10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="keep the model files here between runs")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every side this many times, alternating; keep each figure's best")
    parser.add_argument("--ours", default="dense,sparse:int8,sparse:fp32",
                        help="our engine's modes, mode[:cpu-weights], comma-separated")
    parser.add_argument("--llama", default="f16,Q8_0,Q4_0", help="llama.cpp's formats to run, comma-separated")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the benchmark runs (CI)")
    args = parser.parse_args(argv)
    shape = SHAPES["smoke" if args.smoke else "7B"]

    if args.worker == "bandwidth":
        print(json.dumps({"read_gbps": _read_bandwidth(args.threads, 64 << 20 if args.smoke else 1 << 30)}))
        return 0
    if args.worker == "llama":
        print(json.dumps(worker_llama(args.path, shape, args.threads, args.decode_tokens, args.seed)))
        return 0
    if args.worker:
        mode, _, weights = args.worker.partition(":")
        default = None if mode == "dense" else "int8"  # dense:int8, dense:int4: dense on quantized CPU weights
        print(json.dumps(worker_ours(args.path, shape, mode, weights or default, args.threads, args.decode_tokens,
                                     args.seed)))
        return 0
    if args.smoke:
        args.rank, args.decode_tokens = 8, 4
    llama_skipped = llama_cpp_missing()

    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = tempfile.TemporaryDirectory()
        workdir = Path(tmp.name)
    t0 = time.perf_counter()
    kinds = [] if llama_skipped else [k for k in args.llama.split(",") if k]
    files = build(workdir, shape, args.layers, args.rank, args.active, args.seed, quantize=llama_skipped is None,
                  keep_f16="f16" in kinds, kinds=tuple(k for k in ("Q8_0", "Q4_0") if k in kinds))
    build_s = time.perf_counter() - t0
    common = ["--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens), "--seed", str(args.seed),
              *(["--smoke"] if args.smoke else [])]
    info = machine()
    bandwidth = [_spawn_bandwidth(args.threads, args.smoke)]
    # Each round runs every side once, llama.cpp's and ours alternating; each figure keeps its
    # best round: on a shared machine the load moves between processes, and one round leaves
    # one side measured in a quiet minute and the other in a busy one.
    names = args.ours.split(",")
    llama, ours = {}, {}
    for r in range(args.rounds):
        for i in range(max(len(kinds), len(names))):
            pair = [("llama", kinds[i]) if i < len(kinds) else None, ("ours", names[i]) if i < len(names) else None]
            for side in (pair if r % 2 == 0 else pair[::-1]):
                if side is None:
                    continue
                who, name = side
                if who == "llama":
                    got = spawn(["--worker", "llama", "--path", str(files[name]), *common])
                    llama[name] = _best(llama.get(name), got)
                else:
                    got = spawn(["--worker", name, "--path", str(files["hf"]), *common])
                    ours[name] = _best(ours.get(name), got)
    info["loadavg_after"] = os.getloadavg()
    bandwidth.append(_spawn_bandwidth(args.threads, args.smoke))
    read_gbps = sum(bandwidth) / len(bandwidth)
    for kind, v in llama.items():
        v["bytes_per_token"] = gguf_bytes_per_token(files[kind])
    for v in list(llama.values()) + list(ours.values()):
        if v.get("bytes_per_token"):  # the share of the host's read bandwidth a token's bytes took
            v["read_gbps"] = v["bytes_per_token"] * v["decode_tok_s"] / 1e9
            v["bandwidth_share"] = round(v["read_gbps"] / read_gbps, 3)
    if tmp is not None:
        tmp.cleanup()

    def ratios(mine: dict, base: dict) -> dict:
        return {"decode": round(mine["decode_tok_s"] / base["decode_tok_s"], 3),
                "ttft_20": round(base["ttft_s"] / mine["ttft_s"], 3),
                "prefill_200": round(base["prefill_s"] / mine["prefill_s"], 3),
                "load": round(base["load_s"] / mine["load_s"], 3),
                # the load and the kernels it left loading past its end (the first answer waits for them)
                "load_and_kernels": round(base["load_s"] / mine["kernels_ready_s"], 3)}

    def rounded(d: dict) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}

    result = {
        "shape": f"{args.layers} layers x ({shape.d} x {shape.n_ff}, {shape.heads} heads), vocab {shape.vocab}",
        "active_target": args.active, "gate_rank": args.rank, "threads": args.threads, "rounds": args.rounds,
        "machine": info, "build_s": round(build_s, 1),
        "read_gbps": [round(b, 2) for b in bandwidth],  # torch sum over 1 GiB, before and after the runs
        "llama_cpp": {k: rounded(v) for k, v in llama.items()},
        "llama_cpp_skipped": llama_skipped,
        "ours": {k: rounded(v) for k, v in ours.items()},
        # > 1: ours is faster (times are inverted). Goals (issue #13): sparse:int8 decode vs
        # Q8_0 >= 1.6; ttft_20 >= 1/1.5 in every mode; prefill_200 vs Q8_0 >= 0.5; dense decode
        # >= 0.8 at the same bytes per weight (dense:int8 vs Q8_0, dense:int4 vs Q4_0).
        # Issue #14: sparse:int4 decode vs Q4_0 >= 1.6.
        **{f"ratios_vs_{kind}": {k: ratios(v, llama[kind]) for k, v in ours.items()} for kind in llama},
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
