"""Every benchmark runs end to end at tiny sizes, so a crash in one fails the suite.

Each runs in its own process as a user runs it (`python -m bench.X`), with its smoke sizes
(`--smoke`, or its own size arguments made tiny), and its last line must be one JSON
object. What the figures say is not checked beyond what the run itself must get right: no
timing is asserted. bench.ffn's smoke run is in test_kernels_cpu.py, bench.triton_aot's in
test_kernels_triton.py. The llama.cpp side of a comparison runs when llama-cpp-python is
installed and is reported as skipped, with its reason, when it is not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import llama_cpp_missing
from engine.runtime import fused_decode

ROOT = Path(__file__).resolve().parents[1]

LLAMA_MISSING = llama_cpp_missing()


def run_bench(name: str, *args: str, env: dict | None = None, timeout: int = 600) -> dict:
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    assert out.returncode == 0, f"bench.{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sparse_model(tmp_path_factory) -> Path:
    """bench.vs_llamacpp's model at its smoke shape (exact predictors), for the benchmarks
    that take --model."""
    from bench.vs_llamacpp import SHAPES, build

    return build(tmp_path_factory.mktemp("bench"), SHAPES["smoke"], 2, 8, 0.1, 0, quantize=False)["hf"]


@pytest.mark.timeout(1200)  # a file's first test alone (no prewarm): on a fresh clone it compiles the CPU kernels
def test_sparse_decode():
    """A many-token prefill with drawn active sets (the crash of issue #30), then the three modes."""
    report = run_bench("sparse_decode", "--smoke", "--json", timeout=1150)
    assert 0.02 < report["ffn_active_fraction"] < 0.3  # the drawn sets' 10%, not the predictor's choice
    assert min(report["dense_tok_s"], report["sparse_tok_s"], report["hybrid_tok_s"]) > 0
    assert 0 < report["hot_hit_fraction"] < 1


def test_vs_llamacpp(tmp_path):
    report = run_bench("vs_llamacpp", "--smoke", "--json", "--ours", "sparse:int4", "--llama", "Q4_0",
                       "--workdir", str(tmp_path))
    ours = report["ours"]["sparse:int4"]
    assert ours["decode_tok_s"] > 0 and 0 < ours["ffn_active_fraction"] < 0.5
    # issue #30: the int4 tier's predictors select what their fp32 original selects
    assert ours["selected_vs_original"] <= 1.15 and ours["recall_of_original"] >= 0.95
    assert report["llama_cpp_skipped"] == LLAMA_MISSING
    if LLAMA_MISSING is None:
        assert report["ratios_vs_Q4_0"]["sparse:int4"]["decode"] > 0


def test_smollm2_vs_llamacpp(tmp_path):
    """The real SmolLM2 GGUF (bench.real_models) against llama.cpp on the same file."""
    report = run_bench("smollm2_vs_llamacpp", "--smoke", "--json", "--workdir", str(tmp_path))
    assert report["ours"]["dense:int4"]["decode_tok_s"] > 0
    assert report["llama_cpp_skipped"] == LLAMA_MISSING
    if LLAMA_MISSING is None:
        assert report["llama_cpp_q4_1"]["decode_tok_s"] > 0 and report["ratios_vs_llama_cpp"]["dense:int4"]["decode"] > 0


def test_moe_vs_llamacpp(tmp_path):
    report = run_bench("moe_vs_llamacpp", "--smoke", "--json", "--pairs", "int4:Q4_0", "--workdir", str(tmp_path),
                       "--fused-ab", "8")
    assert report["llama_cpp_skipped"] == LLAMA_MISSING
    assert report["decode_tok_s"]["ours_int4"] > 0
    # the in-process A/B ran both paths, every mixture layer fused (where the fused decode runs)
    assert report["int4_fused_ms_per_token"] > 0 and report["int4_unfused_ms_per_token"] > 0
    assert report["int4_fused_moe_layers"] == (2 if fused_decode.module() is not None else 0)
    assert 0 < report["int4_fired_share_in_chosen"] < 1
    # the measured loads are second loads: the experts mapped from the MoE prepared file
    assert report["int4_prepared"] and report["int4_ttft_s"] > 0 and report["int4_load_rss_over_placed"] > 0
    if LLAMA_MISSING is None:
        assert report["top1_agree_int4_vs_Q4_0"] >= 0.5  # same weights, same forced tokens
        assert report["load_ratio_int4_vs_Q4_0"] > 0 and report["ttft_ratio_int4_vs_Q4_0"] > 0


def test_moe_decode():
    report = run_bench("moe_decode", "--smoke", "--json")
    assert report["same_greedy_ids"] and report["reads_within_bound"]


def test_load_q4():
    report = run_bench("load_q4", "--smoke", "--json")
    assert report["int4_second"]["prepared"] and not report["int4_unprepared"]["prepared"]
    assert report["int4_second"]["decode_tok_s"] > 0 and report["dense_fp32"]["decode_tok_s"] > 0


def test_fused_decode(sparse_model):
    report = run_bench("fused_decode", "--model", str(sparse_model), "--rounds", "1", "--tokens", "3", "--json")
    assert report["same_tokens"] and all(report["fused_calls"])


def test_load_split(sparse_model):
    report = run_bench("load_split", "--model", str(sparse_model), "--rounds", "1")
    assert report["best_load"]["load_s"] > 0 and len(report["rounds"]) == 1


def test_decode():
    report = run_bench("decode", "--hidden", "64", "--layers", "2", "--ff", "128", "--vocab", "512",
                       "--prompt-tokens", "8", "--new-tokens", "4", "--repeats", "1", "--json")
    assert report["ours_tok_s"] > 0 and report["transformers_tok_s"] > 0


def test_kv_cache():
    report = run_bench("kv_cache", "--layers", "2", "--heads", "4", "--kv-heads", "4", "--head-dim", "16",
                       "--contexts", "32", "--repeats", "1", "--json")
    assert report["per_token_bytes"] == {"fp32": 2 * 2 * 4 * 16 * 4, "fp16": 2 * 2 * 4 * 16 * 2}


def test_placement():
    report = run_bench("placement", "--smoke", "--repeats", "1", "--json")
    assert 0 < report["smoke"]["hot_hit_fraction"] <= 1


def test_kernel_cases():
    report = run_bench("kernel_cases", "--backends", "numba", "--repeats", "1", "--json")
    assert report["results"] and all(r["error"] <= r["tol"] for r in report["results"])


def test_serve(tmp_path):
    # the power-law model --shape builds (tiny), served in the sparse mode: the 7B run's path
    report = run_bench("serve", "--shape", "smoke", "--workdir", str(tmp_path), "--mode", "sparse", "--rounds", "1",
                       "--clients", "2", "--requests", "2", "--max-tokens", "4", "--json")
    assert report["pairs"] == 8 and report["concurrency"][0]["requests"] == 2
    assert 0.1 < report["union_of_8_expected"] < 1 - 0.9 ** 8  # hot neurons shared: below a uniform draw's union


def test_grammar():
    report = run_bench("grammar", "--tokens", "20")
    assert report["llguidance"]["tokens"] > 0 and report["llguidance"]["mask_ms"] > 0


def test_triton_tune():
    pytest.importorskip("triton")
    report = run_bench("triton_tune", "--smoke", "--json", env={"TRITON_INTERPRET": "1"})
    assert report["layers"] and report["layers"][0]["best"]


def test_hybrid():
    """bench.hybrid on the CPU stand-in: the offload baseline computes every neuron, the
    hybrid placement serves more of them from the fast tier at the same VRAM, and both
    agree with the all-CPU decode."""
    report = run_bench("hybrid", "--smoke", "--json")
    assert [b["vram_share_of_ffn"] for b in report["budgets"]] == [0.25, 0.5]
    for b in report["budgets"]:
        hybrid, offload = b["hybrid"], b["offload"]
        assert offload["ffn_active_fraction"] == 1.0 and hybrid["ffn_active_fraction"] < 0.3
        assert hybrid["served_hot_fraction"] > offload["served_hot_fraction"]
        assert hybrid["vram_bytes"] <= b["vram_budget"] and offload["vram_bytes"] <= b["vram_budget"]
        assert min(hybrid["cosine_vs_cpu"], offload["cosine_vs_cpu"]) > 0.999
    assert report["budgets"][1]["offload"]["layers_whole_on_fast"] >= 1


@pytest.mark.timeout(1600)
def test_first_start():
    """The README's first command on an empty kernel cache (the terminal chat: no display), and
    the window under Xvfb where xvfb-run is here; the sessions do not wait for the background
    compile (--smoke)."""
    report = run_bench("first_start", "--rounds", "1", "--smoke", timeout=1500)
    one = report["rounds"][0]
    first = one["terminal_first"]
    assert first["empty_cache"] and first["kernel_line"].startswith("(preparing fast CPU kernels for this machine")
    assert 0 < first["prompt_s"] < first["first_token_s"] <= first["answer_done_s"]
    assert len(one["load_avg_before"]) == 3 and "terminal_second" not in one
    if report["window"] == "measured":
        window = one["window_first"]
        assert window["empty_cache"] and window["kernels_preparing_at_answer"]
        assert window["kernel_item"].startswith("Preparing fast CPU kernels")
        assert 0 < window["shown_s"] <= window["model_ready_s"] < window["first_token_s"]
        assert "loaded" not in window["status_text"].lower()


def test_beyond_ram():
    """bench.beyond_ram at tiny shapes: the disk runs decode the in-RAM run's tokens, read from
    disk, keep the engine's bytes within their budgets and (as root) run in a memory cgroup;
    llama.cpp's runs under the same limits come back (or are reported killed at the limit)."""
    report = run_bench("beyond_ram", "--smoke", "--json", timeout=1500)
    runs = report["runs"]
    assert runs["in_ram"]["decode_tok_s"] > 0 and runs["in_ram"]["cache_hit_share"] == 1.0
    assert report["same_tokens_as_in_ram"]
    for name in ("disk_50", "disk_90", "disk_50_lookahead", "disk_90_lookahead", "disk_50_no_lookahead",
                 "disk_90_no_lookahead", "disk_min"):
        run = runs[name]
        assert run["verdict"] == "runs from disk" and run["decode_tok_s"] > 0
        assert run["engine_ram_bytes"] <= run["ram_budget"]
        assert 0 <= run["cache_hit_share"] <= 1 and run["engine_read_per_token"] >= 0
        assert (run["cgroup"] is not None) == (report["cgroup"] == "ok")
    assert [runs[f"disk_50{k}"]["breakdown"]["lookahead"] for k in ("", "_lookahead", "_no_lookahead")] == \
        ["auto", "always", "never"]
    assert runs["disk_50_lookahead"]["breakdown"]["read_ahead_per_token"] > 0
    assert runs["disk_50_no_lookahead"]["breakdown"]["read_ahead_per_token"] == 0
    assert report["ratios"]["disk_50_engine_bytes_within_budget"] and report["ratios"]["disk_90_engine_bytes_within_budget"]
    assert report["budgets"]["disk_90"] < report["budgets"]["disk_50"] < report["sizes"]["placed"]
    if LLAMA_MISSING is None:
        for name in ("llama_50", "llama-norepack_50", "llama_90", "llama-norepack_90"):
            assert runs[name]["killed"] or runs[name]["decode_tok_s"] > 0
