"""Triton kernels for the hot (GPU) partition of a sparse FFN.

Only the @triton.jit functions live here; shapes, dtypes and launch grids are chosen in
`triton_ffn.py`. This module imports triton at top level, so import it lazily (triton is
absent on some platforms), and only after TRITON_INTERPRET is settled: triton decides
between compiling and interpreting when the decorators run.

Row layout (docs/ARCHITECTURE.md): neuron i is row i of gate, up and down_t, each row
contiguous (unit stride along d); rows may have any stride, so views into bundled
[n, 3, d] storage work without a copy.
"""

import triton
import triton.language as tl

from engine.activations import CODES, IDENTITY_CODE

# Activation codes. Globals read inside @triton.jit must be constexpr; the launcher passes
# the plain ints of ACTIVATION_CODES. IDENTITY is internal: the predictor's fc2 uses it.
RELU = tl.constexpr(CODES["relu"])
FATRELU = tl.constexpr(CODES["fatrelu"])
DRELU = tl.constexpr(CODES["drelu"])
RELU2 = tl.constexpr(CODES["relu2"])
SILU = tl.constexpr(CODES["silu"])
IDENTITY = tl.constexpr(IDENTITY_CODE)
ACTIVATION_CODES = {**CODES, "identity": IDENTITY_CODE}


@triton.jit
def _rows_dot(w_ptr, stride_w, x_ptr, offs_n, live, d, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """fp32 dot products of rows offs_n of W with x, for the rows where `live`.

    Dead rows are masked out of the loads, so on the GPU they cost no memory traffic.
    """
    rows = offs_n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, d, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        in_d = offs_d < d
        xv = tl.load(x_ptr + offs_d, mask=in_d, other=0.0).to(tl.float32)
        # Weights are streamed once per token: do not let them evict reused data from L2.
        w = tl.load(w_ptr + rows + offs_d[None, :], mask=live[:, None] & in_d[None, :],
                    other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += w * xv[None, :]
    # One reduction after the loop rather than one per tile.
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_activation(g, act_threshold, ACT: tl.constexpr):
    """The nonlinearity applied to the gate (gated FFN) or to up (ungated FFN)."""
    if ACT == SILU:  # SwiGLU; a CATS threshold zeroes the small magnitudes
        s = g / (1.0 + tl.exp(-g))
        out = tl.where((act_threshold > 0.0) & (tl.abs(s) < act_threshold), 0.0, s)
    elif ACT == FATRELU:
        # FATReLU (ProSparse): keep g only at or above the threshold (> 0).
        out = tl.where(g >= act_threshold, g, 0.0)
    elif ACT == RELU2:
        r = tl.maximum(g, 0.0)
        out = r * r
    elif ACT == IDENTITY:
        out = g
    else:  # RELU, DRELU
        out = tl.maximum(g, 0.0)
    return out


@triton.jit
def _packed_rows(cum, r0, count, TILE_N: tl.constexpr):
    """Positions (in the chunk) of live rows r0 .. r0 + TILE_N - 1, and which exist.

    cum is the inclusive prefix count of live rows over the chunk; the (r+1)-th live row
    sits at the number of positions whose prefix count is <= r. Packing live rows into
    full tiles keeps every lane's load useful: with masked tiles at 10% activity nine
    lanes in ten idle, and the loads in flight per SM are too few to saturate memory.
    """
    r = r0 + tl.arange(0, TILE_N)
    pos = tl.sum((cum[None, :] <= r[:, None]).to(tl.int32), axis=1)
    return pos, r < count


@triton.jit
def _act_rows(x_ptr, gate_ptr, up_ptr, stride_gate, stride_up, rows, live, d, act_threshold,
              HAS_GATE: tl.constexpr, ACT: tl.constexpr, TILE_N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """Activations of `rows` (0 where not live). Gated FFNs read the gate rows first and
    the up rows only where the gate activation is non-zero: predictor false positives
    cost a gate row, not gate + up."""
    if HAS_GATE:
        g = _rows_dot(gate_ptr, stride_gate, x_ptr, rows, live, d, TILE_N, BLOCK_D)
        g_act = _gate_activation(g, act_threshold, ACT)
        live = live & (g_act != 0.0)
        act = tl.zeros([TILE_N], dtype=tl.float32)
        if tl.max(live.to(tl.int32), axis=0) > 0:
            u = _rows_dot(up_ptr, stride_up, x_ptr, rows, live, d, TILE_N, BLOCK_D)
            if ACT == DRELU:
                u = tl.maximum(u, 0.0)
            act = g_act * u
    else:
        u = _rows_dot(up_ptr, stride_up, x_ptr, rows, live, d, TILE_N, BLOCK_D)
        act = _gate_activation(u, act_threshold, ACT)
    return tl.where(live, act, 0.0)


@triton.jit
def ffn_act_kernel(x_ptr, gate_ptr, up_ptr, pred_ptr, row_ids_ptr, act_ptr,
                   n, d, stride_gate, stride_up, pred_threshold, act_threshold,
                   HAS_GATE: tl.constexpr, HAS_PRED: tl.constexpr, HAS_ROW_IDS: tl.constexpr,
                   ACT: tl.constexpr, PACKED: tl.constexpr, CHUNK_N: tl.constexpr,
                   TILE_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """act[i] for the CHUNK_N neurons of this program; 0 for neurons the predictor skips.

    PACKED: the predicted neurons of the chunk are packed into tiles of TILE_N rows.
    Otherwise one tile of CHUNK_N rows with the skipped ones masked out.
    """
    c0 = tl.program_id(0) * CHUNK_N
    offs_n = c0 + tl.arange(0, CHUNK_N)
    in_n = offs_n < n
    if HAS_PRED:
        if HAS_ROW_IDS:
            # Packed hot rows: the predictor scores the whole layer, row i is neuron ids[i].
            ids = tl.load(row_ids_ptr + offs_n, mask=in_n, other=0)
        else:
            ids = offs_n
        logits = tl.load(pred_ptr + ids, mask=in_n, other=0.0)
        live = in_n & (logits >= pred_threshold)
    else:
        live = in_n

    if PACKED:
        # Skipped neurons get 0 here; the packed tiles store the others (disjoint rows).
        tl.store(act_ptr + offs_n, tl.zeros([CHUNK_N], dtype=tl.float32), mask=in_n & ~live)
        cum = tl.cumsum(live.to(tl.int32), axis=0)
        count = tl.sum(live.to(tl.int32), axis=0)
        for r0 in range(0, count, TILE_N):
            pos, ok = _packed_rows(cum, r0, count, TILE_N)
            rows = c0 + pos
            act = _act_rows(x_ptr, gate_ptr, up_ptr, stride_gate, stride_up, rows, ok, d,
                            act_threshold, HAS_GATE, ACT, TILE_N, BLOCK_D)
            tl.store(act_ptr + rows, act, mask=ok)
    else:
        act = tl.zeros([CHUNK_N], dtype=tl.float32)
        # Skip the block when the predictor rejects all of it (a uniform branch).
        if tl.max(live.to(tl.int32), axis=0) > 0:
            act = _act_rows(x_ptr, gate_ptr, up_ptr, stride_gate, stride_up, offs_n, live, d,
                            act_threshold, HAS_GATE, ACT, CHUNK_N, BLOCK_D)
        tl.store(act_ptr + offs_n, act, mask=in_n)


@triton.jit
def down_kernel(act_ptr, down_ptr, part_ptr, count_ptr, y_ptr, n, d, stride_down,
                rows_per_split, n_splits, PACKED: tl.constexpr, CHUNK_N: tl.constexpr,
                TILE_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = sum over rows i with act[i] != 0 of act[i] * down_t[i], split over rows.

    Grid (d tiles, splits). Program (t, s) sums the rows of split s for d tile t into
    partials[s, tile]. Rows with act == 0 are never read: PACKED gathers the live rows of
    each chunk of CHUNK_N into full tiles of TILE_N; otherwise tiles of CHUNK_N rows with
    the dead ones masked. rows_per_split is a multiple of CHUNK_N.

    The last program to finish a d tile (a counter per tile) adds the partials in split
    order and writes y: one launch instead of two, a deterministic sum (fixed order), and
    the counter is put back to 0 for the next call, so no zeroing launch is needed.
    """
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = offs_d < d
    start = pid_s * rows_per_split
    if PACKED:
        acc = tl.zeros([TILE_N, BLOCK_D], dtype=tl.float32)
        for c0 in range(start, start + rows_per_split, CHUNK_N):
            offs_n = c0 + tl.arange(0, CHUNK_N)
            live = tl.load(act_ptr + offs_n, mask=offs_n < n, other=0.0) != 0.0
            cum = tl.cumsum(live.to(tl.int32), axis=0)
            count = tl.sum(live.to(tl.int32), axis=0)
            for r0 in range(0, count, TILE_N):
                pos, ok = _packed_rows(cum, r0, count, TILE_N)
                rows = c0 + pos
                a = tl.load(act_ptr + rows, mask=ok, other=0.0)
                w = tl.load(down_ptr + rows.to(tl.int64)[:, None] * stride_down
                            + offs_d[None, :], mask=ok[:, None] & in_d[None, :], other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
                acc += w * a[:, None]
    else:
        acc = tl.zeros([CHUNK_N, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, start + rows_per_split, CHUNK_N):
            offs_n = n0 + tl.arange(0, CHUNK_N)
            a = tl.load(act_ptr + offs_n, mask=offs_n < n, other=0.0)
            live = a != 0.0
            w = tl.load(down_ptr + offs_n.to(tl.int64)[:, None] * stride_down
                        + offs_d[None, :], mask=live[:, None] & in_d[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            acc += w * a[:, None]
    tl.store(part_ptr + pid_s.to(tl.int64) * d + offs_d, tl.sum(acc, axis=0), mask=in_d)

    # Publish the partial: every thread's stores, then one release (the CUTLASS semaphore
    # pattern: barrier, then a gpu-scope release by one thread).
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + pid_d, 1, sem="acq_rel", scope="gpu")
    if done == n_splits - 1:
        y = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in range(0, n_splits):
            # .cg: read from L2, where the other programs' partials are, not a stale L1.
            y += tl.load(part_ptr + s * d + offs_d, mask=in_d, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + offs_d, y, mask=in_d)
        tl.atomic_xchg(count_ptr + pid_d, 0)
