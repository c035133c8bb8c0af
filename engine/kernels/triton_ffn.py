"""Sparse FFN and predictor for the hot (GPU) partition, with Triton kernels.

One decode step of a layer's hot rows is two launches with static grids:
  1. `ffn_act_kernel`: each program owns a chunk of neurons, thresholds the predictor's
     logits for them, packs the predicted ones into full tiles (prefix count inside the
     program), gathers their gate rows, then the up rows only of neurons whose gate
     fires, fp32 dot products, fused activation -> act [n] (0 where skipped);
  2. `down_kernel`: grid (d tiles x row splits); each program packs the rows with
     act != 0 of its split into tiles and sums act[i] * down_t[i] into partials [splits, d];
     the last program to finish a d tile adds that tile's partials in split order -> y.
Rows that are not computed are never read. No nonzero(), no .item(), no shape that
depends on data (only in-kernel loop trip counts do): no host sync, CUDA graphs can
capture it.

Why pack: at 10% active, a tile of consecutive rows with the dead ones masked keeps nine
lanes in ten idle, so each SM has too few bytes in flight to approach the memory bandwidth;
packed tiles keep every lane loading useful bytes (`LaunchConfig(packed=False)` keeps the
masked variant for comparison). Why a split reduction rather than float atomics on y for
the down projection: the sum has a fixed order, so results are deterministic (oracle-mode
checks compare runs bit for bit); y needs no zeroing launch; and the partials are small
(splits x d x 4 bytes, ~0.3 MB at d = 4096, against ~27 MB of weights read at 10% active
on a 7B layer). Only a per-tile counter is atomic; the kernel resets it, so the buffer is
allocated once per (device, stream) and CUDA graphs can replay the step.

Weights are fp16 or bf16 (fp32 accepted for tests); accumulation is fp32; y is fp32 [d].
Activations are those of docs/ARCHITECTURE.md (ungated drelu is relu(up), as in
`reference`).

The predictor (fc1 -> relu -> fc2) reuses the row kernel: fc1 with relu fused, then fc2
with no activation, fp32 logits straight out of the kernel. A single fused predictor
kernel does not pay: fc2 needs all of relu(fc1 x), i.e. a grid-wide barrier, or every
program recomputing fc1. The threshold is fused where it pays, inside `ffn_act_kernel`,
which reads the logits directly.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from engine.activations import NAMES as ACTIVATIONS
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a broken install on an unsupported platform
        return False
    return True


def available() -> bool:
    """Triton is importable and can run: a CUDA device, or the interpreter (CPU tensors)."""
    return _triton_importable() and (torch.cuda.is_available() or _interpret_mode())


@functools.cache
def _kernels():
    # Imported on first use: triton may be missing, and TRITON_INTERPRET must be set
    # before the @triton.jit decorators run.
    from . import triton_kernels

    return triton_kernels


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes (powers of two) and warps of the kernels. The defaults are a reasoned
    guess for 7B-class layers (d = 4096, n = 11008..14336) on recent NVIDIA GPUs, not yet
    measured; `python -m bench.triton_tune` sweeps alternatives on a GPU.

    Each program of the row kernel owns `act_chunk_n` neurons; with `packed` it gathers the
    live ones into tiles of `act_tile_n` rows (full loads at any sparsity), without it one
    tile of `act_tile_n` rows with the dead ones masked. Same for the down projection.
    """

    packed: bool = True
    # Row kernel: few live rows per program but wide d tiles. At 10% active a 7B layer
    # has ~1100 live rows, ~8 per SM: the bytes in flight per SM come from the width.
    act_chunk_n: int = 64
    act_tile_n: int = 8
    act_block_d: int = 1024
    act_warps: int = 8
    # Down projection: the row splits x d tiles grid gives the parallelism.
    down_chunk_n: int = 128
    down_tile_n: int = 16
    down_block_d: int = 256
    down_warps: int = 4
    # The down projection's grid aims at this many programs per SM (latency hiding).
    programs_per_sm: int = 4
    # Explicit number of row splits for the down projection (tests, tuning); None = from SMs.
    down_splits: int | None = None


DEFAULT_CONFIG = LaunchConfig()
# The predictor's mat-vecs are dense (no rows to skip) and fc1 has few rows (its rank):
# small masked tiles of rows give enough programs.
PREDICTOR_CONFIG = LaunchConfig(packed=False, act_tile_n=4, act_block_d=1024, act_warps=4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block(size: int, limit: int, least: int = 1) -> int:
    """Block size: `limit` (a power of two), shrunk to the next power of two >= size for
    small dimensions, and at least `least`."""
    return max(least, min(limit, 1 << max(0, size - 1).bit_length()))


def _chunk_tile(n: int, chunk: int, tile: int, packed: bool) -> tuple[int, int]:
    """(rows per chunk, rows per tile). Unpacked, a chunk is one tile: a masked tile as
    large as a packed chunk would not fit in registers."""
    tile = _block(n, tile)
    return (max(tile, _block(n, chunk)), tile) if packed else (tile, tile)


def _block_d(d: int, limit: int) -> int:
    return _block(d, limit, least=16)  # at least one 128-bit load's worth per row segment


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: parallelism is moot, a small count still exercises several splits


def _check_device(t: torch.Tensor) -> None:
    if not available():
        raise RuntimeError("Triton kernels need triton and a CUDA device (or TRITON_INTERPRET=1)")
    if _interpret_mode():
        if t.device.type != "cpu":
            raise ValueError("under TRITON_INTERPRET=1 the tensors must be on the CPU")
    elif t.device.type != "cuda":
        raise ValueError(f"Triton kernels need CUDA tensors, got {t.device}")


def _check_rows(name: str, w: torch.Tensor, like: torch.Tensor | None, device) -> None:
    if w.dim() != 2:
        raise ValueError(f"{name} must be 2-D [n, d], got shape {tuple(w.shape)}")
    if w.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{name} must be fp16, bf16 or fp32, got {w.dtype}")
    if w.shape[1] > 1 and w.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous (stride 1 along d)")
    if w.device != device:
        raise ValueError(f"{name} is on {w.device}, expected {device}")
    if like is not None and w.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {tuple(like.shape)}")


def _vector(name: str, v: torch.Tensor, size: int, device) -> torch.Tensor:
    if v.numel() != size:
        raise ValueError(f"{name} must have {size} elements, got shape {tuple(v.shape)}")
    if v.device != device:
        raise ValueError(f"{name} is on {v.device}, expected {device}")
    return v.reshape(size).contiguous()  # a no-op for the usual contiguous [d] or [1, d]


def _launch_rows(x, gate, up, pred_logits, row_ids, pred_threshold, act_code, act_threshold,
                 cfg: LaunchConfig) -> torch.Tensor:
    """act [n] fp32 from the row kernel; inputs already validated."""
    k = _kernels()
    n, d = up.shape
    act = torch.empty(n, dtype=torch.float32, device=up.device)
    if n == 0:
        return act
    chunk_n, tile_n = _chunk_tile(n, cfg.act_chunk_n, cfg.act_tile_n, cfg.packed)
    block_d = _block_d(d, cfg.act_block_d)
    k.ffn_act_kernel[(_cdiv(n, chunk_n),)](
        x, gate if gate is not None else up, up,
        pred_logits if pred_logits is not None else act,
        row_ids if row_ids is not None else act,
        act, n, d,
        gate.stride(0) if gate is not None else 0, up.stride(0),
        float(pred_threshold), float(act_threshold),
        HAS_GATE=gate is not None, HAS_PRED=pred_logits is not None,
        HAS_ROW_IDS=row_ids is not None, ACT=act_code, PACKED=cfg.packed,
        CHUNK_N=chunk_n, TILE_N=tile_n, BLOCK_D=block_d, num_warps=cfg.act_warps,
    )
    return act


def ffn_activations_triton(x, gate, up, pred_logits, pred_threshold, activation,
                           act_threshold=0.0, row_ids=None, *,
                           config: LaunchConfig | None = None) -> torch.Tensor:
    """act fp32 [n]: the activation of each row's neuron, 0 where the predictor skips it.

    Same arguments as `sparse_ffn_triton` less down_t; useful to the engine for statistics
    (active fraction) and to tests.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check_device(up)
    _check_rows("up", up, None, up.device)
    if gate is not None:
        _check_rows("gate", gate, up, up.device)
    n, d = up.shape
    x = _vector("x", x, d, up.device)
    if pred_logits is not None:
        if (pred_logits.dim() != 1 or pred_logits.device != up.device
                or not pred_logits.is_floating_point()):
            raise ValueError("pred_logits must be a 1-D float tensor on the weights' device")
        pred_logits = pred_logits.contiguous()
        if row_ids is None and pred_logits.numel() != n:
            raise ValueError(f"pred_logits has {pred_logits.numel()} entries for {n} rows")
    if row_ids is not None:
        if pred_logits is None:
            raise ValueError("row_ids maps rows to pred_logits entries; pass pred_logits too")
        if row_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"row_ids must be int32 or int64, got {row_ids.dtype}")
        row_ids = _vector("row_ids", row_ids, n, up.device)
    code = _kernels().ACTIVATION_CODES[activation]
    return _launch_rows(x, gate, up, pred_logits, row_ids, pred_threshold, code,
                        act_threshold, config or DEFAULT_CONFIG)


def _down_grid(n: int, d: int, cfg: LaunchConfig, device) -> dict:
    """Block sizes, number of row splits and rows per split of the down projection."""
    chunk_n, tile_n = _chunk_tile(n, cfg.down_chunk_n, cfg.down_tile_n, cfg.packed)
    block_d = _block_d(d, cfg.down_block_d)
    d_tiles = _cdiv(d, block_d)
    n_chunks = _cdiv(n, chunk_n)
    splits = cfg.down_splits or _cdiv(cfg.programs_per_sm * _sm_count(device), d_tiles)
    splits = max(1, min(splits, n_chunks))
    rows_per_split = _cdiv(n_chunks, splits) * chunk_n
    return dict(chunk_n=chunk_n, tile_n=tile_n, block_d=block_d, d_tiles=d_tiles,
                splits=_cdiv(n, rows_per_split), rows_per_split=rows_per_split)


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _tile_counters(device: torch.device, d_tiles: int) -> torch.Tensor:
    """Zeroed int32 [d_tiles] for down_kernel's last-program reduction. The kernel leaves
    them at 0, so one buffer per (device, stream) serves every call in stream order (two
    streams must not share one). Under CUDA graph capture (a side stream) the buffer is
    allocated and zeroed inside the graph: each replay starts from zeros as well."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < d_tiles:
        buf = torch.zeros(max(d_tiles, 64), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def down_proj_triton(act: torch.Tensor, down_t: torch.Tensor, *,
                     config: LaunchConfig | None = None) -> torch.Tensor:
    """y fp32 [d] = sum over rows i with act[i] != 0 of act[i] * down_t[i]."""
    _check_device(down_t)
    _check_rows("down_t", down_t, None, down_t.device)
    n, d = down_t.shape
    act = _vector("act", act, n, down_t.device)
    if act.dtype != torch.float32:
        raise ValueError(f"act must be fp32, got {act.dtype}")
    if n == 0:
        return torch.zeros(d, dtype=torch.float32, device=down_t.device)
    cfg = config or DEFAULT_CONFIG
    g = _down_grid(n, d, cfg, down_t.device)
    partials = torch.empty((g["splits"], d), dtype=torch.float32, device=down_t.device)
    y = torch.empty(d, dtype=torch.float32, device=down_t.device)
    _kernels().down_kernel[(g["d_tiles"], g["splits"])](
        act, down_t, partials, _tile_counters(down_t.device, g["d_tiles"]), y, n, d,
        down_t.stride(0), g["rows_per_split"], g["splits"],
        PACKED=cfg.packed, CHUNK_N=g["chunk_n"], TILE_N=g["tile_n"], BLOCK_D=g["block_d"],
        num_warps=cfg.down_warps,
    )
    return y


def sparse_ffn_triton(x, gate, up, down_t, pred_logits, pred_threshold, activation,
                      act_threshold=0.0, row_ids=None, *,
                      config: LaunchConfig | None = None) -> torch.Tensor:
    """y fp32 [d]: the FFN output of the neurons whose logit >= pred_threshold.

    x [d] fp16/bf16/fp32; gate [n, d] or None (ungated, Falcon); up, down_t [n, d]
    fp16/bf16 (fp32 for tests), rows contiguous; pred_logits fp32 [n], or None to compute
    every row; pred_threshold a Python float (a CUDA scalar tensor would cost a host
    sync); activation in ACTIVATIONS (act_threshold is FATReLU's threshold).
    row_ids [n] int32/int64: for packed hot rows, row i is neuron row_ids[i] and its logit
    is pred_logits[row_ids[i]] (pred_logits then covers the whole layer).
    """
    if down_t.shape != up.shape:
        raise ValueError(f"down_t has shape {tuple(down_t.shape)}, expected {tuple(up.shape)}")
    act = ffn_activations_triton(x, gate, up, pred_logits, pred_threshold, activation,
                                 act_threshold, row_ids, config=config)
    return down_proj_triton(act, down_t, config=config)


def predictor_triton(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, *,
                     config: LaunchConfig | None = None) -> torch.Tensor:
    """logits fp32 [n] = fc2 @ relu(fc1 @ x); fc1 [rank, d], fc2 [n, rank]. Two launches
    of the row kernel (relu fused into the first), fp32 accumulation and output."""
    _check_device(fc1)
    _check_rows("fc1", fc1, None, fc1.device)
    _check_rows("fc2", fc2, None, fc1.device)
    rank, d = fc1.shape
    if fc2.shape[1] != rank:
        raise ValueError(f"fc2 has shape {tuple(fc2.shape)}, expected [n, {rank}]")
    x = _vector("x", x, d, fc1.device)
    cfg = config or PREDICTOR_CONFIG
    codes = _kernels().ACTIVATION_CODES
    h = _launch_rows(x, None, fc1, None, None, 0.0, codes["relu"], 0.0, cfg)
    return _launch_rows(h, None, fc2, None, None, 0.0, codes["identity"], 0.0, cfg)


def predictor_torch(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """The same predictor with cuBLAS mat-vecs (the baseline `predictor_triton` must beat)."""
    h = torch.relu(torch.nn.functional.linear(x.reshape(1, -1).to(fc1.dtype), fc1))
    return torch.nn.functional.linear(h, fc2).reshape(-1).float()


def with_overrides(config: LaunchConfig | None = None, **fields) -> LaunchConfig:
    """A copy of `config` (default: DEFAULT_CONFIG) with some fields changed."""
    return replace(config or DEFAULT_CONFIG, **fields)
