"""Neuron bundles on disk (PowerInfer-2's layout) and the reads that fetch them.

The prepared file (engine.loading.prepared) stores a layer's gate, up and down rows as three
matrices, which the in-RAM kernels map as they are; a neuron missing from the disk tier's
cache would cost three reads there. Beside it, `prepared-<fmt>.bundles` holds every
neuron's rows as one bundle: gate | up | down (| their int8 scales), padded to `ALIGN`
bytes, layer after layer, so one miss is one read and a run of neighbours is one read.
It is written once, from the prepared file, the first time a load reads rows from disk
(in chunks, each synced and dropped from the page cache: a first load under a memory
limit stays under it), keyed by the prepared file's key, size and time, under a temporary
name renamed into place; a cut or stale file is rebuilt.

`BundleReader` reads runs of bundles with the fastest uncached positional read the
platform has, and says which it took (`path_kind`):
- "o_direct" (Linux): the file opened with O_DIRECT, page-aligned buffers, reads aligned to
  the device's block (512, then 4096 if the device refuses it): no page cache at all;
- "pread+nocache" (macOS: F_NOCACHE; other POSIX: pread then POSIX_FADV_DONTNEED over the
  range): where O_DIRECT is refused (tmpfs, some filesystems);
- "portable" (Windows, no os.pread): a handle per thread, seek and readinto on an
  unbuffered file object (the standby list keeps the pages, which Windows does not charge
  to the process).
Runs larger than `MAX_READ` are split; the runs of one call go to `threads` threads, so the
device sees a queue of them. On the "o_direct" path, where numba is here, a thread's share is
one compiled call that holds no GIL (engine.kernels.direct_reads: libc's pread, then each
bundle's parts copied into its slots); elsewhere each read and its copies are Python's, one
future a read.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"TCBUNDL1"
HEADER_BYTES = 4096  # the bundles start page-aligned
ALIGN = 512  # a bundle's size is a multiple of this (O_DIRECT's unit on most devices)
MAX_READ = 64 << 10  # bytes of one read call (a run longer than this is split): each thread's buffer
# A deep queue: a thread waiting on the device takes no CPU. This host's virtual disk, random
# 7 KB direct reads: 15k a second on 1 thread, 33k on 4, 59k on 16; bench.beyond_ram at 90% on
# disk (sampled tokens, 64 KB reads): 7.3 tok/s on 4 threads, 9.8 on 8, 10.7 on 16.
READ_THREADS = 16
PAGE = 4096  # the largest alignment a direct read takes (a buffer spans an aligned read's two ends)
READ_THREADS_ENV = "THERMOCLINE_DISK_READ_THREADS"
READ_PATH_ENV = "THERMOCLINE_DISK_READ_PATH"  # o_direct, pread+nocache or portable: the fastest the platform has
RUNS_PER_SHARE = 8  # a call's runs are split over threads no finer than this (a share is one compiled call)
WRITE_CHUNK = 8 << 20  # bytes written between a sync and a drop from the page cache
VERSION = 1


def read_threads() -> int:
    """Threads a reader reads on (THERMOCLINE_DISK_READ_THREADS, else READ_THREADS)."""
    value = os.environ.get(READ_THREADS_ENV, "").strip()
    return max(1, int(value)) if value.isdigit() else READ_THREADS


def bundle_size(row_bytes: int) -> int:
    """Bytes of one bundle of a neuron's rows (row_bytes in all), padded to ALIGN."""
    return -(-row_bytes // ALIGN) * ALIGN


def bundles_per_read(bundle_bytes: int, n: int) -> int:
    """Bundles one read call takes at most: MAX_READ's worth (at least one), never more than
    a layer's n (a run lies in one layer)."""
    return max(1, min(MAX_READ // bundle_bytes, n))


def buffer_bytes(bundle_bytes: int, n: int, threads: int | None = None) -> int:
    """The most a reader's buffers hold at once: one per thread that reads (its pool's, the
    token's own thread and the read-ahead thread), each of one read call and its alignment
    at both ends. The disk tier counts it in the RAM budget beside the cache's slots."""
    threads = read_threads() if threads is None else threads
    return (threads + 2) * (bundles_per_read(bundle_bytes, n) * bundle_bytes + 2 * PAGE)


def bundles_path(prepared_path: Path) -> Path:
    return Path(prepared_path).with_suffix(".bundles")


def _key(prepared) -> str:
    st = os.stat(prepared.path)
    return f"{prepared.metadata.get('key')}:{st.st_size}:{st.st_mtime_ns}:{VERSION}"


class BundleLayout:
    """Where each part of a neuron's bundle lies: parts as (name, bytes a row, dtype, width)."""

    def __init__(self, parts: list[tuple[str, int, str, int]], layers: int, n: int):
        self.parts = parts
        self.layers, self.n = layers, n
        self.offsets = np.cumsum([0] + [p[1] for p in parts])[:-1].tolist()
        self.bundle_bytes = bundle_size(sum(p[1] for p in parts))

    def file_bytes(self) -> int:
        return HEADER_BYTES + self.layers * self.n * self.bundle_bytes

    def offset(self, layer: int, neuron: int) -> int:
        return HEADER_BYTES + (layer * self.n + neuron) * self.bundle_bytes

    def to_json(self, key: str) -> dict:
        return {"key": key, "layers": self.layers, "n": self.n, "parts": self.parts,
                "bundle_bytes": self.bundle_bytes}


def layout_of(prepared, layers: int) -> BundleLayout:
    """The bundle layout of a prepared file's FFN rows: gate, up, down_t (and an int8 tier's
    scales), in that order, as the file stores them per layer. A mixture's file
    (engine.loading.prepared_moe) stacks its experts' rows [E, n, ...]: its bundles are the
    units e * n + j of the placement, neuron j of expert e."""
    prefix = "experts." if "layers.0.experts.gate" in prepared.header else ""
    names = ["gate", "up", "down_t"] if f"layers.0.{prefix}gate" in prepared.header else ["up", "down_t"]
    if prepared.fmt == "int8":
        names += [f"{n}_scale" for n in names]
    parts, n = [], None
    for name in names:
        entry = prepared.header[f"layers.0.{prefix}{name}"]
        shape = entry["shape"]
        scale = entry["dtype"] == "F32"  # one per row: [n] or [E, n]
        width = 1 if scale else shape[-1]
        size = {"U8": 1, "I8": 1, "F32": 4}[entry["dtype"]]
        parts.append((prefix + name, width * size, entry["dtype"], width))
        n = int(np.prod(shape if scale else shape[:-1]))
    return BundleLayout(parts, layers, n)


def open_or_build(prepared, layers: int) -> tuple[Path, BundleLayout]:
    """The bundles file of a prepared file: the current one, or a new one written from it."""
    layout = layout_of(prepared, layers)
    path = bundles_path(prepared.path)
    key = _key(prepared)
    if _is_current(path, layout, key):
        return path, layout
    _build(prepared, path, layout, key)
    return path, layout


def _is_current(path: Path, layout: BundleLayout, key: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 16 or head[:8] != MAGIC or size != layout.file_bytes():
        return False
    (length,) = struct.unpack("<Q", head[8:16])
    try:
        meta = json.loads(head[16:16 + length])
    except ValueError:
        return False
    return meta == json.loads(json.dumps(layout.to_json(key)))  # tuples as the file's lists


def _drop_cache(fd: int, lo: int, hi: int) -> None:
    if hasattr(os, "posix_fadvise") and hi > lo:
        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)


def _build(prepared, path: Path, layout: BundleLayout, key: str) -> None:
    from engine.loading.safetensors_out import remove_abandoned_partials

    remove_abandoned_partials(path)
    tmp = path.with_suffix(f".{os.getpid()}.partial")
    meta = json.dumps(layout.to_json(key)).encode()
    header = MAGIC + struct.pack("<Q", len(meta)) + meta
    if len(header) > HEADER_BYTES:
        raise ValueError("bundle header too long")
    start = time.perf_counter()
    src = os.open(prepared.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        with open(tmp, "wb") as f:
            f.write(header.ljust(HEADER_BYTES, b"\0"))
            per_chunk = max(1, WRITE_CHUNK // layout.bundle_bytes)
            written = HEADER_BYTES
            for layer in range(layout.layers):
                for lo in range(0, layout.n, per_chunk):
                    hi = min(layout.n, lo + per_chunk)
                    block = np.zeros((hi - lo, layout.bundle_bytes), dtype=np.uint8)
                    for (name, row_bytes, _, _), at in zip(layout.parts, layout.offsets):
                        entry = prepared.header[f"layers.{layer}.{name}"]
                        first = prepared._base + entry["data_offsets"][0]
                        data = _pread_all(src, (hi - lo) * row_bytes, first + lo * row_bytes)
                        _drop_cache(src, first + lo * row_bytes, first + hi * row_bytes)
                        block[:, at:at + row_bytes] = np.frombuffer(data, dtype=np.uint8).reshape(hi - lo, row_bytes)
                    f.write(block.tobytes())
                    f.flush()
                    os.fsync(f.fileno())  # clean pages can be dropped: the page cache stays small
                    _drop_cache(f.fileno(), written, written + block.nbytes)
                    written += block.nbytes
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(src)
    log.info("wrote %s (%d bundles of %d bytes) in %.1f s", path.name, layout.layers * layout.n,
             layout.bundle_bytes, time.perf_counter() - start)


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        chunks, done = [], 0
        while done < size:
            data = os.pread(fd, size - done, offset + done)
            if not data:
                raise OSError(f"short read at {offset + done} (the prepared file was cut)")
            chunks.append(data)
            done += len(data)
        return b"".join(chunks)
    os.lseek(fd, offset, os.SEEK_SET)
    data = os.read(fd, size)
    if len(data) != size:
        raise OSError("short read (the prepared file was cut)")
    return data


def run_arrays(ids: np.ndarray, gap: int, longest: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ids as runs (firsts, counts: int64 arrays), neighbours within `gap` ids joined and a
    run longer than `longest` split."""
    if not len(ids):
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) > gap + 1)
    firsts = ids[np.concatenate([[0], breaks + 1])]
    counts = ids[np.concatenate([breaks, [len(ids) - 1]])] - firsts + 1
    if longest is None or not len(counts) or counts.max() <= longest:
        return firsts, counts
    pieces = -(-counts // longest)
    k = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # a piece's place in its run
    return np.repeat(firsts, pieces) + longest * k, np.minimum(longest, np.repeat(counts, pieces) - longest * k)


def _compiled_reads():
    """engine.kernels.direct_reads.read_runs, or None without numba (or with it turned off)."""
    from engine.kernels import numba_pool

    if numba_pool.module() is None:
        return None
    from engine.kernels import direct_reads

    return direct_reads.read_runs


class _Buffer(threading.local):
    """One page-aligned read buffer per reading thread, of the largest read call (counted by
    `buffer_bytes`: allocated once at that size, so it never grows past the count)."""
    buf: mmap.mmap | None = None
    arr: np.ndarray | None = None

    def get(self, size: int, capacity: int) -> mmap.mmap:
        if self.buf is None:
            self.buf = mmap.mmap(-1, capacity)
        if size > len(self.buf):
            raise ValueError(f"a read of {size} bytes exceeds the {len(self.buf)}-byte buffer")
        return self.buf

    def array(self, capacity: int) -> np.ndarray:
        """The buffer as bytes for compiled code (which checks its own sizes)."""
        if self.arr is None:
            self.arr = np.frombuffer(self.get(0, capacity), dtype=np.uint8)
        return self.arr


class BundleReader:
    """Reads runs of bundles (see the module's docstring for the path each platform takes)."""

    def __init__(self, path: Path, layout: BundleLayout, threads: int):
        self.path, self.layout, self.threads = str(path), layout, threads
        self._local = threading.local()
        self._buffers = _Buffer()
        self._fd = self._direct = self._refused = None
        self.align = ALIGN
        wanted = os.environ.get(READ_PATH_ENV, "").strip()
        if not hasattr(os, "pread") or wanted == "portable":
            self.path_kind = "portable"
        else:
            self._fd = os.open(self.path, os.O_RDONLY)
            self.path_kind = "pread+nocache"
            if hasattr(os, "O_DIRECT") and wanted != "pread+nocache":
                try:
                    self._direct = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                    self.path_kind = "o_direct"
                except OSError:  # tmpfs and some filesystems refuse it
                    self._direct = None
            elif not hasattr(os, "O_DIRECT"):  # macOS: no O_DIRECT, but a descriptor can bypass the cache
                import fcntl

                if hasattr(fcntl, "F_NOCACHE"):
                    fcntl.fcntl(self._fd, fcntl.F_NOCACHE, 1)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="neuron-read") if threads > 1 else None
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.calls = 0
        self.seconds = 0.0
        self.buffer_bytes = buffer_bytes(layout.bundle_bytes, layout.n, threads)  # counted in the RAM budget
        self._per_buffer = self.buffer_bytes // (threads + 2)
        # the compiled reads (O_DIRECT with numba here), else None: each read and its copies in Python
        self._read_runs = _compiled_reads() if self._direct is not None else None
        self._part_at = np.asarray(layout.offsets, dtype=np.int64)  # each part's bytes within a bundle
        self._part_bytes = np.asarray([p[1] for p in layout.parts], dtype=np.int64)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in (self._fd, self._direct, self._refused):
            if fd is not None:
                os.close(fd)
        self._fd = self._direct = self._refused = None

    # ------------------------------------------------------------------ one read
    def _read_direct(self, fd: int, size: int, offset: int) -> memoryview:
        align = self.align
        lo = offset - offset % align
        hi = -(-(offset + size) // align) * align
        buf = self._buffers.get(hi - lo, self._per_buffer)
        view = memoryview(buf)[: hi - lo]
        try:
            got = os.preadv(fd, [view], lo)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            if align < 4096:  # a 4K-sector device: align to its block
                self.align = 4096
                return self._read_direct(fd, size, offset)
            with self._lock:  # the descriptor stays open until close(): another thread may be using it
                self.path_kind, self._direct, self._refused = "pread+nocache", None, fd
            return self._read_cached(size, offset)
        if got < offset + size - lo:
            raise OSError(f"{self.path}: short read (the bundles file was cut)")
        return view[offset - lo: offset - lo + size]

    def _read_cached(self, size: int, offset: int) -> memoryview:
        if self._fd is not None:
            data = os.pread(self._fd, size, offset)
            _drop_cache(self._fd, offset, offset + size)
        else:
            f = getattr(self._local, "f", None)
            if f is None:
                f = self._local.f = open(self.path, "rb", buffering=0)
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise OSError(f"{self.path}: short read (the bundles file was cut)")
        return memoryview(data)

    def _read(self, size: int, offset: int) -> memoryview:
        fd = self._direct
        if fd is not None:
            return self._read_direct(fd, size, offset)
        return self._read_cached(size, offset)

    # ------------------------------------------------------------------ a call
    def read(self, layer: int, ids: np.ndarray, dest: list[np.ndarray], slots: np.ndarray, gap: int) -> None:
        """Bundles `ids` (sorted) of a layer into each part's dest[p][slots] (aligned with ids)."""
        if not len(ids):
            return
        start = time.perf_counter()
        B = self.layout.bundle_bytes
        firsts, counts = run_arrays(ids, gap, bundles_per_read(B, self.layout.n))

        def one(first: int, count: int) -> None:
            data = self._read(count * B, self.layout.offset(layer, first))
            block = np.frombuffer(data, dtype=np.uint8).reshape(count, B)
            a, b = np.searchsorted(ids, [first, first + count])
            want, to = ids[a:b] - first, slots[a:b]
            for target, (_, row_bytes, _, width), at in zip(dest, self.layout.parts, self.layout.offsets):
                rows = block[want, at:at + row_bytes].view(target.dtype)
                target[to] = rows.reshape((len(to),) + target.shape[1:])

        compiled = self._compiled()
        if compiled is not None:
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            slots = np.ascontiguousarray(slots, dtype=np.int64)
            parts = tuple(d.view(np.uint8).reshape(d.shape[0], -1) for d in dest)
            base = self.layout.offset(layer, 0)

            def share(a: int, b: int) -> None:
                """Runs a..b-1 in one compiled call (no GIL); a failed run and those after it
                again through `one`, which sees the error (or a device's larger block)."""
                fd, failed = self._direct, a  # None: a device refused direct reads (`one` reads cached)
                if fd is not None:
                    i, j = np.searchsorted(ids, [firsts[a], firsts[b - 1] + counts[b - 1]])
                    r = compiled(fd, self.align, self._buffers.array(self._per_buffer), firsts[a:b], counts[a:b],
                                 base, B, ids[i:j], slots[i:j], parts, self._part_at, self._part_bytes)
                    failed = b if r < 0 else a + r
                for r in range(failed, b):
                    one(int(firsts[r]), int(counts[r]))

            # a share a thread (the device sees their reads as one queue), the caller's among them
            shares = min(self.threads, -(-len(firsts) // RUNS_PER_SHARE))
            bounds = np.linspace(0, len(firsts), shares + 1).astype(int).tolist()
            pending = [self._pool.submit(share, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
            share(bounds[0], bounds[1])
            for f in pending:
                f.result()
        elif self._pool is not None and len(firsts) > 1:
            list(self._pool.map(one, firsts.tolist(), counts.tolist()))
        else:
            for first, count in zip(firsts.tolist(), counts.tolist()):
                one(first, count)
        with self._lock:
            self.bytes_read += int(counts.sum()) * B
            self.calls += len(firsts)
            self.seconds += time.perf_counter() - start

    def warm(self) -> None:
        """Compile (or load from numba's disk cache) the compiled reads for this layout now, at
        the load, not inside the first token's reads (about 1 s a layout the first time)."""
        compiled = self._compiled()
        if compiled is None:
            return
        none = np.empty(0, dtype=np.int64)  # no runs: nothing is read, the buffer is not touched
        compiled(self._direct, self.align, np.empty(0, dtype=np.uint8), none, none, 0, self.layout.bundle_bytes,
                 none, none, tuple(np.empty((0, p[1]), dtype=np.uint8) for p in self.layout.parts),
                 self._part_at, self._part_bytes)

    def _compiled(self):
        """engine.kernels.direct_reads.read_runs while the reads are direct (O_DIRECT) and numba
        is here, else None (the reads and copies in Python, one future a read)."""
        return self._read_runs if self._direct is not None else None
