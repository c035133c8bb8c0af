"""CPU sparse FFN kernels: what the kernel case table (tests/kernel_cases.py, which checks
every path's numerics against an fp64 FFN) does not: the rows a kernel must not read, the row
storage, refusals, threads, numba's cache, the prefill kernel against the decode kernel and the
dispatch between them, the engine's first answer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.kernels import cpu, numba_pool, reference
from engine.kernels.cpu_quant import dequantize_rows_int8, quantize_rows_int8
from kernel_cases import as_q8, ffn_reference, relative_error

ACTS = ("relu", "fatrelu", "drelu", "relu2")
FAT_THRESHOLD = 0.1

needs_numba = pytest.mark.skipif(not cpu.available(), reason="numba missing or disabled")


def _rows(n, d, gated, seed):
    g = torch.Generator().manual_seed(seed)
    scale = d ** -0.5  # unit-variance pre-activations, so fatrelu's threshold bites
    gate = torch.randn(n, d, generator=g) * scale if gated else None
    up = torch.randn(n, d, generator=g) * scale
    down_t = torch.randn(n, d, generator=g)
    x = torch.randn(d, generator=g)
    return x, gate, up, down_t, g


def _same_rows_close(y, y_ref):
    """Two kernel results over the same rows, summed in another order (other chunking or
    vectorisation): equal up to fp32 rounding relative to the output's scale."""
    scale = float(y_ref.abs().max()) + 1e-6
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("activation", ACTS)
def test_reference_matches_dense(activation):
    """engine.kernels.reference (the torch fallback's computation, the benchmarks' baseline)
    against the kernel table's fp64 reference, under the table's measure and bound."""
    n, d = 200, 96
    x, gate, up, down_t, g = _rows(n, d, True, 3)
    perm = torch.randperm(n, generator=g)
    for active in (None, torch.empty(0, dtype=torch.long), torch.tensor([n - 1]), perm[: n // 20].sort().values,
                   perm[: n // 5].to(torch.int32)):
        selected = torch.ones(n, dtype=torch.bool) if active is None else \
            torch.zeros(n, dtype=torch.bool).index_fill_(0, active.long(), True)
        ref = ffn_reference(x, gate, up, down_t, selected, activation, FAT_THRESHOLD)
        y = reference.sparse_ffn(x, gate, up, down_t, active, activation, FAT_THRESHOLD)
        assert relative_error(y, ref.y, ref.scale) <= 1e-4
    ref = ffn_reference(x, gate, up, down_t, None, activation, FAT_THRESHOLD)
    dense = reference.dense_ffn(x, gate, up, down_t, activation, FAT_THRESHOLD)
    assert relative_error(dense, ref.y, ref.scale) <= 1e-4


@needs_numba
@pytest.mark.parametrize("quant", cpu.QUANTS)
def test_kernel_reads_only_rows_it_needs(quant):
    """Poison (NaN) every row the kernel must not read: rows outside `active`, up rows of
    neurons whose gate is 0 and down rows of neurons whose activation is 0. A read of any
    of them turns y or the activations into NaN."""
    n, d = 500, 320
    x, gate, up, down_t, g = _rows(n, d, True, 11)
    active = torch.randperm(n, generator=g)[:150].sort().values
    rows = cpu.CpuFfnRows.from_dense(gate, up, down_t, quant=quant)
    gate, up, down_t = (t.clone() for t in rows.dequantized())
    a_all = ffn_reference(x, gate, up, down_t, None, "relu", 0.0).acts
    g_all = gate.double() @ x.double()
    inside = torch.zeros(n, dtype=torch.bool)
    inside[active] = True
    y_clean = cpu.sparse_ffn(x, rows, active, "relu")
    poison = {"gate": ~inside, "up": ~inside | (g_all <= 0), "down_t": ~inside | (a_all == 0)}
    assert poison["down_t"][active].any(), "test needs predicted neurons that do not fire"
    for name, bad in poison.items():
        if quant == "fp32":
            getattr(rows, name)[bad] = float("nan")
        else:
            getattr(rows, {"down_t": "down"}.get(name, name) + "_scale")[bad] = float("nan")
    acts = torch.empty(active.numel())
    y = cpu.sparse_ffn(x, rows, active, "relu", out_acts=acts)
    assert torch.isfinite(y).all() and torch.isfinite(acts).all()
    torch.testing.assert_close(y, y_clean, rtol=0, atol=0)


def test_quantizer_error_bound_and_zero_rows():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(37, 129, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    w[4] = 0.0
    for src in (w, w.to(torch.bfloat16), w.to(torch.float16)):
        q, s = quantize_rows_int8(src)
        assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (37,)
        assert q.abs().max() <= 127 and s[4] == 0 and (q[4] == 0).all()
        ref = src.float()
        torch.testing.assert_close(s, ref.abs().amax(1) / 127)
        err = (dequantize_rows_int8(q, s) - ref).abs()
        assert (err <= s[:, None] * 0.5 * (1 + 1e-5) + 1e-30).all()
        # the row maximum maps to +-127 exactly
        assert (q.abs().amax(1)[s > 0] == 127).all()


@needs_numba
def test_quantizer_numba_equals_torch(monkeypatch):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(1100, 200, generator=g) * torch.logspace(-4, 3, 1100)[:, None]
    w[7] = 0.0
    w[9, :5] = torch.tensor([0.5, -0.5, 1.5, 2.5, -127.5]) * (w[9].abs().max() / 127)
    fast = quantize_rows_int8(w)
    monkeypatch.setattr(numba_pool, "_numba", False)
    slow = quantize_rows_int8(w)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_rows_storage_select_and_nbytes():
    n, d = 90, 48
    x, gate, up, down_t, g = _rows(n, d, True, 2)
    i8 = cpu.CpuFfnRows.from_dense(gate, up, down_t, quant="int8")
    f32 = cpu.CpuFfnRows.from_dense(gate, up, down_t, quant="fp32")
    assert (i8.n_neurons, i8.dim, f32.n_neurons, f32.dim) == (n, d, n, d)
    assert i8.nbytes == 3 * n * d + 3 * n * 4 and f32.nbytes == 3 * n * d * 4
    ungated = cpu.CpuFfnRows.from_dense(None, up, down_t, quant="int8")
    assert not ungated.gated and ungated.nbytes == 2 * n * d + 2 * n * 4
    up[0, 0] = 1e6  # from_dense copies
    assert f32.up[0, 0] != 1e6
    ids = torch.tensor([7, 3, 88, 40])
    for rows in (i8, f32):
        sub = rows.select(ids)
        assert sub.n_neurons == 4 and sub.quant == rows.quant
        for a, b in zip(sub.dequantized(), rows.dequantized()):
            torch.testing.assert_close(a, b[ids])
        # local ids into the subset compute the same neurons as global ids into the whole
        acts_sub, acts_all = torch.empty(2), torch.empty(2)
        y_sub = cpu.sparse_ffn(x, sub, torch.tensor([1, 3]), "relu", out_acts=acts_sub)
        y_all = cpu.sparse_ffn(x, rows, torch.tensor([3, 40]), "relu", out_acts=acts_all)
        _same_rows_close(y_sub, y_all)
        torch.testing.assert_close(acts_sub, acts_all)
        with pytest.raises(IndexError):
            rows.select(torch.tensor([n]))


def test_bad_inputs_are_refused():
    n, d = 40, 16
    x, gate, up, down_t, _ = _rows(n, d, True, 1)
    rows = cpu.CpuFfnRows.from_dense(gate, up, down_t, quant="int8")
    with pytest.raises(ValueError):
        cpu.sparse_ffn(x, rows, torch.tensor([1, 2]), "gelu")
    with pytest.raises(ValueError):
        cpu.sparse_ffn(x[:-1], rows, None, "relu")
    with pytest.raises(ValueError):
        cpu.sparse_ffn(x, rows, torch.tensor([1.0]), "relu")
    with pytest.raises(ValueError):
        cpu.sparse_ffn(x, rows, torch.tensor([1, 2]), "relu", out_acts=torch.empty(3))
    with pytest.raises(IndexError):
        cpu.sparse_ffn(x, rows, torch.tensor([0, n]), "relu")
    with pytest.raises(ValueError):
        cpu.CpuFfnRows.from_dense(gate, up, down_t, quant="fp16")
    with pytest.raises(ValueError):  # int8 rows without scales
        cpu.CpuFfnRows(None, rows.up, rows.down_t, quant="int8")
    with pytest.raises(ValueError):  # [n] logits for 25 rows, no row ids
        cpu.sparse_ffn_predicted(x, rows.select(torch.arange(25)), torch.randn(n), 0.5, "relu")


@needs_numba
def test_concurrent_calls_from_threads():
    n, d = 400, 256
    x, gate, up, down_t, g = _rows(n, d, True, 4)
    rows = cpu.CpuFfnRows.from_dense(gate, up, down_t, quant="int8")
    active = torch.randperm(n, generator=g)[:100].sort().values
    expected = cpu.sparse_ffn(x, rows, active, "relu")
    results, errors = [], []

    def work():
        try:
            for _ in range(30):
                results.append(cpu.sparse_ffn(x, rows, active, "relu"))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 90
    assert all(torch.equal(r, expected) for r in results)  # fixed-order reduction


@needs_numba
def test_set_num_threads_applies_to_every_calling_thread():
    import numba

    default = numba.config.NUMBA_NUM_THREADS
    x, gate, up, down_t, _ = _rows(64, 32, True, 8)
    rows = cpu.CpuFfnRows.from_dense(gate, up, down_t, quant="fp32")
    seen = []

    def work():
        y = cpu.sparse_ffn(x, rows, None, "relu")
        seen.append((numba.get_num_threads(), cpu.num_threads(), y))

    try:
        cpu.set_num_threads(1)
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert seen[0][:2] == (1, 1)
        torch.testing.assert_close(seen[0][2], cpu.sparse_ffn(x, rows, None, "relu"))
    finally:
        cpu.set_num_threads(default)


def test_set_num_threads_below_a_tuners_running_count_runs_no_more(monkeypatch):
    """An engine's thread tuner left the pool running 2; a later set_num_threads(1) is obeyed
    (the suite's order once ran this file's test above after such an engine)."""
    from engine.kernels import numba_pool

    if not cpu.available() or numba_pool.configured_threads() < 2:
        pytest.skip("needs the numba kernels and 2 threads")
    monkeypatch.setattr(numba_pool, "_threads", None)
    with numba_pool.running_threads(2):
        test_set_num_threads_applies_to_every_calling_thread()


def test_env_disables_numba():
    code = ("from engine.kernels import cpu; import torch;"
            "r = cpu.CpuFfnRows.from_dense(None, torch.ones(4, 8), torch.ones(4, 8));"
            "y = cpu.sparse_ffn(torch.ones(8), r, torch.tensor([0, 2]), 'relu');"
            "print(cpu.available(), float(y[0]))")
    env = dict(os.environ, THERMOCLINE_NO_NUMBA="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "16.0"]


# quantize_act_q8: the module's quickest kernel to compile (ffn_rows took about 40 s a compile
# on a 2-core host, and the test compiles twice); any of its kernels shows the module's cache.
_CACHE_PROBE = textwrap.dedent("""
    import numpy as np, cpu_numba
    d = 4 * cpu_numba._ACT_BLOCK
    x = np.full((1, d), 2.0, np.float32); xq = np.zeros((1, d), np.int8); xs = np.zeros((1, 4), np.float32)
    cpu_numba.quantize_act_q8(x, xq, xs)
    assert xq.tolist() == [[127] * d] and np.allclose(xs * 127, 2.0), (xq, xs)
    s = cpu_numba.quantize_act_q8.stats
    print(type(cpu_numba.quantize_act_q8._cache).__name__, sum(s.cache_hits.values()))
""")


@pytest.mark.slow  # compiles the kernel module from scratch, twice (~3 min on 2 busy cores)
@needs_numba
def test_numba_disk_cache_unwritable_and_reused(tmp_path):
    """The kernel module imports and runs when no cache directory is writable (numba would
    raise at import), and reuses its disk cache when one is."""
    src = Path(cpu.__file__).with_name("cpu_numba.py")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    shutil.copy(src, pkg / "cpu_numba.py")
    (pkg / "__pycache__").write_text("a file where the cache directory would go")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    env = dict(os.environ, PYTHONPATH=str(pkg), PYTHONDONTWRITEBYTECODE="1",
               NUMBA_CACHE_DIR=str(blocker / "numba"), XDG_CACHE_HOME=str(blocker / "xdg"),
               HOME=str(blocker / "home"))

    def probe(env):
        out = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert probe(env) == ["NullCache", "0"]
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache")
    assert probe(env)[1] == "0"  # compiled and saved
    assert probe(env) == ["FunctionCache", "1"]  # loaded from disk


@needs_numba
@pytest.mark.skipif(os.name == "nt", reason="the check takes a second lock with fcntl")
def test_a_kernel_cache_save_holds_the_lock_beside_its_index(tmp_path, monkeypatch):
    """numba_jit's saves take the lock file beside a function's cache index, so two processes
    compiling one function at once cannot name the same data file for two signatures."""
    import fcntl
    import importlib.util

    from numba.core import caching

    (tmp_path / "lockprobe.py").write_text("from engine.kernels import numba_jit\n\n\n"
                                           "@numba_jit.njit()\ndef plus_one(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location("lockprobe", tmp_path / "lockprobe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    held = []
    save_index = caching.IndexDataCacheFile._save_index

    def probe(self, overloads):
        with open(f"{self._index_path}.lock", "a+b") as other:  # a second open: its own lock
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
                fcntl.flock(other.fileno(), fcntl.LOCK_UN)
            except BlockingIOError:
                held.append(True)
        return save_index(self, overloads)

    monkeypatch.setattr(caching.IndexDataCacheFile, "_save_index", probe)
    assert module.plus_one(1) == 2 and module.plus_one(1.5) == 2.5  # two signatures, two saves
    assert held == [True, True]


def test_bench_ffn_smoke():
    """bench.ffn runs end to end on a tiny shape and its last line is the JSON report (its
    kernels' results checked against the reference inside; no timing is asserted)."""
    import json

    out = subprocess.run([sys.executable, "-m", "bench.ffn", "--json", "--shapes", "tiny",
                          "--fractions", "0.1,0.5", "--repeats", "2", "--bandwidth-mib", "32"],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["machine_gbps"] > 0 and report["numba"] == cpu.available()
    rows = report["results"]
    assert [(r["quant"], r["active"]) for r in rows] == [
        ("int8", 0.1), ("fp32", 0.1), ("int8", 0.5), ("fp32", 0.5)]
    for r in rows:
        assert r["shape"] == "256x1024" and r["max_rel_err"] < 1e-4
        assert r["dense_ms"] > 0 and r["sparse_ms"] > 0 and r["touched_gbps"] > 0
        assert abs(r["fired"] - r["active_measured"]) < 0.05  # the drawn set fires
    assert report["targets"]["quant"] == "int8"


_FIRST_ANSWER_PROBE = textwrap.dedent("""
    from engine import Engine
    from models_registry.resolve import resolve_model
    from engine.kernels import cpu
    from engine.runtime.sampling import SamplingParams

    kern = cpu._kernels()
    fns = (kern.matvec_rows, kern.combine_rows, kern.ffn_rows)
    for mode in ("dense", "hybrid"):
        eng = Engine.load(resolve_model("demo"), mode=mode)
        eng.wait_kernels()  # the load's warm-up goes on on its thread: what it brings in is the load's
        before = [len(f.signatures) for f in fns]
        for _ in eng.stream("Mr. Darcy", SamplingParams(max_new_tokens=3)):
            pass
        new = [f.__name__ for f, n in zip(fns, before) if len(f.signatures) != n]
        print(mode, ",".join(new) or "-")
""")


@needs_numba
def test_engine_load_prepares_every_kernel_the_first_answer_runs():
    """Loading a model brings in every kernel specialisation decoding uses, so the first
    answer does not pay numba's compile or cache load (about 250 ms on the demo)."""
    out = subprocess.run([sys.executable, "-c", _FIRST_ANSWER_PROBE], capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["dense", "-", "hybrid", "-"], out.stdout


# (the int8 matvec's cases are rows of tests/kernel_cases.py)


# ---- int8 x int8 products (int8 activations in blocks) -------------------------------------
needs_q8 = pytest.mark.skipif(not cpu.int8_activations_available(128),
                              reason="no AVX2 host or numba: the int8-activation kernel does not run")


# The product against fp64 of the quantized activations: rows `matmul-int8-*` of tests/kernel_cases.py.


@pytest.mark.parametrize("n,d", [(3, 128), (8, 200), (8, 64)])
def test_matmul_int8_declines_shapes_it_does_not_cover(n, d):
    """Fewer than 4 rows, or d not a multiple of the activation block: None, and
    Int8Matrix.linear takes its other path to the same product."""
    from engine.kernels.quantized import Int8Matrix

    g = torch.Generator().manual_seed(d)
    m = Int8Matrix.quantize(torch.randn(n, d, generator=g))
    x = torch.randn(2, d, generator=g)
    assert cpu.matmul_int8(x, m.q, m.scale) is None
    ref = x.double() @ m.dequantize().double().T
    torch.testing.assert_close(m.linear(x).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_matmul_int8_without_numba_declines(monkeypatch):
    monkeypatch.setattr(numba_pool, "_numba", False)
    q, scale = cpu.quantize_rows_int8(torch.randn(8, 128))
    assert not cpu.int8_activations_available(128)
    assert cpu.matmul_int8(torch.randn(1, 128), q, scale) is None


@needs_q8
def test_int8_matrix_linear_uses_int8_activations_for_any_token_count():
    """Decode (1 token) and a prefill (many) give the same rows: each token's product does
    not depend on the others in the call."""
    from engine.kernels.quantized import Int8Matrix

    g = torch.Generator().manual_seed(3)
    m = Int8Matrix.quantize(torch.randn(300, 256, generator=g))
    x = torch.randn(37, 256, generator=g)
    many = m.linear(x)
    ones = torch.cat([m.linear(x[t : t + 1]) for t in range(37)])
    torch.testing.assert_close(many, ones, rtol=1e-6, atol=1e-6)
    ref = as_q8(x, 128) @ (m.q.double() * m.scale.double()[:, None]).T
    torch.testing.assert_close(many.double(), ref, rtol=1e-5, atol=1e-4)



@needs_q8
@pytest.mark.parametrize("n", [4, 7, 70])
def test_many_token_int8_product_gives_each_tokens_own_bits(n):
    """matmul_q8 over many tokens (on a VNNI target four and two a pass, the activations offset to
    unsigned bytes and the offset taken back per block) equals each token's product alone (the
    row-by-row pass) bit for bit: the same integer lanes summed in the same order. Token counts
    that take each pass (four, two, one) and run past a tile of tokens, and a last group of
    rows overlapping the one before it (n not a multiple of 4)."""
    kern = numba_pool.module()
    g = torch.Generator().manual_seed(n)
    q, scale = cpu.quantize_rows_int8(torch.randn(n, 384, generator=g))
    for tokens in (2, 3, 4, 6, 7, 8, 9, 14, 17):
        x = (torch.randn(tokens, 384, generator=g) * torch.rand(tokens, 384, generator=g) * 8).numpy()
        xq = np.empty(x.shape, dtype=np.int8)
        xs = np.empty((tokens, 3), dtype=np.float32)
        kern.quantize_act_q8(x, xq, xs)
        with numba_pool.lock:
            many = kern.matmul_q8(q.numpy(), scale.numpy(), xq, xs, 2)
            alone = [kern.matmul_q8(q.numpy(), scale.numpy(), xq[t:t + 1].copy(), xs[t:t + 1].copy(), 2)[0]
                     for t in range(tokens)]
        assert np.array_equal(many, np.stack(alone)), tokens


# ---- many tokens, each over its predicted rows (sparse prefill): against fp64, rows
# `tokens*` of tests/kernel_cases.py; here, against the decode kernel ---------------------
@needs_numba
@pytest.mark.parametrize("quant", cpu.QUANTS)
@pytest.mark.parametrize("T", [3, 12])
def test_sparse_ffn_tokens_equals_decoding_each_token(quant, T):
    """The prefill kernel computes what the decode kernel computes for each token alone,
    including over a subset of a layer's rows addressed by row ids (d 200: the fp32-activation
    kernels; int8 x int8 is checked against its fp64 reference above)."""
    n, d = 500, 200
    _, gate, up, down_t, g = _rows(n, d, True, 5)
    rows = cpu.CpuFfnRows.from_dense(gate, up, down_t, quant=quant)
    xs = torch.randn(T, d, generator=g)
    layer_logits = torch.randn(T, 2 * n, generator=g)
    ids = torch.randperm(2 * n, generator=g)[:n].sort().values
    ys = cpu.sparse_ffn_tokens(xs, rows, layer_logits[:, ids].contiguous(), 0.5, "relu")
    for t in range(T):
        y = cpu.sparse_ffn_predicted(xs[t], rows, layer_logits[t], 0.5, "relu", row_ids=ids)
        _same_rows_close(ys[t], y)


def test_tokens_take_the_decode_kernel_unless_their_rows_overlap():
    """Unrelated predictions (each token 10% of the rows) select most rows between them: one
    decode call per token reads less. Tokens that share their rows take one pass over them."""
    g = torch.Generator().manual_seed(3)
    n = 4000
    unrelated = (torch.rand(20, n, generator=g) < 0.1).float()
    shared = (torch.rand(n, generator=g) < 0.1).float().expand(20, n).contiguous()
    assert cpu.decode_each_token(20, n, unrelated, 0.5)
    assert not cpu.decode_each_token(20, n, shared, 0.5)
    assert cpu.decode_each_token(3, n, shared, 0.5)  # a few tokens: always per token
    assert not cpu.decode_each_token(20, n, None, 0.5)  # every row for every token


def test_sparse_ffn_tokens_refuses_bad_shapes():
    rows = cpu.CpuFfnRows.from_dense(None, torch.randn(10, 16), torch.randn(10, 16), quant="fp32")
    with pytest.raises(ValueError):
        cpu.sparse_ffn_tokens(torch.randn(3, 15), rows, None, 0.0, "relu")
    with pytest.raises(ValueError):
        cpu.sparse_ffn_tokens(torch.randn(3, 16), rows, torch.randn(3, 11), 0.0, "relu")
    with pytest.raises(ValueError):
        cpu.sparse_ffn_tokens(torch.randn(3, 16), rows, None, 0.0, "gelu")


# ---- decode attention over the 16-bit CPU KV cache: its cases are rows of tests/kernel_cases.py


def test_cpu_kv_cache_is_16_bit_and_clamps():
    from engine.model.kv_cache import KVCache

    assert KVCache(1, 2, 8, 16, [torch.float32], [torch.device("cpu")], cpu_16bit=False).k[0].dtype == torch.float32
    cache = KVCache(2, 2, 8, 16, [torch.float32, torch.float16], [torch.device("cpu")] * 2, cpu_16bit=True)
    assert cache.k[0].dtype == torch.float16 and cache.k[1].dtype == torch.float16
    assert cache.storage_dtype("cpu", torch.bfloat16) == torch.bfloat16
    assert cache.storage_dtype("cuda", torch.float32) == torch.float32
    k = torch.randn(2, 3, 8)
    k[0, 0, 0] = 1e6  # beyond fp16: stored as its largest finite value, not inf
    cache.prepare(0, 3)
    cache.write(0, k, -k, 0)
    keys, values = cache.keys_values(0, 3)
    assert torch.isfinite(keys).all() and float(keys[0, 0, 0]) == 65504.0
    torch.testing.assert_close(keys[1].float(), k[1], rtol=1e-3, atol=1e-3)
