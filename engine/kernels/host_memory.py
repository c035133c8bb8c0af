"""Large CPU tensors on transparent huge pages.

The cold FFN rows are read a few KB at a time at random places across hundreds of MB. With
4 KB pages almost every row read misses the TLB and walks the page tables, and between two
FFN calls the rest of the model streams through the caches and evicts the page-table
entries too, so the walk itself goes to DRAM. With 2 MB pages a 7B layer's cold rows fit in
the TLB. Measured on a 2-core EPYC (bench.ffn's 7B int8 layer, 10% active): 0.83 -> 0.69 ms.

Linux only, where the kernel honours `madvise(MADV_HUGEPAGE)` (transparent_hugepage
"always" or "madvise"); elsewhere, for small tensors, or when the mapping fails, a plain
`torch.empty`. The memory is an anonymous private mapping owned by the tensor: it is
unmapped when the last view of the tensor goes.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20
# Below one huge page there is nothing to gain and up to 2 MB of address space to pad.
MIN_BYTES = HUGE_PAGE
_SUPPORTED = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, huge-page backed when it is large enough."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not _SUPPORTED:
        return torch.empty(shape, dtype=dtype)
    try:
        # one huge page of slack to start the tensor on a huge-page boundary
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(shape, dtype=dtype)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: ordinary pages, still correct
        pass
    raw = np.frombuffer(region, dtype=np.uint8)  # the array keeps the mapping alive
    start = (-raw.ctypes.data) % HUGE_PAGE
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous CPU tensor that takes no memory until written: an anonymous mapping
    reads as zeros and the kernel gives it a page at the first write there, where torch.zeros
    writes every byte first. A KV cache costs its load nothing and its process only the
    positions a conversation reached (32 layers of 7B shapes at 512 positions: 268 MB that
    torch.zeros faulted in during the load). Small pages: a cache fills a position at a time
    across every head, and a huge page would be zeroed whole at its first position."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(np.frombuffer(region, dtype=np.uint8)).view(dtype).view(shape)


def return_free_heap() -> None:
    """Hand the C heap's free pages back to the kernel (glibc's malloc_trim, which runs without
    the GIL; nothing where the C library has none). After a first load dropped its converted
    copies (8 layers of 7B shapes, int4): 0.46 GB of anonymous memory left without it, 0.20
    GB with it. No gc.collect here: a full collection held the GIL for 0.27-0.8 s, a stall of
    the window's event loop while the engine loads on its thread."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: Windows, macOS, musl
        pass


def map_file(path) -> np.ndarray:
    """The whole file as a uint8 array over a copy-on-write mapping (numpy's memmap mode "c"),
    advised for huge pages. Where the page cache holds the file in 2 MB folios (ext4 and
    others since Linux 6.x, for files written in large writes or read through such a
    mapping) the kernel maps them whole: one TLB entry per 2 MB instead of 512. The advice
    also makes faults on pages not yet cached read 2 MB at a time, not the 4-128 KB pieces
    that random reads of scattered rows would otherwise leave in the cache. Measured on a
    2-core EPYC (7B int8 cold rows, ~1100 of 11008 neurons a call): 1.19 ms from 4 KB pages,
    1.01 ms from a 2 MB-mapped file, 1.00 ms from anonymous huge pages."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return np.empty(0, dtype=np.uint8)
        region = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # MAP_PRIVATE; Windows too
    if _SUPPORTED:
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(region, dtype=np.uint8)  # the array keeps the mapping alive


def copy_out_of_map(a: np.ndarray, out: torch.Tensor) -> None:
    """Copy `a`, a view of a `map_file` mapping, into the contiguous tensor `out`, then drop
    the view's pages from this process (the page cache keeps them). Read through the
    mapping, not with read(): pages not cached yet come in as 2 MB folios (the mapping's
    advice), which later loads then map whole; read() would cache them in small pieces."""
    out.numpy().reshape(-1).view(np.uint8)[:] = a.reshape(-1).view(np.uint8)
    region = _region_of(a)
    if region is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = a.ctypes.data - np.frombuffer(region, dtype=np.uint8).ctypes.data
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        try:
            region.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass


def _region_of(a: np.ndarray) -> mmap.mmap | None:
    """The mmap object under a view of a `map_file` array (None for other memory)."""
    region = a.base
    while region is not None and not isinstance(region, mmap.mmap):
        region = getattr(region, "obj", None) if isinstance(region, memoryview) else getattr(region, "base", None)
    return region


def recache_huge(a: np.ndarray, path, check: bool = True) -> bool:
    """Bring `a`, a view of a `map_file` mapping of `path`, into the page cache in 2 MB folios
    that the kernel maps whole, in place of the small folios a file just written (or copied)
    sits in; True when the pages inside `a` are now mapped in 2 MB pages (False: nothing to
    be done here, the caller copies). Its pages (widened to whole huge pages) are dropped
    from this process and from the page cache, then read again through the mapping, whose
    huge-page advice makes each fault read a 2 MB folio. Later loads find them so
    (`file_pages_huge`) and map them with no copy, until memory pressure evicts them (and a
    fault through the mapping then reads them back whole). Only clean pages mapped by no
    process are dropped: the file is synced first, and pages another process maps (or this
    one, past `a`'s ends) stay small (False when inside `a`). Measured on a 2-core EPYC VM
    (268 MiB of int8 attention matrices and head, a file just copied): 0.28-0.36 s, where
    copying them into fresh anonymous huge pages took 0.48-0.64 s (mostly first faults of
    fresh memory); a later load's probe then takes 0.02 s.
    `check=False` skips the answer's two reads of smaps_rollup (~10 ms each on a loaded
    process) and says True once the pages are read again: for the next matrices of a file
    whose first one came back in 2 MB pages."""
    region = _region_of(a)
    if region is None or not _SUPPORTED or not hasattr(os, "posix_fadvise") or a.nbytes == 0:
        return False
    addr = a.ctypes.data
    inner = (addr + a.nbytes) // HUGE_PAGE * HUGE_PAGE - -(-addr // HUGE_PAGE) * HUGE_PAGE
    if check and inner < HUGE_PAGE:
        return False  # too small to tell
    start = addr - np.frombuffer(region, dtype=np.uint8).ctypes.data
    lo = start // HUGE_PAGE * HUGE_PAGE  # the page cache's folios: widened to whole huge pages
    hi = min(-(-(start + a.nbytes) // HUGE_PAGE) * HUGE_PAGE, len(region))
    # this process's mappings of `a`'s own pages only: a neighbour's pages of this private
    # mapping are left alone (were one ever written, dropping it would lose the write)
    own_lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    own_hi = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if own_hi > own_lo:
            region.madvise(mmap.MADV_DONTNEED, own_lo, own_hi - own_lo)
        os.fdatasync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)  # pages still mapped stay (small)
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    before = _rollup_kb("FilePmdMapped") if check else 0
    if before is None:
        return False
    np.bitwise_or.reduce(a.reshape(-1).view(np.uint8)[::4096])  # fault them in again, 2 MB at a time
    if not check:
        return True
    after = _rollup_kb("FilePmdMapped")
    return after is not None and (after - before) * 1024 >= 0.9 * inner


def thp_available() -> bool:
    """Whether `empty` can get huge pages: Linux with transparent huge pages not `never`."""
    if not _SUPPORTED:
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def _rollup_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def file_pages_huge(a: np.ndarray) -> bool:
    """Touch every page of `a`, a view of a file mapping not read before, and say whether the
    kernel mapped it in 2 MB pages (the page cache held it in 2 MB folios): FilePmdMapped
    of /proc/self/smaps_rollup grew by at least 90% of the whole huge pages inside `a`.
    False where it cannot tell (no smaps, `a` under 4 MB, pages already mapped)."""
    lo = a.ctypes.data
    inner = (lo + a.nbytes) // HUGE_PAGE * HUGE_PAGE - -(-lo // HUGE_PAGE) * HUGE_PAGE
    if inner < 2 * HUGE_PAGE:
        return False
    before = _rollup_kb("FilePmdMapped")
    if before is None:
        return False
    np.bitwise_or.reduce(a.reshape(-1).view(np.uint8)[::4096])  # one byte a page: fault them in
    after = _rollup_kb("FilePmdMapped")
    return after is not None and (after - before) * 1024 >= 0.9 * inner


def copy_of(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous CPU copy of t (converted to dtype if given) in `empty`'s memory."""
    out = empty(t.shape, dtype or t.dtype)
    out.copy_(t.detach())
    return out


def gather_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """t[ids] for a CPU tensor of rows t [n, ...] into `empty`'s memory."""
    out = empty((ids.numel(),) + tuple(t.shape[1:]), t.dtype)
    torch.index_select(t, 0, ids, out=out)
    return out
