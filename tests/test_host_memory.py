"""Huge-page backed CPU tensors: same contents and semantics as torch.empty's, and on Linux
with transparent huge pages enabled, really backed by huge pages."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import host_memory
from engine.kernels import cpu

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _smaps_kb(address: int, field: str) -> int:
    """`field` (e.g. AnonHugePages) of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == field + ":":
            return int(line.split()[1])
    return 0


def _anon_huge_kb(address: int) -> int:
    return _smaps_kb(address, "AnonHugePages")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32, torch.bfloat16])
def test_large_tensor_is_aligned_writable_and_copies_exactly(dtype):
    src = torch.randn(1024, 3000).to(dtype)  # > 2 MB in every dtype
    t = host_memory.copy_of(src)
    assert t.shape == src.shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, src)
    if host_memory._SUPPORTED:
        assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    before = src.clone()
    t[3, 5] = 7  # writable, and a copy
    assert torch.equal(src, before) and t[3, 5] == 7


def test_small_tensor_and_gather_rows():
    src = torch.randn(64, 16)
    assert host_memory.empty((4, 4), torch.float32).shape == (4, 4)
    ids = torch.tensor([5, 0, 63, 5])
    assert torch.equal(host_memory.gather_rows(src, ids), src[ids])
    big = torch.randn(4096, 512)
    ids = torch.randperm(4096)[:2048]
    assert torch.equal(host_memory.gather_rows(big, ids), big[ids])


def test_mapping_outlives_its_views():
    t = host_memory.copy_of(torch.arange(1 << 20, dtype=torch.float32))
    view = t[10:20].numpy()
    del t
    gc.collect()
    assert view.tolist() == list(range(10, 20))


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are not available")
def test_cold_rows_are_on_huge_pages():
    d, n = 1024, 8192  # 8 MB of int8 per matrix
    w = torch.randn(n, d)
    rows = cpu.CpuFfnRows.from_dense(w, w, w, quant="int8")
    assert _anon_huge_kb(rows.up.data_ptr()) >= 2048
    picked = rows.select(torch.arange(0, n, 2))
    assert _anon_huge_kb(picked.down_t.data_ptr()) >= 2048


def test_map_file_is_a_copy_on_write_view_of_the_file(tmp_path):
    path = tmp_path / "blob.bin"
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    mapped = host_memory.map_file(path)
    assert mapped.size == data.numel() and mapped.flags.writeable
    assert torch.equal(torch.from_numpy(mapped), data)
    mapped[7] ^= 0xFF  # a private copy of that page; the file keeps its bytes
    assert path.read_bytes()[7] == int(data[7])
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert host_memory.map_file(empty).size == 0


def test_file_pages_huge_reads_the_mapping_and_answers(tmp_path):
    """The probe faults the pages in and answers from smaps; a small or already-read view is
    never called huge."""
    path = tmp_path / "blob.bin"
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8)
    with open(path, "wb") as f:
        f.write(memoryview(data.numpy()))
    mapped = host_memory.map_file(path)
    huge = host_memory.file_pages_huge(mapped)
    assert isinstance(huge, bool)
    if huge:
        assert _file_pmd_kb(mapped.ctypes.data) >= 8 << 10
    assert host_memory.file_pages_huge(mapped) is False  # already mapped: nothing new to see
    assert host_memory.file_pages_huge(mapped[: 3 << 20]) is False  # under two huge pages
    assert torch.equal(torch.from_numpy(mapped), data)


def test_recache_huge_reads_a_just_written_file_back_in_huge_pages(tmp_path):
    """A file just written sits in the page cache in small folios; recache_huge drops a view's
    pages and reads them again through the mapping: the same bytes, and where it says True
    they are mapped in 2 MB pages, here and in a later mapping of the file (a later load)."""
    path = tmp_path / "blob.bin"
    data = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8)
    with open(path, "wb") as f:
        for lo in range(0, data.numel(), 64 << 10):  # small writes: small folios
            f.write(memoryview(data[lo:lo + (64 << 10)].numpy()))
    mapped = host_memory.map_file(path)
    view = mapped[(5 << 20) + 3:(21 << 20) + 5]
    np_sum = int(mapped[: 1 << 20].sum())  # a neighbour read before
    mapped[(5 << 20) + 1] ^= 0xFF  # a neighbour written (a private page) in the view's first huge page
    done = host_memory.recache_huge(view, path)
    assert isinstance(done, bool)
    assert int(mapped[(5 << 20) + 1]) == int(data[(5 << 20) + 1]) ^ 0xFF  # the write is kept
    mapped[(5 << 20) + 1] ^= 0xFF
    assert torch.equal(torch.from_numpy(mapped), data) and int(mapped[: 1 << 20].sum()) == np_sum
    if done:
        assert _file_pmd_kb(view.ctypes.data) >= 8 << 10
        later = host_memory.map_file(path)
        assert host_memory.file_pages_huge(later[(6 << 20):(20 << 20)]) is True
        assert torch.equal(torch.from_numpy(later), data)
    assert host_memory.recache_huge(data.numpy(), path) is False  # not a view of a file mapping


def _file_pmd_kb(address: int) -> int:
    return _smaps_kb(address, "FilePmdMapped")
