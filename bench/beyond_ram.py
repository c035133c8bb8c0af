"""A model larger than its RAM budget (PowerInfer-2, issue #29): our disk tier against
llama.cpp's mmap under the same memory limit, in one run.

    python -m bench.beyond_ram [--layers 4] [--tokens 16] [--json]
    python -m bench.beyond_ram --smoke --json      (tiny shapes; the test suite's check)

One sparse-by-construction model of whole 7B layer shapes (bench.vs_llamacpp's weights:
d 4096, 11008 neurons, 32 heads, 32k vocabulary; exact predictors whose neurons fire at
rates drawn from a power law of mean `--active`, and those rates as the activation
statistics), written as an HF folder and as a Q4_0 GGUF of the same weights (llama.cpp
quantizes its f16 GGUF). `--layers` whole layers: 4 by default, about 0.8 GB of int4 rows,
25x the 32 MB L3, and a run that fits in a quarter of an hour on 2 cores.

Runs, each in its own process, the page cache dropped before each (as root) so that disk
reads are real:
- `in_ram`: ours, sparse int4, every row in RAM (no limit);
- `disk_50`, `disk_90`: ours with the RAM budget at the resident parts (attention,
  predictors, norms, head, KV cache; the embeddings, a row a token, stay on disk) plus 50%
  and 10% of the FFN rows' bytes, the next layer read ahead while the misses are many (the
  default); `_lookahead`, `_no_lookahead`: the same with it always, and never;
- `disk_min`: ours at the least budget that runs (the resident parts and the cache's
  working set of slots), shorter;
- `llama_in_ram`, and llama.cpp under the `disk_50` and `disk_90` limits: with its defaults
  (mmap; on CPUs where it repacks Q4_0 it copies the weights into its own buffers) and
  with `--no-repack` (`use_extra_bufts=False`: it computes from the mapped file).
Every limited run is in its own memory cgroup (v1 `memory/` or v2), which charges the page
cache to the process. The limit is the model budget plus the runtime floor of that engine's
process (Python, torch, numba and the compiled kernels for ours; Python and libllama for
llama.cpp), measured by running a tiny model the same way: the RAM budget is what the user
gives the model, the floor is what each program costs with no model.

Figures per run: decode tok/s (sampled: DECODE_TEMPERATURE), TTFT (the first 20-token prompt after the load:
cold), disk bytes read per decode token (/proc/PID/io read_bytes), the neuron cache's hit
share, peak RSS and the cgroup's peak usage; ours also the read path's breakdown (reader
seconds on the decode's critical path, calls, bytes). Ratios: each disk run's decode over
in_ram's, and over llama.cpp's under the same limit. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import emit, llama_cpp_missing, peak_rss
from bench.vs_llamacpp import SHAPES, Shape, quantize_gguf, worker_env, write_gguf, write_hf

CTX = 256
# The decode samples at temperature 1 with a fixed seed, on both sides. A random model's greedy
# decode repeats one token, so a token fired the neurons the one before fired and the cache held
# them all (hit share 78% at 90% on disk, against 45% on varied tokens): a locality real text
# does not have. Our disk runs sample the same tokens as in RAM (the same logits, the same seed).
DECODE_TEMPERATURE = 1.0
# --smoke's shape: FFN rows (7 MB at int4) well above what the disk tier counts beside its cache
# (the reader's buffers, 1.6 MB), so that 50% and 90% of them on disk are two budgets
SMOKE = Shape(256, 8192, 4, 512)
SHORT = 20  # the TTFT prompt
CGROUP_PREFIX = "thermocline-bench"
ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------- model
def build(workdir: Path, shape, layers: int, rank: int, active: float, seed: int, gguf: bool) -> dict:
    """The HF folder (with statistics) and, with `gguf`, a Q4_0 GGUF of the same weights;
    reused when workdir holds them for the same settings."""
    import torch

    from bench.sparse_decode import power_law
    from bench.vs_llamacpp import make_weights
    from engine.hotcold.activation_stats import ActivationStats

    stamp = {"layers": layers, "rank": rank, "active": active, "seed": seed, "shape": shape.__dict__,
             "gguf": gguf, "version": 1}
    marker = workdir / "stamp.json"
    files = {"hf": workdir / "hf"}
    if gguf:
        files["Q4_0"] = workdir / "model-q4_0.gguf"
    if marker.exists() and json.loads(marker.read_text()) == stamp and all(p.exists() for p in files.values()):
        return files
    workdir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    rng = np.random.default_rng(seed)
    probs = [power_law(shape.n_ff, active, rng) for _ in range(layers)]
    tensors, fc1s, fc2s = make_weights(shape, layers, rank, active, seed, probs)
    write_hf(files["hf"], shape, tensors, fc1s, fc2s, layers)
    ActivationStats([torch.from_numpy(p * 1e6) for p in probs], tokens=1_000_000).save(files["hf"])
    del fc1s, fc2s
    if gguf:
        f16 = workdir / "model-f16.gguf"
        write_gguf(f16, shape, tensors, layers)
        del tensors
        quantize_gguf(f16, files["Q4_0"], "Q4_0")
        f16.unlink()
    marker.write_text(json.dumps(stamp))
    return files


def prompts(seed: int, vocab: int) -> tuple[list[int], list[int]]:
    """(TTFT prompt, decode prompt): token ids past the specials and bytes."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(300, vocab, size=SHORT + 8)]
    return [1] + ids[: SHORT - 1], [1] + ids[SHORT:SHORT + 7]


def read_bytes() -> int:
    """Bytes this process has had read from storage (/proc/self/io; every thread's)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0




# ----------------------------------------------------------------------- workers
def worker_ours(root: Path, budget: int | None, tokens: int, threads: int, seed: int, vocab: int) -> dict:
    from engine import Engine, SamplingParams
    from engine.runtime import fused_decode

    short, dprompt = prompts(seed, vocab)
    floor_rss = peak_rss()
    t0 = time.perf_counter()
    engine = Engine.load(root, mode="sparse", ctx=CTX, threads=threads, cpu_weights="int4", ram_budget=budget)
    load_s = time.perf_counter() - t0
    engine.eos_ids = set()
    plan = engine.sparse.plan
    cache = engine.sparse.neuron_cache
    engine.generate(short, SamplingParams(max_new_tokens=1, temperature=0))  # cold: its misses are read
    ttft = engine.last_stats.ttft_s
    fused_decode.wait_compiled_behind()  # the disk layer's calls where numba's cache lacked them
    engine.reset()
    mark = None
    sampled = SamplingParams(max_new_tokens=tokens + 1, temperature=DECODE_TEMPERATURE, seed=seed)
    for i, _ in enumerate(engine.stream(dprompt, sampled)):
        if i == 0:  # decode from the first token on: the prompt's reads are not counted
            reader = cache.reader if cache is not None else None
            mark = (read_bytes(), time.perf_counter(), cache.stall_s if cache else 0.0,
                    reader.calls if reader else 0, reader.bytes_read if reader else 0,
                    cache.hits if cache else 0, cache.misses if cache else 0,
                    reader.seconds if reader else 0.0, cache.ahead_neurons if cache else 0,
                    cache.ahead_used if cache else 0)
    end = (read_bytes(), time.perf_counter())
    stats = engine.last_stats
    decode_wall = end[1] - mark[1]
    out = {"load_s": round(load_s, 2), "ttft_s": round(ttft, 4), "decode_tok_s": round(stats.decode_tok_s, 3),
           "disk_read_per_token": int((end[0] - mark[0]) / tokens),
           "ffn_active_fraction": round(stats.ffn_active_fraction, 4),
           "peak_rss": peak_rss(), "rss_before_load": floor_rss, "ram_budget": budget,
           "engine_ram_bytes": engine.memory()["ram_bytes"], "verdict": plan.verdict,
           "token_ids": list(engine.last_token_ids)}
    if cache is not None:
        r = cache.reader
        hits, misses = cache.hits - mark[5], cache.misses - mark[6]
        out.update({
            "cache_hit_share": round(hits / max(hits + misses, 1), 4),
            "cache_neurons": cache.capacity, "cache_bytes": cache.nbytes,
            "engine_read_per_token": int((r.bytes_read - mark[4]) / tokens),
            "breakdown": {"decode_s": round(decode_wall, 3),
                          "read_wait_s": round(cache.stall_s - mark[2], 3),  # the token waited for reads
                          "read_wait_share": round((cache.stall_s - mark[2]) / max(decode_wall, 1e-9), 3),
                          "read_busy_s": round(r.seconds - mark[7], 3),  # reads in flight, waited for or not
                          "read_calls_per_token": round((r.calls - mark[3]) / tokens, 1),
                          "read_ahead_per_token": round((cache.ahead_neurons - mark[8]) / tokens, 1),
                          "read_ahead_used_share": round((cache.ahead_used - mark[9])
                                                         / max(cache.ahead_neurons - mark[8], 1), 3),
                          "lookahead": {True: "always", False: "never", None: "auto"}[engine.model.layers[0].ffn.lookahead],
                          "bundle_bytes": r.layout.bundle_bytes,
                          "read_threads": r.threads, "read_path": r.path_kind,
                          "chunk_rounds": cache.chunk_rounds, "overflow_rounds": cache.overflow_rounds,
                          "pinned": int(cache.pinned.sum())}})
    else:
        out["cache_hit_share"] = 1.0
    return out


def worker_llama(path: Path, tokens: int, threads: int, seed: int, vocab: int, repack: bool) -> dict:
    import llama_cpp

    short, dprompt = prompts(seed, vocab)
    floor_rss = peak_rss()
    if not repack:  # llama.cpp's --no-repack: model params with use_extra_bufts off (Llama() has no argument
        # for it; llama.py takes its defaults from the llama_cpp.llama_cpp module)
        import llama_cpp.llama_cpp as bindings

        defaults = bindings.llama_model_default_params

        def no_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = no_repack
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=CTX, n_batch=CTX, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    rng = np.random.default_rng(seed)

    def sample() -> int:  # as ours (DECODE_TEMPERATURE); Gumbel-max: a draw from the softmax
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits / DECODE_TEMPERATURE - np.log(-np.log(rng.random(n_vocab)))))

    t = time.perf_counter()
    llm.eval(short)  # cold, as ours
    ttft = time.perf_counter() - t
    llm.reset()
    llm.eval(dprompt)
    tok = sample()
    io0, t = read_bytes(), time.perf_counter()
    for _ in range(tokens):
        llm.eval([tok])
        tok = sample()
    wall = time.perf_counter() - t
    return {"load_s": round(load_s, 2), "ttft_s": round(ttft, 4), "decode_tok_s": round(tokens / wall, 3),
            "disk_read_per_token": int((read_bytes() - io0) / tokens), "peak_rss": peak_rss(),
            "rss_before_load": floor_rss, "repack": repack}


# ----------------------------------------------------------------------- cgroups
class MemoryCgroup:
    """A child memory cgroup with a hard limit (v1 `memory/` or v2 unified); None from
    `create` where this process cannot make one (not root, no memory controller)."""

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    @classmethod
    def available(cls) -> str | None:
        """Why no cgroup can be made here, or None."""
        if os.name != "posix" or os.geteuid() != 0:
            return "not root"
        if Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() or (
                Path("/sys/fs/cgroup/memory").is_dir() and os.access("/sys/fs/cgroup/memory", os.W_OK)):
            return None
        controllers = Path("/sys/fs/cgroup/cgroup.controllers")
        if controllers.exists() and "memory" in controllers.read_text().split():
            return None
        return "no memory cgroup controller"

    @classmethod
    def create(cls, name: str, limit: int) -> "MemoryCgroup | None":
        if cls.available() is not None:
            return None
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = not v1.is_dir()
        base = Path("/sys/fs/cgroup") if v2 else v1
        path = base / f"{CGROUP_PREFIX}-{os.getpid()}-{name}"
        path.mkdir(exist_ok=True)
        group = cls(path, v2)
        if v2:
            (path / "memory.max").write_text(str(limit))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            swap = path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                try:
                    swap.write_text(str(limit))
                except OSError:
                    pass
        return group

    def enter(self) -> None:
        """Move the calling process in (a child's preexec_fn)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int | None:
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    def remove(self) -> None:
        for _ in range(50):  # the last pages leave a moment after the process
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def spawn(args: list[str], limit: int | None, name: str, drop: bool, env: dict | None = None) -> dict:
    """One worker process (under a cgroup of `limit` bytes when given); its JSON, or how it
    died (a worker killed at its limit is a result, not an error)."""
    dropped = drop_caches() if drop else False
    group = MemoryCgroup.create(name, limit) if limit else None
    info = {"limit": limit, "cgroup": str(group.path) if group else None, "caches_dropped": dropped}
    try:
        out = subprocess.run([sys.executable, "-m", "bench.beyond_ram", *args], capture_output=True, text=True,
                             cwd=ROOT, env={**worker_env(), **(env or {})},
                             preexec_fn=group.enter if group else None)
        if group is not None:
            info.update({"cgroup_peak": group.peak(), "oom_kills": group.oom_kills()})
    finally:
        if group is not None:
            group.remove()
    if out.returncode != 0:
        killed = out.returncode in (-9, 137)
        if not killed:
            raise RuntimeError(f"worker {args} failed ({out.returncode}):\n{out.stderr[-3000:]}")
        return {**info, "killed": True, "returncode": out.returncode, "stderr_tail": out.stderr[-300:]}
    return {**info, **json.loads(out.stdout.strip().splitlines()[-1]), "killed": False}


def ratio(a: dict, b: dict, key: str = "decode_tok_s") -> float | None:
    if a.get("killed") or b.get("killed") or not b.get(key):
        return None
    return round(a[key] / b[key], 3)


# ----------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=256, help="gate rank; predictors have 2x this hidden size")
    parser.add_argument("--active", type=float, default=0.10, help="mean firing rate of the power law")
    parser.add_argument("--tokens", type=int, default=16, help="decode tokens a run times")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="keep the model files here between runs")
    parser.add_argument("--no-drop-caches", action="store_true", help="leave the page cache alone between runs")
    parser.add_argument("--no-llama", action="store_true", help="our runs only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the benchmark runs (CI)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else SHAPES["7B"]

    if args.worker == "ours":
        result = worker_ours(args.path, args.budget, args.tokens, args.threads, args.seed, shape.vocab)
        print(json.dumps(result))
        return 0
    if args.worker in ("llama", "llama-norepack"):
        result = worker_llama(args.path, args.tokens, args.threads, args.seed, shape.vocab, args.worker == "llama")
        print(json.dumps(result))
        return 0
    if args.smoke:
        args.layers, args.rank, args.tokens = 2, 8, 3
    drop = not (args.no_drop_caches or args.smoke)
    llama_skipped = "--no-llama" if args.no_llama else llama_cpp_missing()
    load_before = os.getloadavg()

    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = tempfile.TemporaryDirectory()
        workdir = Path(tmp.name)
    try:
        t0 = time.perf_counter()
        files = build(workdir / "model", shape, args.layers, args.rank, args.active, args.seed,
                      gguf=llama_skipped is None)
        # the runtime floors: each engine on a tiny model, the same way (ours: the smoke shape, int4)
        floors = {}
        tiny = build(workdir / "tiny", SHAPES["smoke"], 2, 8, 0.1, 0, gguf=llama_skipped is None)
        common = ["--threads", str(args.threads), "--seed", str(args.seed), "--tokens", "2", "--smoke"]
        floors["ours"] = spawn(["--worker", "ours", "--path", str(tiny["hf"]), *common], None, "floor", False)["peak_rss"]
        if llama_skipped is None:
            floors["llama"] = spawn(["--worker", "llama-norepack", "--path", str(tiny["Q4_0"]), *common], None,
                                    "floor-llama", False)["peak_rss"]
        build_s = time.perf_counter() - t0

        common = ["--threads", str(args.threads), "--seed", str(args.seed), "--tokens", str(args.tokens)]
        if args.smoke:
            common.append("--smoke")

        def ours(name, budget, tokens=None, env=None):
            extra = ["--tokens", str(tokens)] if tokens else []
            limit = None if budget is None else budget + floors["ours"]
            return spawn(["--worker", "ours", "--path", str(files["hf"]), *common, *extra]
                         + (["--budget", str(budget)] if budget else []), limit, name, drop, env)

        sizes = _sizes(files["hf"])  # its load writes the prepared file: the runs map it, as a second start
        runs = {"in_ram": ours("in_ram", None)}
        # (never below the least that runs: the resident parts and the cache's working set, a
        # quarter of one layer's neurons, which 10% of a few layers' rows may not reach)
        budgets = {"disk_50": max(sizes["least"], sizes["resident"] + int(0.5 * sizes["ffn"])),
                   "disk_90": max(sizes["least"], sizes["resident"] + int(0.1 * sizes["ffn"]))}
        # The disk runs' kernels compile first, into numba's cache, with no limit: each budget once,
        # two tokens. A limited run that compiled them took about 330 MB more than its floor and was
        # killed where the in-RAM kernels were cached and the disk tier's were not (the tiny model at
        # its least budget did not compile them all: a plan with more cache slots takes other calls).
        for name, budget in budgets.items():
            spawn(["--worker", "ours", "--path", str(files["hf"]), *common, "--tokens", "2", "--budget", str(budget)],
                  None, f"kernels-{name}", False)
        for name, budget in budgets.items():
            runs[name] = ours(name, budget, env={"THERMOCLINE_DISK_LOOKAHEAD": "auto"})  # the default
            # the overlap measured: the next layer's guess read ahead while this layer computes, or never
            runs[f"{name}_lookahead"] = ours(name, budget, env={"THERMOCLINE_DISK_LOOKAHEAD": "1"})
            runs[f"{name}_no_lookahead"] = ours(name, budget, env={"THERMOCLINE_DISK_LOOKAHEAD": "0"})
        runs["disk_min"] = ours("disk_min", sizes["least"], tokens=max(2, args.tokens // 4))
        if llama_skipped is None:
            runs["llama_in_ram"] = spawn(["--worker", "llama", "--path", str(files["Q4_0"]), *common], None,
                                         "llama", drop)
            for name, budget in budgets.items():
                for worker in ("llama", "llama-norepack"):
                    runs[f"{worker}_{name[5:]}"] = spawn(["--worker", worker, "--path", str(files["Q4_0"]), *common],
                                                         budget + floors["llama"], f"{worker}-{name}", drop)
    finally:
        if tmp is not None:
            tmp.cleanup()

    in_ram = runs["in_ram"]
    ratios = {}
    for name in ("disk_50", "disk_90", "disk_min", "disk_50_lookahead", "disk_90_lookahead",
                 "disk_50_no_lookahead", "disk_90_no_lookahead"):
        ratios[f"{name}_vs_in_ram"] = ratio(runs[name], in_ram)
    for name in ("disk_50", "disk_90"):
        ratios[f"{name}_lookahead_vs_none"] = ratio(runs[f"{name}_lookahead"], runs[f"{name}_no_lookahead"])
    for share in ("50", "90"):
        ours_run = runs[f"disk_{share}"]
        ratios[f"disk_{share}_rss_within_limit"] = (not ours_run.get("killed")) and (
            ours_run.get("cgroup_peak") or ours_run["peak_rss"]) <= ours_run["limit"]
        ratios[f"disk_{share}_engine_bytes_within_budget"] = (not ours_run.get("killed")) and \
            ours_run["engine_ram_bytes"] <= budgets[f"disk_{share}"]
        if llama_skipped is None:
            for worker in ("llama", "llama-norepack"):
                ratios[f"disk_{share}_vs_{worker.replace('-', '_')}"] = ratio(ours_run, runs[f"{worker}_{share}"])
    if llama_skipped is None:
        ratios["in_ram_vs_llama_in_ram"] = ratio(in_ram, runs["llama_in_ram"])
    result = {
        "shape": f"{args.layers} layers x ({shape.d} x {shape.n_ff}, {shape.heads} heads), vocab {shape.vocab}",
        "active_mean": args.active, "threads": args.threads, "tokens": args.tokens, "cpu_weights": "int4",
        "build_s": round(build_s, 1), "sizes": sizes, "budgets": budgets, "runtime_floor_rss": floors,
        "cgroup": MemoryCgroup.available() or "ok", "caches_dropped": drop, "llama_cpp": llama_skipped or "ran",
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "ratios": ratios,
        "same_tokens_as_in_ram": all(runs[n].get("token_ids") == in_ram["token_ids"]
                                     for n in runs if n.startswith("disk_") and n != "disk_min"
                                     and not runs[n].get("killed")),
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in runs.items()},
    }
    emit(result, args.json)
    return 0


def _sizes(model: Path) -> dict:
    """The placement's bytes at an all-in-RAM budget: resident parts, the FFN rows, the least
    budget that runs from disk (this process, which the workers' limits do not cover)."""
    from engine import Engine
    from engine.hotcold.placement import solve

    from engine.hotcold.neuron_bundles import open_or_build
    from engine.loading.prepared import PreparedRows

    Engine.load(model, mode="sparse", ctx=CTX, cpu_weights="int4").close()  # a first load writes the prepared files
    engine = Engine.load(model, mode="sparse", ctx=CTX, cpu_weights="int4")  # sized as the workers' loads see it
    plan = engine.sparse.plan
    rows = engine.sparse.prepared_rows or PreparedRows(engine.sparse.prepared_path)
    bundles, _ = open_or_build(rows, engine.config.num_layers)  # as the first disk load would
    floor = solve(engine.sparse.problem, 0, 0)  # below the placed size: the embeddings go to disk first
    out = {"resident": floor.resident_ram_bytes, "ffn": plan.tier_bytes["cpu_ffn"], "placed": plan.ram_bytes,
           "embeddings": engine.sparse.problem.embed_cpu, "least": floor.min_ram_bytes, "prepared_file": engine.sparse.prepared_path.stat().st_size,
           "bundles_file": bundles.stat().st_size}
    engine.close()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
