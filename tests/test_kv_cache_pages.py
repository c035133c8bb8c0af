"""The KV cache costs its load nothing: its CPU tensors are zeros whose pages the kernel gives
only where a position is written (engine.kernels.host_memory.zeros), not faulted in whole by
torch.zeros (32 layers of 7B shapes at 512 positions: 268 MB at every load)."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.kernels import host_memory
from engine.model.kv_cache import KVCache


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_fresh_cache_is_zeros_and_takes_memory_only_where_written():
    before = _rss_anon()
    cache = KVCache(4, 8, 128, 8192, [torch.float32] * 4, [torch.device("cpu")] * 4)  # 128 MB of fp16
    assert cache.nbytes == 4 * 2 * 8 * 8192 * 128 * 2
    assert _rss_anon() - before < cache.nbytes // 8  # untouched (torch.zeros: all of it)
    cache.prepare(0, 3)
    k = torch.randn(8, 3, 128)
    cache.write(1, k, -k, 0)
    keys, values = cache.keys_values(1, 3)
    assert torch.equal(keys, k.half()) and torch.equal(values, (-k).half())
    assert not cache.k[0].any() and not cache.v[3].any() and not cache.k[1][:, 3:].any()  # zeros elsewhere
    assert _rss_anon() - before < cache.nbytes // 8


def test_host_memory_zeros_are_zero_of_every_size():
    for shape in [(3, 5), (2, 1 << 20)]:  # below and above one huge page: torch.zeros, then a mapping
        t = host_memory.zeros(shape, torch.float16)
        assert t.shape == shape and t.dtype == torch.float16 and t.is_contiguous() and not t.any()
        t[0, 1] = 2.0
        assert float(t.sum()) == 2.0
