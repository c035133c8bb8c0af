"""A static KV cache, preallocated for the context and written in place.

Shapes never change between steps (gpt-fast): keys and values of layer l live in
`k[l]`, `v[l]` of shape [kv_heads, slots, head_dim], in fp16 for fp32 CPU layers unless
`THERMOCLINE_KV_CACHE=fp32` (engine/kv_storage.py). Models with a sliding window may
run past the context: slots are then reused round-robin and `slot_pos` remembers which
absolute position each slot holds, so the attention mask stays exact.
"""

from __future__ import annotations

import torch

from engine.errors import ContextFullError
from engine.kernels import host_memory
from engine.kv_storage import cpu_kv_format

_F16_MAX = 65504.0


def _zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    if torch.device(device).type == "cpu":
        return host_memory.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_storage_dtype(device: torch.device | str, dtype: torch.dtype, cpu_16bit: bool | None = None) -> torch.dtype:
    """The cache's dtype for a layer computing in `dtype` on `device`: with `cpu_16bit` (None:
    the setting), fp16 for fp32 CPU layers (half the bytes each decoded token reads in a long
    chat; llama.cpp's default), else the compute dtype."""
    if cpu_16bit is None:
        cpu_16bit = cpu_kv_format() == "fp16"
    if cpu_16bit and torch.device(device).type == "cpu" and dtype == torch.float32:
        return torch.float16
    return dtype


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, slots: int,
                 dtypes: list[torch.dtype], devices: list[torch.device], sliding_window: int | None = None,
                 cpu_16bit: bool | None = None):
        # None: the setting (fp16 unless THERMOCLINE_KV_CACHE=fp32), as the planner counts it.
        self.cpu_16bit = cpu_kv_format() == "fp16" if cpu_16bit is None else cpu_16bit
        self.slots = slots
        self.rolling = sliding_window is not None and sliding_window <= slots
        self.window = sliding_window
        # Each layer's cache lives with its layer, in `storage_dtype` of its compute dtype.
        # On the CPU its pages are taken as positions are written (host_memory.zeros), not at the load.
        self.k = [_zeros((kv_heads, slots, head_dim), self.storage_dtype(devices[i], dtypes[i]), devices[i])
                  for i in range(num_layers)]
        self.v = [_zeros(k.shape, k.dtype, k.device) for k in self.k]
        # Bookkeeping stays on the CPU; masks are moved to a layer's device when used.
        self.slot_pos = torch.full((slots,), -1, dtype=torch.long)
        self._slot_pos = self.slot_pos.numpy()  # the same memory: a decoded token's one element is set
        # through numpy, which keeps the GIL (a torch op hands it to any thread waiting for it)
        self.length = 0  # positions 0 .. length-1 have been written

    def storage_dtype(self, device: torch.device | str, dtype: torch.dtype) -> torch.dtype:
        return kv_storage_dtype(device, dtype, self.cpu_16bit)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self, length: int = 0) -> None:
        """Forget everything from `length` on (prefix reuse keeps the first `length`)."""
        if self.length > self.slots:
            length = 0  # a rolling cache wrapped: early positions were overwritten
        self.length = length
        self.slot_pos[length:] = -1  # until a wrap, slot i holds position i

    def check_room(self, start: int, count: int) -> None:
        if self.rolling:
            if count > self.slots:
                raise ContextFullError(f"{count} tokens at once exceed the context of {self.slots}")
            return
        if start + count > self.slots:
            raise ContextFullError(
                f"the conversation needs {start + count} tokens but the context holds {self.slots}; "
                "start a new conversation or raise the context length"
            )

    def prepare(self, start: int, count: int) -> None:
        """Claim the slots of positions start .. start+count-1 before any layer writes them."""
        self.check_room(start, count)
        if count == 1:  # a decoded token: one element, without building a range (a batch step prepares each cache)
            self._slot_pos[start % self.slots] = start
            self.length = max(self.length, start + 1)
            return
        pos = torch.arange(start, start + count)
        self.slot_pos[pos % self.slots] = pos
        self.length = max(self.length, start + count)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k, v: [kv_heads, T, head_dim] for positions start .. start+T-1."""
        count = k.shape[1]
        if self.k[layer].dtype == torch.float16 and k.dtype != torch.float16:
            k, v = k.clamp(-_F16_MAX, _F16_MAX), v.clamp(-_F16_MAX, _F16_MAX)  # no inf in the cache
        if self.rolling:
            first = start % self.slots
            if first + count <= self.slots:
                self.k[layer][:, first : first + count] = k
                self.v[layer][:, first : first + count] = v
            else:
                idx = (torch.arange(start, start + count) % self.slots).to(k.device)
                self.k[layer][:, idx] = k
                self.v[layer][:, idx] = v
        else:
            self.k[layer][:, start : start + count] = k
            self.v[layer][:, start : start + count] = v

    def keys_values(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the written part (no copy); rolling caches return every slot."""
        if self.rolling:
            return self.k[layer], self.v[layer]
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def mask(self, start: int, count: int) -> torch.Tensor | None:
        """Boolean [count, keys] mask (True = attend) or None when plain causal suffices."""
        end = start + count
        query_pos = torch.arange(start, end)[:, None]
        if self.rolling:
            key_pos = self.slot_pos[None, :]
            ok = (key_pos >= 0) & (key_pos <= query_pos)
        else:
            key_pos = torch.arange(end)[None, :]
            ok = key_pos <= query_pos
        if self.window is not None:
            ok &= key_pos > query_pos - self.window
        elif not self.rolling and count == 1:
            return None  # a single new token sees every written position
        return ok
