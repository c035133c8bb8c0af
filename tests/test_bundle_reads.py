"""BundleReader (engine.hotcold.neuron_bundles): every read path puts each wanted bundle's
parts into its slots byte for byte, runs longer than one read call and runs spread over
threads included, and a cut file is an error, never stale bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.hotcold.neuron_bundles import HEADER_BYTES, BundleLayout, BundleReader, bundles_per_read, run_arrays

# an int8 tier's bundle: gate, up and down rows of 96 int8 weights, and their three fp32 scales
PARTS = [("gate", 96, "I8", 96), ("up", 96, "I8", 96), ("down_t", 96, "I8", 96),
         ("gate_scale", 4, "F32", 1), ("up_scale", 4, "F32", 1), ("down_t_scale", 4, "F32", 1)]
LAYERS, N = 3, 4000


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    layout = BundleLayout(PARTS, LAYERS, N)
    body = np.random.default_rng(0).integers(0, 256, size=(LAYERS, N, layout.bundle_bytes), dtype=np.uint8)
    path = tmp_path_factory.mktemp("bundles") / "rows.bundles"
    path.write_bytes(b"\0" * HEADER_BYTES + body.tobytes())
    return path, layout, body


def _pool(capacity: int) -> list[np.ndarray]:
    dtypes = {"I8": np.int8, "F32": np.float32}
    return [np.zeros((capacity, width) if width > 1 else capacity, dtype=dtypes[d]) for _, _, d, width in PARTS]


def _expected(layout, body, layer, ids, slots, capacity) -> list[np.ndarray]:
    out = _pool(capacity)
    for dest, (_, size, _, _), at in zip(out, layout.parts, layout.offsets):
        dest.view(np.uint8).reshape(capacity, -1)[slots] = body[layer, ids, at:at + size]
    return out


def test_run_arrays_splits_long_runs_and_joins_near_neighbours():
    ids = np.array([1, 2, 3, 10, 11, *range(30, 42), 100])
    firsts, counts = run_arrays(ids, gap=4, longest=5)
    assert list(zip(firsts.tolist(), counts.tolist())) == [(1, 3), (10, 2), (30, 5), (35, 5), (40, 2), (100, 1)]
    assert run_arrays(ids, gap=0)[1].tolist() == [3, 2, 12, 1]


@pytest.mark.parametrize("path_kind", ["o_direct", "pread+nocache", "portable"])
@pytest.mark.parametrize("threads", [1, 4])
def test_every_read_path_puts_the_same_bytes_in_the_same_slots(bundles, path_kind, threads, monkeypatch):
    path, layout, body = bundles
    monkeypatch.setenv("THERMOCLINE_DISK_READ_PATH", path_kind)
    reader = BundleReader(path, layout, threads)
    try:
        if path_kind == "o_direct" and reader.path_kind == "o_direct":
            assert reader._compiled() is not None  # the compiled reads, where numba is here
        rng = np.random.default_rng(threads)
        capacity = 3000
        # scattered ids, a dense stretch longer than one read call, and the layer's last bundle
        longest = bundles_per_read(layout.bundle_bytes, N)
        ids = np.unique(np.concatenate([rng.choice(N, 900, replace=False), np.arange(500, 500 + 3 * longest),
                                        [N - 1]]))
        slots = rng.permutation(capacity)[:len(ids)]
        pool = _pool(capacity)
        reader.read(2, ids, pool, slots, gap=3)
        for got, want in zip(pool, _expected(layout, body, 2, ids, slots, capacity)):
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8))  # random bytes: NaNs among the floats
        # only the runs' bundles were read (gaps of up to 3 bundles taken along), each once
        firsts, counts = run_arrays(ids, 3, longest)
        assert reader.bytes_read == int(counts.sum()) * layout.bundle_bytes and reader.calls == len(firsts)
    finally:
        reader.close()


def test_a_cut_bundles_file_is_an_error_not_stale_bytes(bundles, tmp_path):
    path, layout, body = bundles
    cut = tmp_path / "cut.bundles"
    cut.write_bytes(path.read_bytes()[: HEADER_BYTES + (2 * N + 100) * layout.bundle_bytes])
    reader = BundleReader(cut, layout, 4)
    try:
        pool = _pool(64)
        reader.read(1, np.arange(0, 64 * 50, 50), pool, np.arange(64), gap=0)  # whole: read
        with pytest.raises(OSError, match="short read"):
            reader.read(2, np.arange(50, 50 + 64 * 10, 10), pool, np.arange(64), gap=0)
    finally:
        reader.close()
    assert os.path.getsize(cut) < layout.file_bytes()


def test_the_compiled_reads_are_ready_before_the_first_read(bundles):
    """`warm` (at the load: neuron_cache.open_reader) compiles the very signature a read then
    takes, so the first token's reads compile nothing (in a fresh process, where nothing else
    compiled the reads before)."""
    path, layout, _ = bundles
    code = f"""
import numpy as np
from engine.hotcold.neuron_bundles import BundleLayout, BundleReader
from engine.kernels import direct_reads
layout = BundleLayout({PARTS!r}, {LAYERS}, {N})
reader = BundleReader({str(path)!r}, layout, 4)
if reader._compiled() is None:
    print("no compiled reads")
    raise SystemExit(0)
reader.warm()
warmed = len(direct_reads.read_runs.signatures)
pool = [np.zeros((64, w) if w > 1 else 64, dtype=np.int8 if d == "I8" else np.float32) for _, _, d, w in layout.parts]
reader.read(1, np.arange(0, 640, 10), pool, np.arange(64), 3)
print(warmed, len(direct_reads.read_runs.signatures))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() != "no compiled reads":  # this filesystem took O_DIRECT: the compiled path
        assert out.stdout.split() == ["1", "1"]
