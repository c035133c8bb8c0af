"""Runs of neuron bundles read from disk and scattered into the neuron cache's slots, in
compiled code that holds no GIL (engine.hotcold.neuron_bundles' fast path on POSIX).

At 90% of a 7B model's FFN rows on disk a token misses about 2,000 bundles of 7 KB. Read from
Python, each read's bookkeeping (a future, the slices, the copies) held the GIL for about
100 µs, so the reads went one after another at a few thousand a second, whatever the disk's
queue could take (this host's virtual disk: 15k random 7 KB direct reads a second on one
thread, 59k on 16). Here a thread's share of the runs is one call: libc's `pread` (linked by
name, so numba's disk cache keeps the compiled code) into the thread's page-aligned buffer,
then each wanted bundle's parts copied into its slot.
"""

from __future__ import annotations

import numpy as np
from numba import types

from engine.kernels.numba_jit import njit

# ssize_t pread(int fd, void *buf, size_t count, off_t offset), the buffer passed as its address
# (an integer in the same register a pointer takes on the 64-bit ABIs numba targets)
_pread = types.ExternalFunction("pread", types.intp(types.int32, types.intp, types.intp, types.int64))


@njit(nogil=True)
def read_runs(fd, align, buf, firsts, counts, base, bundle_bytes, ids, slots, parts, part_at, part_bytes):
    """Read the runs (first bundle, count) at file offset base + first * bundle_bytes, each
    widened to `align` at both ends, into `buf`, and copy the parts of every bundle `ids`
    (sorted, each in one run) names into row slots[i] of each part's `parts` matrix (bytes
    part_at[p] to part_at[p] + part_bytes[p] of the bundle). Returns -1 when every run was
    read, else the index of the first run whose read failed or came back short (the caller
    reads it again where errno is seen)."""
    addr = buf.ctypes.data
    k = 0
    for r in range(len(firsts)):
        offset = base + firsts[r] * bundle_bytes
        lo = offset - offset % align
        hi = offset + counts[r] * bundle_bytes
        hi = ((hi + align - 1) // align) * align
        done = 0
        while done < hi - lo:  # a read may return less than asked (a signal); 0 is the file's end
            got = _pread(np.int32(fd), addr + done, hi - lo - done, lo + done)
            if got <= 0:
                return r
            done += got
        skip = offset - lo
        end = firsts[r] + counts[r]
        while k < len(ids) and ids[k] < end:
            at = skip + (ids[k] - firsts[r]) * bundle_bytes
            s = slots[k]
            for p in range(len(parts)):
                src = at + part_at[p]
                dest = parts[p]
                for j in range(part_bytes[p]):
                    dest[s, j] = buf[src + j]
            k += 1
    return -1
