"""The disk tier (PowerInfer-2): cold FFN rows stay on disk; a neuron cache in RAM holds
those that fire often, and a token reads the ones it needs and misses.

- The rows on disk are neuron bundles (engine.hotcold.neuron_bundles): each neuron's gate,
  up and down rows (and an int8 tier's scales) together, written once from the prepared
  file beside it, read by a `BundleReader` with direct (O_DIRECT) or uncached positional
  reads, runs of neighbours (gaps of up to `GAP_ROWS` bundles) coalesced into one read, the
  reads of a call on `read_threads` threads.
- `NeuronCache` is one pool of slots for all layers (each slot holds one neuron's gate, up
  and down rows, and an int8 tier's three scales), counted in bytes against the RAM budget
  (`slot_bytes`, `map_bytes`) and never above it. It is seeded with the most frequent cold
  neurons (the activation statistics); those firing on at least `PIN_FREQUENCY` of tokens
  are pinned (never evicted; at most half the slots, and never the working set of
  `placement.WORKING_SHARE` of a layer that a token's misses are read into); the rest are kept by CLOCK with
  counts (recency by the sweeping hand, frequency by a count of up to 3 that each hit
  raises and each pass lowers). `resize` moves its capacity between tokens.
- Overlap (`lookahead`, while the misses are many; THERMOCLINE_DISK_LOOKAHEAD=1 always, 0
  never): while layer L's kernel runs, layer L+1's predictor is run on
  layer L's input and the bundles it selects that are missing are read on a thread into
  slots layer L does not use; layer L+1 then reads only what that guess missed. The
  guess moves rows into the cache and nothing else: what a layer computes is unchanged.
- `DiskFfn` is a `HybridFfn` whose cold rows are the cache's: per token its predictor picks
  the neurons, the missing ones are read into free or evicted slots, and the same kernel as
  in RAM runs over the same positions with a slot index per position (`idx`), so each
  position computes the same row bytes in the same chunks: the same bits as in RAM. When one
  layer's predicted set exceeds the slots that may be evicted, it is computed chunk by chunk
  (`chunk_rounds`: the kernel's own split over its threads, each chunk resident in turn and
  its sums added in the kernel's order): still the same bits. Only a chunk's predicted set
  beyond the cache is computed in rounds (`overflow_rounds`), the same neurons summed in
  another order: with 2 threads that takes more than twice the working set's share of a
  layer firing at once.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from engine.errors import UserError
from engine.hotcold.hybrid_ffn import HybridFfn
from engine.hotcold.neuron_bundles import BundleReader, open_or_build, read_threads
from engine.hotcold.placement import SLOT_META_BYTES, WORKING_SHARE
from engine.kernels import cpu as cpu_kernels
from engine.kernels import cpu_q4, numba_pool, q4_format, q4_rows

GAP_ROWS = 4  # neighbours this close are read in one call (the bundles between are dropped)
PIN_FREQUENCY = 0.5  # seeded neurons firing this often are never evicted
MAX_COUNT = 3
# Reading the next layer's guess ahead: "1" always, "0" never, else (the default) while the
# layers' misses run at LOOKAHEAD_MISS_SHARE of their cold neurons or more. The guess costs a
# predictor pass a layer whatever it saves. bench.beyond_ram's model (7B shapes, int4, 2
# cores, sampled tokens): at 145 misses a layer-token (1.3% of 11,008) it was 0.93x of none, at
# 294 (2.7%) 1.18x, at 600 (5%) 1.28x; at 44 (0.4%, half the rows on disk) 0.68x.
LOOKAHEAD_ENV = "THERMOCLINE_DISK_LOOKAHEAD"
LOOKAHEAD_MISS_SHARE = 0.02
MISS_DECAY = 0.9  # the misses' running mean forgets a layer call's share this fast


def lookahead_setting() -> bool | None:
    """True (always), False (never) or None (while the misses are many: `NeuronCache.miss_share`)."""
    value = os.environ.get(LOOKAHEAD_ENV, "").strip()
    return True if value == "1" else False if value == "0" else None


def open_reader(prepared, layers: int, threads: int | None = None) -> BundleReader:
    """The bundles beside a prepared file (written from it the first time), opened for reads,
    their compiled reads ready."""
    path, layout = open_or_build(prepared, layers)
    reader = BundleReader(path, layout, threads or read_threads())
    reader.warm()
    return reader


def min_cache_neurons_of(cold_ids: list[np.ndarray]) -> int:
    """The working set (placement.min_cache_neurons) of these layers' cold neurons."""
    return int(np.ceil(WORKING_SHARE * max((len(ids) for ids in cold_ids), default=0)))


class NeuronCache:
    """One pool of neuron slots for every group's cold rows (see the module's docstring). A
    group is a layer (a dense FFN), or one expert of a layer (a mixture: `group_layer` says
    whose bundles its ids are, `working` is one expert); its `cold_ids` are the bundles'
    ids in that layer (neurons, or a mixture's units e * n + j), sorted; a group's positions
    index them."""

    def __init__(self, fmt: str, reader: BundleReader, cold_ids: list[np.ndarray], capacity: int, d: int,
                 group_layer: list[int] | None = None, working: int | None = None):
        self.fmt, self.reader, self.d = fmt, reader, d
        self.cold_ids = [np.asarray(ids, dtype=np.int64) for ids in cold_ids]
        self.group_layer = list(range(len(cold_ids))) if group_layer is None else list(group_layer)
        self.working = min_cache_neurons_of(self.cold_ids) if working is None else int(working)
        self.largest = max((len(ids) for ids in self.cold_ids), default=0)
        self.slot_of = [np.full(len(ids), -1, dtype=np.int64) for ids in self.cold_ids]
        # layers computed chunk by chunk (the same bits), and rounds of a chunk beyond the cache (not)
        self.hits = self.misses = self.chunk_rounds = self.overflow_rounds = 0
        # the read ahead (lookahead): its thread, the layer it reads for, and its counters
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="neuron-ahead")
        self._pending: tuple[int, Future] | None = None
        self.ahead_neurons = self.ahead_used = 0  # read ahead, and of those the ones their layer computed
        self.stall_s = 0.0  # time a token waited for reads: its own misses and unfinished reads ahead
        self.miss_share = 0.0  # a running mean of a layer call's misses over its cold neurons
        self._allocate(max(int(capacity), 1))

    def close(self) -> None:
        self.wait()
        self._ahead.shutdown(wait=True)
        self.reader.close()

    # ------------------------------------------------------------------ storage
    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        dtypes = {"U8": np.uint8, "I8": np.int8, "F32": np.float32}
        self.pool = [np.zeros((capacity, width) if width > 1 else capacity, dtype=dtypes[dtype])
                     for _, _, dtype, width in self.reader.layout.parts]
        self.slot_layer = np.full(capacity, -1, dtype=np.int32)
        self.slot_pos = np.zeros(capacity, dtype=np.int32)
        self.count = np.zeros(capacity, dtype=np.uint8)
        self.pinned = np.zeros(capacity, dtype=bool)
        self.hand = 0
        self._rows()

    def _rows(self) -> None:
        """The kernels' view of the pool (rebuilt when the pool is)."""
        t = [torch.from_numpy(a) for a in self.pool]
        if self.fmt == "int4":
            gate, up, down = (t[0], t[1], t[2]) if len(t) == 3 else (None, t[0], t[1])
            self.rows = q4_rows.Q4FfnRows(gate, up, down, self.d)
        else:
            k = len(t) // 2
            q, s = t[:k], t[k:]
            gate, up, down = (q[0], q[1], q[2]) if k == 3 else (None, q[0], q[1])
            gs, us, ds = (s[0], s[1], s[2]) if k == 3 else (None, s[0], s[1])
            self.rows = cpu_kernels.CpuFfnRows(gate, up, down, gs, us, ds, quant="int8")
        # a call's predictor ids, padded: the kernels check as many as the pool has rows
        self._pred_scratch = np.zeros(self.capacity + self.largest, dtype=np.int64)

    @property
    def slot_bytes(self) -> int:
        return sum(a.nbytes for a in self.pool) // self.capacity + SLOT_META_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: its slots (rows and bookkeeping), every cold neuron's slot map,
        and the most its reader's buffers hold."""
        return (sum(a.nbytes for a in self.pool) + self.slot_layer.nbytes + self.slot_pos.nbytes
                + self.count.nbytes + self.pinned.nbytes + self._pred_scratch.nbytes
                + sum(m.nbytes for m in self.slot_of) + self.reader.buffer_bytes)

    def used(self) -> int:
        return int((self.slot_layer >= 0).sum())

    # ------------------------------------------------------------------ filling
    def seed(self, frequencies: list[np.ndarray]) -> None:
        """The most frequent cold neurons (frequencies per group, aligned with cold_ids), the
        ones firing on PIN_FREQUENCY of tokens pinned (at most half the slots, the most frequent
        first whatever their group)."""
        flat = np.concatenate(frequencies) if frequencies else np.empty(0)
        take = min(self.capacity, flat.size)
        if not take:
            return
        order = np.argsort(-flat, kind="stable")[:take]
        # Pinned: the most frequent of the hot ones across all groups (at most half the slots,
        # never the working set). Taken group by group, the first layers took every pin: at 90%
        # of 4 layers of 7B rows on disk the cache served 65% of the firing neurons, 75% so.
        pin = np.zeros(flat.size, dtype=bool)
        hot = order[flat[order] >= PIN_FREQUENCY]
        pin[hot[:max(0, min(self.capacity // 2, self.capacity - self.working))]] = True
        bounds = np.cumsum([0] + [len(f) for f in frequencies])
        group = np.searchsorted(bounds, order, side="right") - 1
        order = order[np.lexsort((order, group))]  # by group, positions ascending
        group = np.searchsorted(bounds, order, side="right") - 1
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        for lo, hi in zip(starts, np.r_[starts[1:], len(order)]):
            g = int(group[lo])
            pos = order[lo:hi] - bounds[g]
            slots = np.arange(lo, hi)
            self._fill(g, pos, slots)
            self.pinned[slots[pin[order[lo:hi]]]] = True
            self.count[slots] = MAX_COUNT

    def _map(self, layer: int, positions: np.ndarray, slots: np.ndarray) -> None:
        self.slot_layer[slots] = layer
        self.slot_pos[slots] = positions
        self.count[slots] = 1
        self.slot_of[layer][positions] = slots

    def _fill(self, layer: int, positions: np.ndarray, slots: np.ndarray) -> None:
        """Read cold positions (sorted) of a layer into slots, and map them."""
        start = time.perf_counter()
        self.reader.read(self.group_layer[layer], self.cold_ids[layer][positions], self.pool, slots, GAP_ROWS)
        self.stall_s += time.perf_counter() - start
        self._map(layer, positions, slots)

    # ------------------------------------------------------------------ reading ahead
    def read_ahead(self, layer: int, positions: np.ndarray, busy_layer: int, busy_positions: np.ndarray) -> None:
        """Start reading the missing ones of a layer's guessed positions (sorted) on the
        read-ahead thread, into slots neither the busy layer's positions (being computed)
        nor the guess's own hits hold. They are mapped at once; `wait` (at the layer's
        `ensure`) makes sure they are read before the kernel takes them."""
        self.wait()
        slots = self.slot_of[layer][positions]
        missing = positions[slots < 0]
        if not len(missing):
            return
        busy = np.zeros(self.capacity, dtype=bool)
        busy[slots[slots >= 0]] = True
        mine = self.slot_of[busy_layer][busy_positions]
        busy[mine[mine >= 0]] = True
        room = self.capacity - int(busy.sum()) - int(self.pinned.sum())
        missing = missing[:max(0, min(len(missing), room))]
        if not len(missing):
            return
        victims = self._victims(len(missing), busy)
        missing = missing[:len(victims)]
        if not len(missing):
            return
        ids = self.cold_ids[layer][missing]
        self._map(layer, missing, victims)
        self.count[victims] = 0  # a guess: the first to go unless its layer computes it
        self.ahead_neurons += len(missing)
        future = self._ahead.submit(self.reader.read, self.group_layer[layer], ids, self.pool, victims, GAP_ROWS)
        self._pending = (layer, future, missing)

    def wait(self) -> None:
        """The read ahead finished (its errors raised here, in the token's thread)."""
        if self._pending is None:
            return
        _, future, _ = self._pending
        self._pending = None
        start = time.perf_counter()
        future.result()
        self.stall_s += time.perf_counter() - start

    def _evict(self, slots: np.ndarray) -> None:
        owners = self.slot_layer[slots]
        for layer in np.unique(owners[owners >= 0]):
            mine = slots[owners == layer]
            self.slot_of[layer][self.slot_pos[mine]] = -1
        self.slot_layer[slots] = -1
        self.pinned[slots] = False

    def _victims(self, m: int, busy: np.ndarray) -> np.ndarray:
        """Up to m slots to (re)fill: free ones first, then CLOCK over the unpinned, not busy."""
        free = np.flatnonzero((self.slot_layer < 0) & ~busy)[:m]
        if len(free) >= m:
            return free
        chosen = [free]
        need = m - len(free)
        taken = np.zeros(self.capacity, dtype=bool)
        taken[free] = True
        sweep = 0
        while need > 0 and sweep < (MAX_COUNT + 2) * self.capacity:
            span = min(self.capacity, max(4 * need, 1024))
            window = (self.hand + np.arange(span)) % self.capacity
            open_ = window[~self.pinned[window] & ~busy[window] & ~taken[window]]
            ready = open_[self.count[open_] == 0][:need]
            if len(ready):
                chosen.append(ready)
                taken[ready] = True
                need -= len(ready)
                last = int(np.flatnonzero(window == ready[-1])[0])
                self.hand = (self.hand + last + 1) % self.capacity
                continue
            dec = open_[self.count[open_] > 0]
            self.count[dec] -= 1
            self.hand = (self.hand + span) % self.capacity
            sweep += span
        out = np.concatenate(chosen)
        self._evict(out[self.slot_layer[out] >= 0])
        return out

    def ensure(self, layer: int, positions: np.ndarray) -> bool:
        """Count a token's hits and misses of a layer's cold positions (sorted) and make them
        resident; False (nothing read) when the slots that may be evicted cannot hold them
        all at once: the layer is then computed in rounds (DiskFfn)."""
        read_ahead = 0
        if self._pending is not None:
            ahead_layer, _, ahead = self._pending
            self.wait()
            if ahead_layer == layer:  # read for this token: misses the read ahead took off its path
                read_ahead = int(np.isin(ahead, positions, assume_unique=True).sum())
                self.ahead_used += read_ahead
        slots = self.slot_of[layer][positions]
        hit = slots >= 0
        self.hits += int(hit.sum()) - read_ahead
        missed = int((~hit).sum()) + read_ahead
        self.misses += missed
        self.miss_share = MISS_DECAY * self.miss_share + (1 - MISS_DECAY) * missed / max(len(self.cold_ids[layer]), 1)
        hit_slots = slots[hit]
        self.count[hit_slots] = np.minimum(self.count[hit_slots] + 1, MAX_COUNT)
        return self.make_resident(layer, positions)

    def room(self, layer: int, positions: np.ndarray) -> int:
        """How many of a layer's positions can be resident at once beside the pinned slots
        (those of `positions` already resident count as theirs)."""
        slots = self.slot_of[layer][positions]
        busy = np.zeros(self.capacity, dtype=bool)
        busy[slots[slots >= 0]] = True
        return self.capacity - int((self.pinned | busy).sum()) + int(busy.sum())

    def make_resident(self, layer: int, positions: np.ndarray) -> bool:
        """Read the missing ones of a layer's positions (sorted) into free or evicted slots,
        the resident ones kept; False, with nothing evicted, when they cannot all fit."""
        self.wait()
        slots = self.slot_of[layer][positions]
        hit = slots >= 0
        missing = positions[~hit]
        if not len(missing):
            return True
        if len(positions) > self.room(layer, positions):
            return False
        busy = np.zeros(self.capacity, dtype=bool)
        busy[slots[hit]] = True
        self._fill(layer, missing, self._victims(len(missing), busy))
        return True

    def slot_index(self, layer: int) -> np.ndarray:
        """Per cold position its slot (0 for positions on disk: the kernel reads no row there)."""
        return np.maximum(self.slot_of[layer], 0)

    def pred_ids(self, ids: np.ndarray) -> np.ndarray:
        """`ids` (each position's index into the predictor's logits) padded for the kernels."""
        out = self._pred_scratch
        out[:len(ids)] = ids
        out[len(ids):] = 0
        return out

    # ------------------------------------------------------------------ resizing
    def resize(self, capacity: int) -> None:
        """A new capacity, kept between tokens: the most valuable entries (pinned, then by
        count) stay, copied matrix by matrix into the new pool."""
        capacity = max(int(capacity), 1)
        if capacity == self.capacity:
            return
        self.wait()
        occupied = np.flatnonzero(self.slot_layer >= 0)
        rank = np.lexsort((-self.count[occupied].astype(np.int16), ~self.pinned[occupied]))
        keep = occupied[rank[:capacity]]
        old = (self.pool, self.slot_layer, self.slot_pos, self.count, self.pinned)
        pool_old = self.pool
        self.pool = []
        for a in pool_old:  # one matrix at a time: the old one is dropped before the next is copied
            new = np.zeros((capacity,) + a.shape[1:], dtype=a.dtype)
            new[:len(keep)] = a[keep]
            self.pool.append(new)
        del pool_old
        _, layer_old, pos_old, count_old, pinned_old = old
        self.capacity = capacity
        self.slot_layer = np.full(capacity, -1, dtype=np.int32)
        self.slot_pos = np.zeros(capacity, dtype=np.int32)
        self.count = np.zeros(capacity, dtype=np.uint8)
        self.pinned = np.zeros(capacity, dtype=bool)
        n = len(keep)
        self.slot_layer[:n], self.slot_pos[:n] = layer_old[keep], pos_old[keep]
        self.count[:n], self.pinned[:n] = count_old[keep], pinned_old[keep]
        for m in self.slot_of:
            m[:] = -1
        for s in range(n):
            self.slot_of[self.slot_layer[s]][self.slot_pos[s]] = s
        self.hand = 0
        self._rows()


class DiskColdRows:
    """A layer's cold neurons as the cache holds them (ColdRows' interface)."""

    def __init__(self, cache: NeuronCache, layer: int):
        self.cache, self.layer = cache, layer
        self.ids = torch.from_numpy(cache.cold_ids[layer])

    def __len__(self) -> int:
        return len(self.cache.cold_ids[self.layer])

    @property
    def rows(self):
        return self.cache.rows

    @property
    def nbytes(self) -> int:
        return 0  # the cache's bytes are counted once, by the runtime


_NO_POSITIONS = np.empty(0, dtype=np.int64)


class DiskFfn(HybridFfn):
    """A HybridFfn whose cold rows live in the neuron cache and the prepared file."""

    def __init__(self, base: HybridFfn, cache: NeuronCache):
        super().__init__(base.layer, base.gated, base.activation, base.threshold, base.n_ff, base.hot,
                         DiskColdRows(cache, base.layer), base.context)
        self.cache = cache
        self.next: DiskFfn | None = None  # the next layer's, which `lookahead` reads ahead for
        self.lookahead = lookahead_setting()  # None: while the misses are many
        self._guess_input: torch.Tensor | None = None  # this token's predictor input, for the next layer's guess

    def __call__(self, x: torch.Tensor, pred_input: torch.Tensor, layer: int, observer=None) -> torch.Tensor:
        self._guess_input = pred_input[0] if x.shape[0] == 1 else None
        return super().__call__(x, pred_input, layer, observer)

    def _read_ahead(self, positions: np.ndarray) -> None:
        """The next layer's predictor on this layer's input: its guess's missing bundles are
        read while this layer computes (the residual stream changes little in one layer)."""
        nxt, guess_input = self.next, self._guess_input
        if nxt is None or guess_input is None or self.context.mode == "oracle":
            return
        wanted = self.lookahead if self.lookahead is not None else self.cache.miss_share >= LOOKAHEAD_MISS_SHARE
        if not wanted:
            return
        guess = nxt.context.logits(guess_input).to("cpu", torch.float32).numpy()
        ids = self.cache.cold_ids[nxt.layer]
        self.cache.read_ahead(nxt.layer, np.flatnonzero(guess[ids] >= nxt.context.threshold), self.layer,
                              positions)

    def fused_cold(self, pred_input: np.ndarray, x: np.ndarray, logits: np.ndarray
                   ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """The fused decode's cold part of one token (engine.runtime.fused_decode): the predicted
        cold positions made resident and the next layer's read ahead started, as `_from_cache`;
        returns (slot index, predictor ids) for the rows kernel, or (None, None, the cold part
        computed in rounds, fp32 [d]) where the cache holds the layer only in rounds.
        pred_input fp32 [d]: the predictor's input (the next layer's guess reads it)."""
        cache, layer, thr = self.cache, self.layer, self.context.threshold
        self._guess_input = torch.from_numpy(pred_input.copy())
        if not len(self.cold):
            return _NO_POSITIONS, _NO_POSITIONS, None
        positions = np.flatnonzero(logits[cache.cold_ids[layer]] >= thr)
        if cache.ensure(layer, positions):
            self._read_ahead(positions)  # overlaps with the rows kernel
            return cache.slot_index(layer), cache.pred_ids(cache.cold_ids[layer]), None
        y = self._in_rounds(torch.from_numpy(x), torch.from_numpy(logits), positions)
        return None, None, y.numpy()

    def _cold_decode(self, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        if not len(self.cold):
            return torch.zeros(x.shape[-1], dtype=torch.float32)
        if logits is None:
            raise UserError("the oracle mode computes every neuron: load the model with its rows in RAM")
        return self._from_cache(x.to("cpu", torch.float32), logits.to("cpu", torch.float32))

    def _from_cache(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        cache, layer, thr = self.cache, self.layer, self.context.threshold
        pred = logits.numpy()
        positions = np.flatnonzero(pred[cache.cold_ids[layer]] >= thr)
        if cache.ensure(layer, positions):
            self._read_ahead(positions)  # overlaps with the kernel below
            return self._kernel(x, logits, thr)
        return self._in_rounds(x, logits, positions)

    def _in_rounds(self, x: torch.Tensor, logits: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        """A layer whose predicted set the cache cannot hold at once. The in-RAM kernel splits
        a layer's cold positions into one chunk per thread, sums each chunk in position order
        and adds the chunks' sums in order: here each chunk is made resident and computed
        alone by the same kernel (one chunk, its predicted positions), and the sums are added
        in the same order, so the bits are those of RAM. Only a chunk larger than the cache
        is computed in rounds of what fits (`overflow_rounds`): the same neurons, summed in
        another order."""
        cache, layer = self.cache, self.layer
        rows = cache.rows
        module = cpu_q4 if rows.quant == q4_format.QUANT else cpu_kernels
        kern = module._kernels()
        k = len(cache.cold_ids[layer])
        if kern is None:  # torch: no chunks to follow
            chunks = [positions]
        else:
            with numba_pool.lock:
                n = max(1, min(numba_pool.use_threads(kern), k))
            per = -(-k // n)
            chunks = [positions[(positions >= lo) & (positions < lo + per)] for lo in range(0, k, per)]
        y = torch.zeros(x.shape[-1], dtype=torch.float32)
        for chunk in chunks:
            if not len(chunk):
                continue
            cache.chunk_rounds += 1
            if cache.make_resident(layer, chunk):
                y += self._rows_kernel(kern, module, x, chunk, logits)
                continue
            room = max(cache.room(layer, chunk[:0]), 1)
            part = None
            for lo in range(0, len(chunk), room):
                group = chunk[lo:lo + room]
                cache.overflow_rounds += 1
                if not cache.make_resident(layer, group):
                    raise RuntimeError("a round larger than the neuron cache")
                got = self._rows_kernel(kern, module, x, group, logits)
                part = got if part is None else part + got
            y += part
        return y

    def _rows_kernel(self, kern, module, x: torch.Tensor, group: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
        """The kernel over resident positions `group` (sorted) of this layer, as one chunk."""
        cache = self.cache
        idx = np.ascontiguousarray(cache.slot_of[self.layer][group])
        if kern is None:
            return module.sparse_ffn(x, cache.rows.select(torch.from_numpy(idx)), None, self.activation,
                                     self.threshold)
        acts = np.empty(len(idx), dtype=np.float32)
        return module._launch(kern, x, cache.rows, idx, None, None, 0.0, self.activation, self.threshold, acts,
                              nchunks=1)

    def _kernel(self, x: torch.Tensor, logits: torch.Tensor, thr: float) -> torch.Tensor:
        """The in-RAM kernel over the same positions, each reading its slot's row."""
        cache, layer = self.cache, self.layer
        rows = cache.rows
        idx = cache.slot_index(layer)
        k = len(idx)
        module = cpu_q4 if rows.quant == q4_format.QUANT else cpu_kernels
        kern = module._kernels()
        if kern is None:  # torch: the selected rows in position order, as the in-RAM torch path
            ids = cache.cold_ids[layer]
            active = np.flatnonzero(logits.numpy()[ids] >= thr)
            sub = rows.select(torch.from_numpy(idx[active]))
            return module.sparse_ffn(x, sub, None, self.activation, self.threshold)
        acts = np.empty(k, dtype=np.float32)
        return module._launch(kern, x, rows, idx, logits.numpy(), cache.pred_ids(cache.cold_ids[layer]), thr,
                              self.activation, self.threshold, acts)

    def _predicted_tokens(self, x: torch.Tensor, pred_input: torch.Tensor) -> torch.Tensor:
        """A prompt as decoding each token alone would compute it, token by token."""
        logits = self.context.logits(pred_input).to("cpu", torch.float32)
        self._guess_input = None  # a prompt runs layer by layer: the next layer's guess would come too early
        out = torch.stack([self._cold_decode(x[t].to("cpu", torch.float32), logits[t]) for t in range(x.shape[0])])
        if len(self.hot):
            saved, self.cold = self.cold, _NoRows()
            try:
                out = out + super()._predicted_tokens(x, pred_input).to("cpu", torch.float32)
            finally:
                self.cold = saved
        return out.to(x.device, x.dtype)

    def _batched(self, x: torch.Tensor, pred_input: torch.Tensor, observer) -> torch.Tensor:
        raise UserError("profiling, the oracle mode and scoring read every neuron: load the model with its rows "
                        "in RAM (a larger --ram-budget)")


class _NoRows:
    """No cold rows (the hot tier's share of a prompt)."""
    ids = torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return 0


class SlotRows:
    """A group's cold positions as the cache holds them, for one kernel call (a mixture's
    expert, engine.hotcold.moe_disk): the pool's rows with each position's slot (`idx`) and
    its index into the predictor's logits (`pred_index`). The kernel walks the same positions
    in the same order as over the expert's own rows in RAM, each reading its slot's row: the
    same bits. Positions not resident hold slot 0; the caller made every one it computes
    resident."""

    def __init__(self, cache: NeuronCache, idx: np.ndarray, pred_index: np.ndarray):
        self.cache, self.idx, self.pred_index = cache, np.ascontiguousarray(idx), pred_index
        rows = cache.rows
        self.quant, self.dim, self.up = rows.quant, rows.dim, rows.up  # what a row's bytes are counted from
        self.n_neurons = len(idx)

    def ffn(self, x: torch.Tensor, out_acts: torch.Tensor, activation: str, pred_logits: torch.Tensor | None = None,
            threshold: float = 0.0) -> torch.Tensor:
        """`cpu.sparse_ffn` (pred_logits None: every position) or `cpu.sparse_ffn_predicted`
        (the positions whose logit >= threshold) over these positions, relu's threshold 0."""
        rows = self.cache.rows
        q4 = self.quant == q4_format.QUANT
        module = cpu_q4 if q4 else cpu_kernels
        kern = module._kernels() if q4 else module._kernels("ffn_rows")
        if kern is None:  # torch: the positions' rows gathered, as the in-RAM torch path computes them
            sub = rows.select(torch.from_numpy(self.idx))
            if pred_logits is None:
                return module.sparse_ffn(x, sub, None, activation, 0.0, out_acts=out_acts)
            return module.sparse_ffn_predicted(x, sub, pred_logits, threshold, activation, 0.0, out_acts=out_acts,
                                               row_ids=torch.from_numpy(self.pred_index))
        acts = out_acts.numpy()
        if pred_logits is None:
            return module._launch(kern, x, rows, self.idx, None, None, 0.0, activation, 0.0, acts)
        pred = pred_logits.detach().to("cpu", torch.float32).numpy()
        return module._launch(kern, x, rows, self.idx, pred, self.cache.pred_ids(self.pred_index), threshold,
                              activation, 0.0, acts)
