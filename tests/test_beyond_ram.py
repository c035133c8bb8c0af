"""The disk tier (engine.hotcold.neuron_cache): a RAM budget below the model's rows keeps the
cold rows on disk (neuron bundles beside the prepared file) behind a neuron cache, and
decodes the same bits as in RAM, whichever read path and overlap it takes."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from engine import BudgetError, Engine, SamplingParams
from engine.hotcold.activation_stats import ActivationStats
from engine.hotcold.placement import solve
from engine.hotcold.neuron_bundles import bundles_path
from engine.hotcold.neuron_cache import LOOKAHEAD_MISS_SHARE
from engine.loading.prepared import prepared_path

from test_prepared import FRESH
from test_sparse import PROMPT, RAM, random_predictors

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)


def _model(tmp_path, wide_llama_dir, threshold: float = 2.5):
    model = tmp_path / "m"
    shutil.copytree(wide_llama_dir, model, ignore=FRESH)
    config = Engine.load(model).config
    random_predictors(config, threshold=threshold).save(model)  # 2.5: about a tenth of the neurons a token
    g = torch.Generator().manual_seed(1)  # a power law of firing counts: a few neurons fire often
    counts = [(torch.rand(config.intermediate_size, generator=g) ** 6) * 100 for _ in range(config.num_layers)]
    ActivationStats(counts, tokens=100).save(model)
    return model


def _budget(engine, share: float) -> int:
    """`share` of the way from the least RAM budget that runs from disk (the resident parts
    with the embeddings on disk, the working set of slots, the reader's buffers) to the
    in-RAM placement of this (in-RAM) engine."""
    least = solve(engine.sparse.problem, 0, 0).min_ram_bytes
    return int(least + share * (engine.sparse.plan.ram_bytes - least))


def _step_logits(engine, ids: list[int]) -> list[torch.Tensor]:
    """Logits of each token fed alone (the decode path), from an empty cache; with the disk
    layer's calls in where numba compiles them (they compile behind the first decode)."""
    from engine.runtime import fused_decode

    engine.wait_kernels()
    fused_decode.wait_compiled_behind()
    engine.reset()
    engine.sparse.begin_generation()
    return [engine.model.forward(torch.tensor([t]), pos, engine.cache)[-1].clone() for pos, t in enumerate(ids)]


def _disk_calls(engine) -> list[int]:
    """Decode steps each layer ran as the fused decode's two calls around the cache's reads."""
    return [layer.fused.calls if layer.fused is not None and layer.fused.disk is not None else 0
            for layer in engine.model.layers]


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_disk_decodes_the_same_bits_as_ram(tmp_path, wide_llama_dir, fmt, fused, monkeypatch):
    # the same kernels on both sides: the unfused decode, or the fused one (a disk layer's two
    # calls around its reads against the in-RAM layer's one)
    monkeypatch.setenv("THERMOCLINE_FUSED_DECODE", fused)
    model = _model(tmp_path, wide_llama_dir)
    in_ram = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights=fmt)  # writes the prepared file
    in_ram.eos_ids = set()
    ids = PROMPT + in_ram.generate(PROMPT, GREEDY).token_ids
    reference = _step_logits(in_ram, ids)
    # half the cold rows cached: O_DIRECT reads (this test's folder is on a disk) and the next
    # layer read ahead; none cached: Windows' portable reads, each layer's misses when it misses,
    # and the default, which reads ahead once the misses are many (none cached: every one)
    for share, path, ahead in ((0.5, "o_direct", "1"), (0.0, "portable", "0"), (0.0, "o_direct", "auto")):
        monkeypatch.setenv("THERMOCLINE_DISK_READ_PATH", path)
        monkeypatch.setenv("THERMOCLINE_DISK_LOOKAHEAD", ahead)
        disk = Engine.load(model, mode="sparse", ram_budget=_budget(in_ram, share), cpu_weights=fmt)
        disk.eos_ids = set()
        cache = disk.sparse.neuron_cache
        assert cache is not None and disk.sparse.plan.verdict == "runs from disk"
        assert cache.reader.path_kind in ((path, "pread+nocache") if path == "o_direct" else (path,))
        got = _step_logits(disk, ids)
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
        assert _disk_calls(disk) == [len(ids) if fused == "1" else 0] * disk.config.num_layers
        assert cache.reader.bytes_read > 0 and cache.misses > 0 and cache.overflow_rounds == 0
        assert (cache.ahead_neurons > 0) == (ahead != "0")
        if ahead == "auto":
            assert cache.miss_share >= LOOKAHEAD_MISS_SHARE
        # the embeddings stay in the prepared file too (a token reads one row): mapped, not in RAM
        plan = disk.sparse.plan
        assert plan.embed_on_disk and disk.sparse.embed_mapped and disk.sparse.prepared_dense.holds(disk.model.embed)
        assert disk.memory()["tiers"]["cpu_dense"] == plan.tier_bytes["cpu_dense"]
        result = disk.generate(PROMPT, GREEDY)
        assert result.token_ids == ids[len(PROMPT):]
        hit, read = result.stats.cache_hit_fraction, result.stats.disk_read_bytes_per_token
        assert 0.0 < hit <= 1.0 and (hit < 1.0) == (read > 0)  # misses are read, hits are not
        assert disk.memory()["ram_bytes"] <= _budget(in_ram, share)
        disk.close()


def test_disk_calls_not_in_the_kernel_cache_compile_behind_the_decode(tmp_path, wide_llama_dir, monkeypatch):
    """A first run from disk where the in-RAM kernels are cached: the load's warm-up, which every
    computation waits for, does not compile the disk layer's two calls (minutes the first time
    on 2 cores: the window's placement waited for them). They compile on a thread of their own,
    once the unfused decode's kernels are loaded (a compile holds numba's compiler lock, which
    loading a kernel takes: a fresh process's first answer waited for the whole compile); the
    decode runs unfused meanwhile, takes them at a token's start once they are in, and decodes
    the same tokens."""
    from numba.core.compiler_lock import global_compiler_lock

    from engine.kernels import numba_pool
    from engine.runtime import engine as engine_module
    from engine.runtime import fused_decode

    model = _model(tmp_path, wide_llama_dir)
    in_ram = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int8")  # writes the prepared file
    budget = _budget(in_ram, 0.5)
    in_ram.close()
    release = threading.Event()
    run_calls, run_all = fused_decode._run_calls, engine_module._KernelWarmup.run_all
    order = []

    def held(calls):  # the compile behind, held (with numba's compiler lock, as a compile) until the answer is in
        if threading.current_thread().name == "thermocline-kernel-compile-behind":
            order.append("compile behind")
            with global_compiler_lock:
                assert release.wait(60)
        run_calls(calls)

    def loading_all(*args):
        order.append("unfused kernels")
        run_all(*args)

    monkeypatch.setattr(fused_decode, "_run_calls", held)
    monkeypatch.setattr(engine_module._KernelWarmup, "run_all", staticmethod(loading_all))
    monkeypatch.setattr(numba_pool, "loads_without_compiling", lambda *_args: False)  # not in numba's cache
    disk = Engine.load(model, mode="sparse", ram_budget=budget, cpu_weights="int8")
    disk.eos_ids = set()
    dl = fused_decode.kernels()
    try:
        first = disk.generate(PROMPT, GREEDY)  # waits for the load's warm-up, not for the compile behind
        assert order == ["unfused kernels", "compile behind"]
        assert _disk_calls(disk) == [0] * disk.config.num_layers
        assert not numba_pool.usable(dl.decode_layer_front, dl.decode_layer_rows)
        release.set()
        fused_decode.wait_compiled_behind()
        assert numba_pool.usable(dl.decode_layer_front, dl.decode_layer_rows)
        second = disk.generate(PROMPT, GREEDY)
        assert second.token_ids == first.token_ids
        assert all(calls > 0 for calls in _disk_calls(disk))
    finally:
        release.set()
        disk.close()


def test_a_failed_warm_up_leaves_no_call_set_aside(tmp_path, wide_llama_dir, monkeypatch):
    """The disk layer's calls set aside for the compile behind are given back when the load's
    warm-up fails after setting them aside: the load reports the failure, and a later load in
    the same process (the window loads again) sets them aside and compiles them afresh, where
    they would otherwise stay unusable, the decode unfused, for the rest of the process."""
    from engine.kernels import numba_pool
    from engine.runtime import engine as engine_module
    from engine.runtime import fused_decode

    model = _model(tmp_path, wide_llama_dir)
    in_ram = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int8")
    budget = _budget(in_ram, 0.5)
    in_ram.close()

    def failing_all(*_args):
        raise RuntimeError("the unfused kernels failed to load")

    monkeypatch.setattr(engine_module._KernelWarmup, "run_all", staticmethod(failing_all))
    monkeypatch.setattr(numba_pool, "loads_without_compiling", lambda *_args: False)  # not in numba's cache
    dl = fused_decode.kernels()
    disk = Engine.load(model, mode="sparse", ram_budget=budget, cpu_weights="int8")
    try:
        with pytest.raises(RuntimeError, match="unfused kernels failed"):
            disk.generate(PROMPT, GREEDY)
        assert numba_pool.usable(dl.decode_layer_front, dl.decode_layer_rows)
    finally:
        disk.close()
    monkeypatch.undo()
    monkeypatch.setattr(numba_pool, "loads_without_compiling", lambda *_args: False)
    again = Engine.load(model, mode="sparse", ram_budget=budget, cpu_weights="int8")
    try:
        again.eos_ids = set()
        again.wait_kernels()
        fused_decode.wait_compiled_behind()  # set aside again and compiled behind
        assert numba_pool.usable(dl.decode_layer_front, dl.decode_layer_rows)
        again.generate(PROMPT, GREEDY)
        assert all(calls > 0 for calls in _disk_calls(again))
    finally:
        again.close()


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_layer_beyond_the_cache_is_computed_chunk_by_chunk(tmp_path, wide_llama_dir, fmt, fused, monkeypatch):
    """At the least budget a layer whose predicted set (a third of its neurons here) exceeds
    the cache's working set (a quarter) is computed chunk by chunk as the kernel splits it
    over its 2 threads: the same bits as in RAM. With every neuron predicted, a chunk exceeds
    it too and is computed in rounds: the same neurons summed in another order, close. How
    close: a sum a few ulps off can round one 8-bit activation of a later product the other
    way (int8 on an AVX-512 host: one logit 1.4e-3 off, 5% of the format's own error), so the
    bound is a share of the format's error against the exact fp32 weights."""
    from engine.kernels import numba_pool

    monkeypatch.setenv("THERMOCLINE_FUSED_DECODE", fused)
    if numba_pool.num_threads() < 2:  # the split the chunks follow (CI has 2 cores)
        pytest.skip("one kernel thread: a layer is one chunk")
    ids = PROMPT + [3, 4, 5]
    for threshold, exact in ((0.8, True), (-1e9, False)):
        model = _model(tmp_path / str(exact), wide_llama_dir, threshold=threshold)
        in_ram = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights=fmt)
        reference = _step_logits(in_ram, ids)
        disk = Engine.load(model, mode="sparse", ram_budget=_budget(in_ram, 0.0), cpu_weights=fmt)
        got = _step_logits(disk, ids)
        cache = disk.sparse.neuron_cache
        assert cache.chunk_rounds > 0 and (cache.overflow_rounds == 0) == exact
        assert all(c == (len(ids) if fused == "1" else 0) for c in _disk_calls(disk))
        if exact:
            assert all(torch.equal(a, b) for a, b in zip(reference, got))
        else:
            exact_fp32 = _step_logits(Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="fp32"), ids)
            for a, b, e in zip(reference, got, exact_fp32):
                assert (a - b).abs().max() <= 0.1 * (a - e).abs().max()
        assert disk.memory()["ram_bytes"] <= _budget(in_ram, 0.0)
        disk.close()


def test_the_cache_pins_the_most_frequent_neurons_of_every_layer(tmp_path, wide_llama_dir):
    """The pins (never evicted) go to the most frequent hot neurons of all layers. Taken layer by
    layer, the first layers took them all: at 90% of 4 layers of 7B rows on disk the cache then
    served 65% of the firing neurons (bench.beyond_ram), 75% with the pins by rank."""
    model = _model(tmp_path, wide_llama_dir)
    config = Engine.load(model).config
    n = config.intermediate_size
    # every neuron hot (firing on 55-95% of tokens); every later layer's hotter than the first's
    spread = torch.arange(n, dtype=torch.float64) / n * 20
    counts = [55 + spread] + [75 + spread] * (config.num_layers - 1)
    ActivationStats(counts, tokens=100).save(model)
    probe = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")
    disk = Engine.load(model, mode="sparse", ram_budget=_budget(probe, 0.2), cpu_weights="int4")
    cache = disk.sparse.neuron_cache
    pinned = np.flatnonzero(cache.pinned)
    assert 0 < len(pinned) < n  # fewer pins than one layer's neurons: the rank decides
    rates = [c.numpy() for c in counts]
    got = [rates[layer][pos] for layer, pos in zip(cache.slot_layer[pinned], cache.slot_pos[pinned])]
    unpinned = [rates[layer][pos] for layer, pos in zip(cache.slot_layer[~cache.pinned], cache.slot_pos[~cache.pinned])
                if layer >= 0]
    assert min(got) >= max(unpinned)
    disk.close()


def test_cache_never_exceeds_its_budget_and_resizes_between_tokens(tmp_path, wide_llama_dir):
    model = _model(tmp_path, wide_llama_dir)
    probe = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")
    big, small = _budget(probe, 0.6), _budget(probe, 0.15)
    engine = Engine.load(model, mode="sparse", ram_budget=big, cpu_weights="int4")
    engine.eos_ids = set()
    cache = engine.sparse.neuron_cache
    sizes = []
    moved = []

    for i, _ in enumerate(engine.stream(PROMPT, SamplingParams(max_new_tokens=8, temperature=0))):
        sizes.append(cache.capacity)
        assert engine.memory()["ram_bytes"] <= (big if i < 4 else max(big, small))
        assert cache.used() <= cache.capacity
        if i == 3:
            moved.append(engine.set_budgets(ram=small))  # between two tokens of the generation
    assert sizes[0] > sizes[-1] == engine.sparse.plan.cache_neurons
    assert engine.memory()["ram_bytes"] <= small
    assert cache.nbytes == engine.memory()["tiers"]["cpu_ffn"]
    report = engine.set_budgets(ram=big)
    assert report.applied and cache.capacity == sizes[0]


def test_a_slider_move_from_ram_onto_the_disk_tier_and_back(tmp_path, wide_llama_dir, monkeypatch):
    """A load with every cold row in RAM, moved below them: its embeddings are mapped, a
    neuron cache takes the cold rows, and it decodes the same bits; moved back up, the cache
    holds every cold neuron. The engine's bytes (the reader's buffers with the cache's) stay
    within each budget."""
    monkeypatch.setenv("THERMOCLINE_FUSED_DECODE", "0")
    model = _model(tmp_path, wide_llama_dir)
    Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4").close()  # writes the prepared files
    engine = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")  # maps them
    engine.eos_ids = set()
    ids = PROMPT + engine.generate(PROMPT, GREEDY).token_ids
    reference = _step_logits(engine, ids)
    assert engine.sparse.neuron_cache is None and not engine.sparse.embed_mapped
    low = _budget(engine, 0.3)
    report = engine.set_budgets(ram=low)
    cache = engine.sparse.neuron_cache
    assert report.applied and report.verdict == "runs from disk" and cache is not None
    assert engine.sparse.embed_mapped and cache.capacity == engine.sparse.plan.cache_neurons
    assert cache.reader.buffer_bytes > 0 and cache.nbytes == engine.memory()["tiers"]["cpu_ffn"]
    assert engine.memory()["ram_bytes"] <= low
    assert all(torch.equal(a, b) for a, b in zip(reference, _step_logits(engine, ids)))
    assert cache.misses > 0 and cache.overflow_rounds == 0
    assert engine.memory()["ram_bytes"] <= low
    cold = sum(len(c) for c in cache.cold_ids)
    report = engine.set_budgets(ram=RAM)  # back up: every cold neuron in the cache
    assert report.applied and report.verdict != "runs from disk" and cache.capacity == cold
    assert all(torch.equal(a, b) for a, b in zip(reference, _step_logits(engine, ids)))
    assert engine.memory()["ram_bytes"] <= RAM and engine.memory()["ram_bytes"] == engine.sparse.plan.ram_bytes
    engine.close()


def test_a_budget_below_the_resident_parts_is_one_error_line(tmp_path, wide_llama_dir):
    model = _model(tmp_path, wide_llama_dir)
    probe = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")
    least = solve(probe.sparse.problem, 0, 0).min_ram_bytes - 1  # the resident parts and the working set, less 1
    with pytest.raises(BudgetError, match="resident parts"):
        Engine.load(model, mode="sparse", ram_budget=least, cpu_weights="int4")
    run = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--model", str(model), "--mode", "sparse",
                          "--cpu-weights", "int4", "--ram-budget", str(least), "--prompt", "hi",
                          "--max-new-tokens", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "at least" in lines[0]


def test_kill_while_reading_leaves_nothing_to_heal(tmp_path, wide_llama_dir):
    model = _model(tmp_path, wide_llama_dir)
    probe = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")
    budget = _budget(probe, 0.1)
    probe.close()
    Engine.load(model, mode="sparse", ram_budget=budget, cpu_weights="int4").close()  # writes the bundles
    path = prepared_path(model, "int4")
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (path, bundles_path(path))]
    files = sorted(p.name for p in path.parent.iterdir())
    code = (f"from engine import Engine, SamplingParams\n"
            f"e = Engine.load({str(model)!r}, mode='sparse', ram_budget={budget}, cpu_weights='int4')\n"
            f"e.eos_ids = set()\nprint('reading', flush=True)\n"
            f"while True:\n    e.generate([1, 2, 3], SamplingParams(max_new_tokens=50, temperature=0))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "reading"
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in (path, bundles_path(path))] == before
    assert sorted(p.name for p in path.parent.iterdir()) == files
    again = Engine.load(model, mode="sparse", ram_budget=budget, cpu_weights="int4")
    assert again.sparse.prepared_path == path and again.sparse.neuron_cache is not None  # mapped, not rebuilt
    assert np.isfinite(again.generate(PROMPT, GREEDY).stats.decode_tok_s)


def test_a_cut_bundles_file_is_rebuilt_and_decodes_the_same(tmp_path, wide_llama_dir, monkeypatch):
    monkeypatch.setenv("THERMOCLINE_FUSED_DECODE", "0")
    model = _model(tmp_path, wide_llama_dir)
    probe = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")
    budget = _budget(probe, 0.3)
    probe.close()
    first = Engine.load(model, mode="sparse", ram_budget=budget, cpu_weights="int4")
    first.eos_ids = set()
    expected = first.generate(PROMPT, GREEDY).token_ids
    first.close()
    bundles = bundles_path(prepared_path(model, "int4"))
    whole = bundles.read_bytes()
    with open(bundles, "r+b") as f:  # cut in the middle of the last layer
        f.truncate(len(whole) - len(whole) // 7)
    again = Engine.load(model, mode="sparse", ram_budget=budget, cpu_weights="int4")
    again.eos_ids = set()
    assert bundles.read_bytes() == whole  # rebuilt from the prepared file
    assert again.generate(PROMPT, GREEDY).token_ids == expected


def test_three_tiers_hot_on_the_fast_device_cold_in_the_cache_and_on_disk(tmp_path, wide_llama_dir, monkeypatch):
    """VRAM (hot neurons), RAM (resident parts and the neuron cache) and disk at once: the
    hybrid mode with a VRAM budget for a share of the neurons and a RAM budget below the cold
    rows decodes the same bits as the same VRAM budget with every cold row in RAM. On the
    GPU under bench/gpu.sh; here the CPU stands in for the fast device."""
    monkeypatch.setenv("THERMOCLINE_FUSED_DECODE", "0")
    model = _model(tmp_path, wide_llama_dir)
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=RAM, cpu_weights="int4")
    problem = probe.sparse.problem
    dense_fast = problem.head_fast + sum(c.dense_fast + c.kv_fast for c in problem.layers)
    vram = dense_fast + problem.neuron_fast * len(problem.layers) * 8  # about 8 hot neurons a layer
    probe.close()
    in_ram = Engine.load(model, mode="hybrid", vram_budget=vram, ram_budget=RAM, cpu_weights="int4")
    in_ram.eos_ids = set()
    assert sum(len(ids) for ids in in_ram.sparse.plan.hot_ids) > 0
    ids = PROMPT + in_ram.generate(PROMPT, GREEDY).token_ids
    reference = _step_logits(in_ram, ids)
    plan = in_ram.sparse.plan
    floor = solve(in_ram.sparse.problem, vram, 0)
    budget = int(floor.min_ram_bytes + 0.3 * (plan.ram_bytes - floor.min_ram_bytes))
    disk = Engine.load(model, mode="hybrid", vram_budget=vram, ram_budget=budget, cpu_weights="int4")
    disk.eos_ids = set()
    assert disk.sparse.plan.verdict == "runs from disk" and disk.sparse.neuron_cache is not None
    assert [len(a) for a in disk.sparse.plan.hot_ids] == [len(a) for a in plan.hot_ids]
    got = _step_logits(disk, ids)
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    assert disk.sparse.neuron_cache.misses > 0
    assert disk.memory()["ram_bytes"] <= budget
