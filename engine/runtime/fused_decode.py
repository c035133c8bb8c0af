"""The decode step as one compiled call per CPU layer (engine.kernels.decode_layer), where
every layer and the head have the shape it computes; otherwise `Transformer.forward`'s
unfused path, which stays the reference.

The shape: a llama-family layer on the CPU in fp32 (RMSNorms, fused qkv without bias, rotary
or none, GQA, a plain (not rolling) KV cache in fp16 or fp32, the out projection, muP's
residual scale) whose FFN is either the sparse modes' predicted rows (a predictor; cold rows,
and hot rows where the CPU stands in for the fast tier; no oracle, no scoring, no benchmark
masks) or a dense FFN without biases (fp32, int8 or int4), or a mixture's experts in tiers
(engine.hotcold.moe_tiers.TieredMoe: router, top-k, the chosen experts' rows on the CPU tier
and hot rows where the CPU stands in for the fast tier, their predictors where they have
them; no prefetch thread); the final RMSNorm and the head on the CPU. Anything else (a GPU
layer or hot rows on a GPU, Falcon's LayerNorm and parallel block, biases, a sliding window,
a mixture's dense mode, an FFN observer, prefill) takes the unfused path for the whole token.

Each layer's arguments (numpy views of its weights, kinds, sizes) are prepared once and kept
on the layer with the objects they were built from; a re-placement that swaps any of them
(a layer moved between tiers, neurons promoted, a new cache) rebuilds them at the next token.

`THERMOCLINE_FUSED_DECODE=0` turns it off (the unfused path, the reference); 1 or unset: on.
"""

from __future__ import annotations

import atexit
import operator
import os
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import UserError
from engine.hotcold import hot_q4
from engine.kernels import cpu_q4, numba_pool, q4_format, q4_rows
from engine.kernels import cpu as cpu_kernels
from engine.kernels.quantized import Int8Matrix, Q4Matrix, Q4MinMatrix
from engine.hotcold.hybrid_ffn import HybridFfn
from engine.hotcold.moe_tiers import ColdExperts, TieredMoe, row_bytes
from engine.hotcold.neuron_cache import DiskFfn
from engine.loading.dense_quant import QuantDenseFfn
from engine.model.layers import DenseFfn
from engine.model.moe import ExpertPredictors

FUSED_ENV = "THERMOCLINE_FUSED_DECODE"
_SWITCH = {"": True, "1": True, "on": True, "true": True, "yes": True,
           "0": False, "off": False, "false": False, "no": False}
_EMPTY_BYTES = np.empty((0, 0), dtype=np.uint8)
_EMPTY_F32 = np.empty(0, dtype=np.float32)
_EMPTY_IDS = np.empty(0, dtype=np.int64)
_checked: tuple[str, bool] | None = None  # (raw value, parsed): the environment is read per token
# decode_layer's entry points a first start's background preparation does not wait for
# (engine.runtime.kernel_preparation): a mixture's layer and a disk tier's, which a model in RAM
# never runs (fused_decode.warm compiles them where the model has such layers).
UNTRACKED = ("decode_moe_layer", "moe_ffn", "moe_experts", "moe_experts_tokens", "decode_layer_front",
             "decode_layer_rows")


def enabled(value: str | None = None) -> bool:
    """The switch: `value`, else THERMOCLINE_FUSED_DECODE (unset: on). UserError for another value."""
    global _checked
    raw = os.environ.get(FUSED_ENV, "") if value is None else value
    if _checked is not None and _checked[0] == raw:
        return _checked[1]
    parsed = _SWITCH.get(raw.strip().lower())
    if parsed is None:
        raise UserError(f"{FUSED_ENV}={raw!r} is not a switch: 1 (the default: one compiled call per CPU layer's "
                        "decode step) or 0 (the unfused path, the reference)")
    _checked = (raw, parsed)
    return parsed


_module = None  # engine.kernels.decode_layer once imported; False when it cannot run here


def module():
    """engine.kernels.decode_layer, or None: no numba (or turned off), no AVX2 (its kernels
    hold AVX2 code), or the module failed to import."""
    global _module
    if _module is None:
        kern = numba_pool.module()
        if kern is None or not kern.HAS_AVX2:
            return None  # not cached: tests turn numba off and on
        try:
            from engine.kernels import decode_layer  # numba at import: only where it runs
            _module = decode_layer
        except Exception as e:  # noqa: BLE001 - a broken numba/llvmlite: the unfused path still runs
            warnings.warn(f"fused decode unavailable ({e}); using the unfused path", RuntimeWarning, stacklevel=2)
            _module = False
    if _module is False or numba_pool.module() is None:
        return None
    return _module


def kernels():
    """`module()` where the calling thread may launch its layer and head functions (a first
    start's kernel gate may not have taken them in yet: engine.kernels.numba_pool)."""
    dl = module()
    if dl is None or not numba_pool.usable(dl.decode_layer, dl.decode_head):
        return None
    return dl


# ------------------------------------------------------------------ the arguments, once
def _matrix(dl, w) -> tuple | None:
    """(kind, bytes uint8 [n, row bytes], scale fp32) of a weight matrix as its unfused product
    reads it, or None when the fused call does not read this storage."""
    if isinstance(w, Int8Matrix):
        q, scale = w.q, w.scale
        if (q.device.type != "cpu" or q.dtype != torch.int8 or not q.is_contiguous() or q.dim() != 2
                or scale.dtype != torch.float32 or not scale.is_contiguous()):
            return None
        # cpu.matmul_int8's condition for its int8 x int8 product, else matvec_int8
        kind = dl.M_INT8_Q8 if q.shape[0] >= 4 and cpu_kernels.int8_activations_available(q.shape[1]) else dl.M_INT8
        out = kind, q.numpy().view(np.uint8), scale.numpy()
        return out if _plain(*out[1:]) else None
    if isinstance(w, Q4Matrix):
        q = w.q
        if q.device.type != "cpu" or not q.is_contiguous() or q.shape[0] == 0:
            return None
        if w.packed:
            kind = dl.M_Q4X8  # cpu_q4x8.matmul_packed
        else:
            kind = dl.M_Q4_TILES if q4_format.n_blocks(w.cols) % 8 == 0 else dl.M_Q4  # matmul_q4_tiles, else matmul_q4
        return (kind, q.numpy(), _EMPTY_F32) if _plain(q.numpy()) else None
    if isinstance(w, Q4MinMatrix):  # Q4_1 blocks: the 4-bit rows' kind, the block offsets as the scale
        rows, off = _matrix(dl, w.rows), w.offsets
        if (rows is None or off.device.type != "cpu" or off.dtype != torch.float32 or not off.is_contiguous()
                or tuple(off.shape) != (w.q.shape[0], w.q.shape[1] // q4_format.BLOCK_BYTES)):
            return None
        offsets = off.numpy().reshape(-1)
        return (rows[0] + dl.Q4MIN_SHIFT, rows[1], offsets) if _plain(offsets) else None
    if isinstance(w, torch.Tensor):
        if w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous() or w.dim() != 2:
            return None
        return (dl.M_FP32, w.numpy().view(np.uint8), _EMPTY_F32) if _plain(w.numpy()) else None
    return None


def _plain(*arrays: np.ndarray) -> bool:
    """Writable and aligned, as the arrays the layer function was compiled for: another flag
    would make numba compile a second copy of it (minutes) for the same work."""
    return all(a.flags.writeable and a.flags.aligned for a in arrays)


def _rows(dl, rows, plain: bool = True) -> tuple | None:
    """(kind, gate, gate_scale, up, up_scale, down, down_scale) of FFN rows in the CPU kernels' storage.
    `plain`: only arrays of the flags the layer function was compiled for (an expert table holds
    addresses: any flags do)."""
    if isinstance(rows, q4_rows.Q4FfnRows):
        gate, up, down = (t.numpy() if t is not None else None for t in (rows.gate, rows.up, rows.down_t))
        out = dl.R_Q4, gate if gate is not None else up, _EMPTY_F32, up, _EMPTY_F32, down, _EMPTY_F32
    elif isinstance(rows, cpu_kernels.CpuFfnRows):
        gate, gs, up, us, down, ds = rows._numpy_views()
        kind = dl.R_INT8 if rows.quant == "int8" else dl.R_FP32
        out = kind, gate.view(np.uint8), gs, up.view(np.uint8), us, down.view(np.uint8), ds
    else:
        return None
    return out if not plain or _plain(*out[1:]) else None


@dataclass
class FusedLayer:
    """A layer's prepared arguments (None: it takes the unfused path) and what they were built from."""
    key: tuple
    args: tuple | None
    why: str = ""            # why not, when args is None
    sparse: bool = False     # predicted rows: the runtime's counters count them
    q4: bool = False         # 4-bit parts: the int8 x 4-bit kernels must be on (cpu_q4.USE_INT8_ACTIVATIONS)
    n_ff: int = 0
    calls: int = 0           # decode steps this layer ran fused (tests check the path is taken)
    moe: "FusedMoe | None" = None  # a mixture's layer: decode_moe_layer, and what its counters need
    # a layer whose cold rows the disk tier's cache holds (args None): decode_layer_front's
    # arguments, and decode_layer_rows' up to the cache's slots (the reads come in between)
    disk: "tuple[tuple, tuple] | None" = None
    weight_bytes: int | None = None  # its arrays' bytes (fused_batch's thread count)


@dataclass
class FusedMoe:
    """What a mixture's fused step needs beside its arguments: the outputs it fills, the row
    bytes per tier (the counters), and the arrays whose addresses the expert table holds."""
    chosen: np.ndarray       # int64 [k]
    weights: np.ndarray      # fp32 [k]
    stats: np.ndarray        # int64 [k, 2, 2]
    row_bytes: tuple[int, int]
    keep: list
    q4: bool = False         # 4-bit parts (the router, the rows, the predictors)


def _layer_key(model, index: int, layer, cache) -> tuple:
    """What a layer's prepared arguments were built from (cache None: all but the KV cache, the
    batched decode's, whose sequences each bring their own)."""
    ffn = layer.ffn
    hooks = getattr(getattr(ffn, "context", None), "_hooks", None)
    predictors = getattr(hooks, "predictors", None)
    fc = (predictors.fc1[index], predictors.fc2[index]) if predictors is not None else (None, None)
    moe = (ffn.predictors, getattr(ffn.hot, "epoch", None), getattr(ffn.cold, "epoch", None), layer.router) \
        if type(ffn) is TieredMoe else ()
    return (layer.qkv, layer.out, layer.attn_norm.weight, layer.mlp_norm.weight if layer.mlp_norm else None,
            layer.device, ffn, getattr(ffn, "cold", None), getattr(ffn, "hot", None), predictors, *fc,
            getattr(getattr(ffn, "cache", None), "rows", None),  # the disk tier's pool (a resize makes a new one)
            *((cache.k[index], cache.v[index]) if cache is not None else ()), hot_q4.TRITON_ON_CPU, *moe)


def _hot_rows(dl, hot) -> tuple | None:
    """The hot rows' kernel arguments and ids when the CPU stands in for the fast tier and
    HybridFfn runs them in the CPU kernels (fp32 rows, or 4-bit rows outside Triton's interpreter)."""
    if getattr(hot, "quant", None) == hot_q4.HOT_INT4:
        rows = hot.q4_rows if not hot_q4.TRITON_ON_CPU else None
    else:
        rows = hot.cpu_rows
    ids = hot.ids
    if rows is None or ids.dtype != torch.int64 or ids.device.type != "cpu" or not ids.is_contiguous():
        return None
    args = _rows(dl, rows)
    return None if args is None else (*args, ids.numpy())


def _why_not_layer(model, index: int, layer, cache) -> str:
    if layer.device.type != "cpu" or layer.dtype != torch.float32:
        return "not an fp32 CPU layer"
    if layer.parallel or layer.mlp_norm is None:
        return "parallel attention and MLP (Falcon)"
    if layer.attn_norm.bias is not None or layer.mlp_norm.bias is not None:
        return "LayerNorm"
    if layer.qkv_bias is not None or layer.out_bias is not None:
        return "attention biases"
    if layer.router is not None and type(layer.ffn) is not TieredMoe:
        return "a mixture of experts not in tiers"
    if layer.window is not None or cache.rolling:  # (a window longer than the position: see decode_step)
        return "a sliding window"
    k, v = cache.k[index], cache.v[index]
    if (k.device.type != "cpu" or k.dtype not in (torch.float16, torch.float32) or v.dtype != k.dtype
            or not k.is_contiguous() or not v.is_contiguous()):
        return "a KV cache the kernel does not read"
    cfg = model.config
    if cfg.num_heads % cfg.num_kv_heads or tuple(k.shape[::2]) != (cfg.num_kv_heads, cfg.head_dim):
        return "an attention shape the kernel does not read"
    return ""


def _build_layer(dl, model, index: int, layer, cache) -> FusedLayer:
    key = _layer_key(model, index, layer, cache)
    why = _why_not_layer(model, index, layer, cache)
    if why:
        return FusedLayer(key, None, why)
    qkv, out = _matrix(dl, layer.qkv), _matrix(dl, layer.out)
    if qkv is None or out is None:
        return FusedLayer(key, None, "attention weights in a storage the kernel does not read")
    if not all(w.dtype == torch.float32 and w.is_contiguous() for w in (layer.attn_norm.weight,
                                                                        layer.mlp_norm.weight)):
        return FusedLayer(key, None, "norm weights not contiguous fp32")
    ffn = layer.ffn
    if type(ffn) is TieredMoe:
        return _build_moe(dl, model, layer, key, _attention_args(model, index, layer, cache, qkv, out))
    mats = [qkv, out]
    fc1 = fc2 = rows = hot = gate_up = down = None
    row_ids = _EMPTY_IDS
    if type(ffn) is DiskFfn:
        return _build_disk_layer(dl, model, index, layer, cache, key, qkv, out)
    if type(ffn) is HybridFfn:
        hooks = ffn.context._hooks
        hot = _hot_rows(dl, ffn.hot) if len(ffn.hot) else None
        if len(ffn.hot) and hot is None:
            return FusedLayer(key, None, "hot rows on another device")
        if ffn.context.mode == "oracle" or hooks.predictors is None:
            return FusedLayer(key, None, "no predictor (oracle)")
        fc1, fc2 = _matrix(dl, hooks.predictors.fc1[index]), _matrix(dl, hooks.predictors.fc2[index])
        rows = _rows(dl, ffn.cold.rows)
        if fc1 is None or fc2 is None or rows is None:
            return FusedLayer(key, None, "predictor or rows in a storage the kernel does not read")
        ids = ffn.cold.ids
        if ids.dtype != torch.int64 or ids.device.type != "cpu" or not ids.is_contiguous():
            return FusedLayer(key, None, "row ids")
        mats += [fc1, fc2]
        row_ids, ffn_kind = ids.numpy(), dl.FFN_ROWS
    elif type(ffn) in (DenseFfn, QuantDenseFfn):
        if ffn.up_bias is not None or ffn.down_bias is not None:
            return FusedLayer(key, None, "FFN biases")
        gate_up = _matrix(dl, ffn.gate_up)
        if type(ffn) is QuantDenseFfn:
            down, ffn_kind = _matrix(dl, ffn.down), dl.FFN_DENSE_LINEAR
        else:
            down, ffn_kind = _matrix(dl, ffn.down_t), dl.FFN_DENSE_COMBINE
            if down is not None and down[0] != dl.M_FP32:
                down = None
        if gate_up is None or down is None:
            return FusedLayer(key, None, "FFN weights in a storage the kernel does not read")
        mats += [gate_up, down]
    else:
        return FusedLayer(key, None, f"an FFN of type {type(ffn).__name__}")
    gated = bool(ffn.gated)
    code = numba_pool.module().ACTIVATION_CODES[ffn.activation]
    empty_m = (dl.M_FP32, _EMPTY_BYTES, _EMPTY_F32)
    fc1, fc2, gate_up, down = (m or empty_m for m in (fc1, fc2, gate_up, down))
    no_rows = (dl.R_FP32, _EMPTY_BYTES, _EMPTY_F32, _EMPTY_BYTES, _EMPTY_F32, _EMPTY_BYTES, _EMPTY_F32)
    rows = rows or no_rows
    hot = hot or (*no_rows, _EMPTY_IDS)
    args = (*_attention_args(model, index, layer, cache, qkv, out),
            ffn_kind, int(ffn.n_ff), gated, code, float(ffn.threshold),
            *fc1, *fc2, *rows, row_ids, *hot, *gate_up, *down)
    q4 = any(_four_bit(dl, m[0]) for m in mats) or dl.R_Q4 in (rows[0], hot[0])
    return FusedLayer(key, args, sparse=ffn_kind == dl.FFN_ROWS, q4=q4, n_ff=int(ffn.n_ff))


def _build_disk_layer(dl, model, index: int, layer, cache, key: tuple, qkv: tuple, out: tuple) -> FusedLayer:
    """A layer whose cold rows the disk tier's cache holds (DiskFfn): two compiled calls around
    the cache's reads, decode_layer_front and decode_layer_rows."""
    ffn = layer.ffn
    hooks = ffn.context._hooks
    if ffn.context.mode == "oracle" or hooks.predictors is None:
        return FusedLayer(key, None, "no predictor (oracle)")
    hot = _hot_rows(dl, ffn.hot) if len(ffn.hot) else None
    if len(ffn.hot) and hot is None:
        return FusedLayer(key, None, "hot rows on another device")
    fc1, fc2 = _matrix(dl, hooks.predictors.fc1[index]), _matrix(dl, hooks.predictors.fc2[index])
    rows = _rows(dl, ffn.cache.rows)
    if fc1 is None or fc2 is None or rows is None:
        return FusedLayer(key, None, "predictor or cache rows in a storage the kernel does not read")
    no_rows = (dl.R_FP32, _EMPTY_BYTES, _EMPTY_F32, _EMPTY_BYTES, _EMPTY_F32, _EMPTY_BYTES, _EMPTY_F32)
    hot = hot or (*no_rows, _EMPTY_IDS)
    attention = _attention_args(model, index, layer, cache, qkv, out)
    code = numba_pool.module().ACTIVATION_CODES[ffn.activation]
    res = model.residual_scale
    back = (float(res if res is not None else 1.0), res is not None, bool(ffn.gated), code, float(ffn.threshold),
            *rows)
    q4 = any(_four_bit(dl, m[0]) for m in (qkv, out, fc1, fc2)) or dl.R_Q4 in (rows[0], hot[0])
    return FusedLayer(key, None, "cold rows on the disk tier: two calls", sparse=True, q4=q4, n_ff=int(ffn.n_ff),
                      disk=((*attention, *fc1, *fc2), (back, hot)))


ATTENTION_CACHE = 16  # a layer's arguments (_attention_args) hold the KV cache's two views here, then its fp16 flag


def _attention_args(model, index: int, layer, cache, qkv: tuple, out: tuple) -> tuple:
    """The layer functions' first arguments: norms, attention shape, qkv and out, the KV cache."""
    cfg = model.config
    res = model.residual_scale
    k, v = cache.k[index], cache.v[index]
    return (layer.attn_norm.weight.numpy(), layer.mlp_norm.weight.numpy(), float(layer.attn_norm.eps),
            bool(layer.rope), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(model.scale),
            float(res if res is not None else 1.0), res is not None,
            *qkv, *out, k.view(torch.uint8).numpy(), v.view(torch.uint8).numpy(), k.dtype == torch.float16)


def _address(a: np.ndarray) -> int:
    return int(a.ctypes.data) if a.size else 0


def _expert_table(dl, ffn: TieredMoe):
    """(tier kinds, row bytes, the table of decode_moe_layer, arrays it points into) or a reason
    (str) why the kernel cannot read the experts' rows."""
    table = np.zeros((2, ffn.num_experts, 8), dtype=np.int64)
    kinds = np.array([dl.R_FP32, dl.R_FP32], dtype=np.int64)
    widths = np.zeros(2, dtype=np.int64)
    keep = []
    tiers = ((ffn.cold, ffn.cold.rows), (ffn.hot, ffn.hot.cpu_rows))
    for t, (tier, rows_of) in enumerate(tiers):
        if len(rows_of) != len(tier):
            return "expert rows not held in RAM"
        kind = width = None
        for e, rows in rows_of.items():
            args = _rows(dl, rows, plain=False)
            if args is None or any(not a.flags.c_contiguous for a in args[1:]) \
                    or any(a.ndim != 2 for a in args[1::2]):
                return "expert rows in a storage the kernel does not read"
            ids = tier.neuron_ids[e]
            whole = len(ids) == ffn.n_ff
            if not whole and (ids.dtype != torch.int64 or not ids.is_contiguous()):
                return "expert row ids"
            k, g, gs, u, us, dn, ds = args
            if (kind is not None and k != kind) or (width is not None and g.shape[1] != width) \
                    or not g.shape[1] == u.shape[1] == dn.shape[1] or not g.shape[0] == u.shape[0] == dn.shape[0]:
                return "experts in mixed storage"
            kind, width = k, g.shape[1]
            scaled = k == dl.R_INT8
            ids_np = ids.numpy() if not whole else None
            table[t, e] = (g.shape[0], _address(g), _address(gs) if scaled else 0, _address(u),
                           _address(us) if scaled else 0, _address(dn), _address(ds) if scaled else 0,
                           _address(ids_np) if ids_np is not None else 0)
            keep += [g, gs, u, us, dn, ds, ids_np]
        if kind is not None:
            kinds[t], widths[t] = kind, width
    return kinds, widths, table, keep


def _predictor_table(dl, predictors, n_ff: int):
    """(fc1 kind, fc2 kind, rank, fc1 row bytes, fc2 row bytes, table int64 [E, 4], kept arrays) or None."""
    fc1 = [_matrix(dl, w) for w in predictors.fc1]
    fc2 = [_matrix(dl, w) for w in predictors.fc2]
    if any(m is None for m in fc1 + fc2):
        return None
    if len({(m[0], m[1].shape) for m in fc1}) != 1 or len({(m[0], m[1].shape) for m in fc2}) != 1:
        return None
    if any(m[0][0] >= dl.M_Q4MIN_TILES for m in (fc1, fc2)):  # the table holds one scale a row, no block offsets
        return None
    rank = fc1[0][1].shape[0]
    if fc2[0][1].shape[0] != n_ff:
        return None
    table = np.zeros((len(fc1), 4), dtype=np.int64)
    for e, (m1, m2) in enumerate(zip(fc1, fc2)):
        table[e] = _address(m1[1]), _address(m1[2]), _address(m2[1]), _address(m2[2])
    keep = [a for m in fc1 + fc2 for a in m[1:]]
    return fc1[0][0], fc2[0][0], rank, fc1[0][1].shape[1], fc2[0][1].shape[1], table, keep


def moe_expert_args(dl, ffn: TieredMoe) -> tuple[tuple, list, bool] | str:
    """decode_layer.moe_experts' arguments after (hm, threads, chosen, weights), up to stats; the
    arrays the expert table points into; whether 4-bit parts are read. Or why the kernel cannot
    run this mixture's experts (a str)."""
    if len(ffn.hot) and not ffn.hot.on_cpu:
        return "hot experts on another device"
    if type(ffn.cold) is not ColdExperts:
        return "cold experts on the disk tier"  # their rows are read into the neuron cache per token
    experts = _expert_table(dl, ffn)
    if isinstance(experts, str):
        return experts
    kinds, widths, table, keep = experts
    use_pred = ffn.predictors is not None and ffn.runtime.mode != "oracle"  # TieredMoe._predicting, not scoring
    empty = (dl.M_FP32, dl.M_FP32, 0, 0, 0, np.zeros((ffn.num_experts, 4), dtype=np.int64), [])
    preds = _predictor_table(dl, ffn.predictors, ffn.n_ff) if use_pred else empty
    if preds is None:
        return "expert predictors in a storage the kernel does not read"
    *pred_args, pred_keep = preds
    code = numba_pool.module().ACTIVATION_CODES[ffn.activation]
    args = (int(ffn.n_ff), code, float(ExpertPredictors.THRESHOLD), use_pred, *pred_args, kinds, widths, table)
    q4 = dl.R_Q4 in kinds.tolist() or (use_pred and any(_four_bit(dl, m) for m in pred_args[:2]))
    return args, keep + pred_keep, q4


def moe_ffn_args(dl, ffn: TieredMoe, router, top_k: int, softmax: bool) -> tuple[tuple, FusedMoe] | str:
    """decode_layer.moe_ffn's arguments after (route_x, hm, threads), up to its outputs, and the
    FusedMoe that holds those outputs; or why the kernel cannot run this mixture (a str)."""
    router = _matrix(dl, router)
    if router is None:
        return "a router in a storage the kernel does not read"
    experts = moe_expert_args(dl, ffn)
    if isinstance(experts, str):
        return experts
    args, keep, q4 = experts
    tier_bytes = tuple(row_bytes(next(iter(rows.values()))) if rows else 0
                       for rows in (ffn.cold.rows, ffn.hot.cpu_rows))
    moe = FusedMoe(np.zeros(top_k, dtype=np.int64), np.zeros(top_k, dtype=np.float32),
                   np.zeros((top_k, 2, 2), dtype=np.int64), tier_bytes, keep, q4 or _four_bit(dl, router[0]))
    return (*router, top_k, softmax, *args), moe


def _build_moe(dl, model, layer, key: tuple, attention: tuple) -> FusedLayer:
    """A mixture's layer (TieredMoe): decode_moe_layer's arguments."""
    cfg = model.config
    built = moe_ffn_args(dl, layer.ffn, layer.router, int(cfg.experts_per_token), bool(cfg.router_softmax))
    if isinstance(built, str):
        return FusedLayer(key, None, built)
    args, moe = built
    q4 = moe.q4 or any(_four_bit(dl, m[0]) for m in (attention[10:13], attention[13:16]))
    return FusedLayer(key, (*attention, cfg.router_input == "layer", *args), q4=q4, n_ff=int(layer.ffn.n_ff),
                      moe=moe)


def _build_head(dl, model) -> FusedLayer:
    norm, head = model.final_norm, model.lm_head
    key = (norm.weight, head)
    if (norm.bias is not None or norm.weight.device.type != "cpu" or norm.weight.dtype != torch.float32
            or not norm.weight.is_contiguous()):
        return FusedLayer(key, None, "the final norm is not an fp32 CPU RMSNorm")
    m = _matrix(dl, head)
    if m is None:
        return FusedLayer(key, None, "the head is not on the CPU in a storage the kernel reads")
    scale = model.logit_scale
    args = (norm.weight.numpy(), float(norm.eps), float(scale if scale is not None else 1.0), scale is not None, *m)
    return FusedLayer(key, args, q4=_four_bit(dl, m[0]))


def _four_bit(dl, kind: int) -> bool:
    """A matrix kind of 4-bit rows (Q4_0, or Q4_1's): int8 activations (cpu_q4.USE_INT8_ACTIVATIONS)."""
    return kind in (dl.M_Q4, dl.M_Q4_TILES, dl.M_Q4X8, dl.M_Q4MIN, dl.M_Q4MIN_TILES, dl.M_Q4MIN_X8)


def _current(plan: FusedLayer | None, key: tuple) -> bool:
    return plan is not None and len(plan.key) == len(key) and all(map(operator.is_, plan.key, key))


def layer_plan(dl, model, index: int, layer, cache, batched: bool = False) -> FusedLayer:
    """The layer's prepared arguments, rebuilt when what they were built from changed. `batched`:
    the batched decode's (engine.runtime.fused_batch), kept apart and keyed without the KV cache:
    its arguments' cache views are `cache`'s, which that decode replaces per sequence."""
    key = _layer_key(model, index, layer, None if batched else cache)
    plan = getattr(layer, "fused_batch" if batched else "fused", None)
    if not _current(plan, key):
        plan = _build_layer(dl, model, index, layer, cache)
        plan.key = key
        if batched and plan.args is not None and plan.moe is None:  # no hold on that sequence's cache
            plan.args = (*plan.args[:ATTENTION_CACHE], None, None, *plan.args[ATTENTION_CACHE + 2:])
        setattr(layer, "fused_batch" if batched else "fused", plan)
    return plan


def head_plan(dl, model) -> FusedLayer:
    """The final norm's and the head's prepared arguments, rebuilt when either changed."""
    head = getattr(model, "fused_head", None)
    if not _current(head, (model.final_norm.weight, model.lm_head)):
        head = model.fused_head = _build_head(dl, model)
    return head


# ------------------------------------------------------------------ the step
def decode_step(model, ids: torch.Tensor, start: int, cache) -> torch.Tensor | None:
    """Logits [1, vocab] of the one token `ids` at position `start`, every layer in one compiled
    call; None (nothing done) where the model, the switch or this token needs the unfused path."""
    if ids.shape[0] != 1 or model.ffn_observer is not None or not enabled():
        return None
    if cache.window is not None and start >= cache.window:  # a window that now hides early positions
        return None
    dl = kernels()
    if dl is None:
        return None
    cpu = torch.device("cpu")
    table = model.rotary.get(cpu)
    if table is None or table.cos.dtype != torch.float32:
        return None
    plans = []
    for index, layer in enumerate(model.layers):
        plan = layer_plan(dl, model, index, layer, cache)
        if plan.args is None and plan.disk is None:
            return None
        if plan.disk is not None and not numba_pool.usable(dl.decode_layer_front, dl.decode_layer_rows):
            return None  # a first start's preparation has not handed them over yet
        if plan.moe is not None:
            runtime = layer.ffn.runtime
            if runtime.scoring_mode is not None or runtime.prefetcher is not None:
                return None  # the prefetcher's reads start before attention, in the unfused path
            if not numba_pool.usable(dl.decode_moe_layer):
                return None  # a first start's preparation has not handed it over yet
        if plan.sparse:
            hooks = layer.ffn.context._hooks
            if hooks.scoring_mode is not None or hooks.override_masks is not None:
                return None
        plans.append(plan)
    head = head_plan(dl, model)
    if head.args is None:
        return None
    if (head.q4 or any(p.q4 for p in plans)) and not cpu_q4.int8_activations(numba_pool.module()):
        return None  # the unfused path runs cpu_q4's fp32 kernels then: the reference of that setting
    cache.prepare(start, 1)
    table.at(start, 1)  # grows the table when the position is past it
    cos, sin = table.cos.numpy(), table.sin.numpy()
    x = embedded_rows(model, ids).reshape(-1)
    kern = numba_pool.module()
    for layer, plan in zip(model.layers, plans):
        if plan.moe is not None:
            m = plan.moe
            with numba_pool.lock:
                dl.decode_moe_layer(x, start, numba_pool.use_threads(kern), cos, sin, *plan.args, m.chosen, m.weights,
                                    m.stats)
            plan.calls += 1
            layer.ffn.count_fused(m.chosen.tolist(), m.stats, m.row_bytes)
            continue
        pthr = layer.ffn.context.threshold if plan.sparse else 0.0
        if plan.disk is not None:
            count, count_hot = _disk_layer(dl, kern, layer.ffn, plan, x, start, cos, sin, float(pthr))
        else:
            with numba_pool.lock:
                threads = numba_pool.use_threads(kern)
                count, count_hot = dl.decode_layer(x, start, threads, cos, sin, float(pthr), *plan.args)
        plan.calls += 1
        if plan.sparse:
            counters = layer.ffn.context.counters
            counters.considered += plan.n_ff
            counters.computed = counters.computed + count
            if count_hot:
                counters.computed_hot = counters.computed_hot + count_hot
    with numba_pool.lock:
        logits = dl.decode_head(x, numba_pool.use_threads(kern), *head.args)
    head.calls += 1
    return torch.from_numpy(logits)[None]


def embedded_rows(model, ids: torch.Tensor) -> np.ndarray:
    """The rows' embeddings [R, d] (fp32, a new array). A CPU fp32 table is read through numpy:
    each torch op hands the GIL to any thread waiting for it (the server's event loop), and the
    engine then waits out that thread's turn before its next layer."""
    embed = model.embed
    if embed.device.type == "cpu" and embed.dtype == torch.float32:
        X = embed.numpy()[ids.numpy()]
        if model.embedding_scale is not None:
            X *= np.float32(model.embedding_scale)
        return X
    x = embed[ids.to(embed.device)]
    if model.embedding_scale is not None:
        x = x * model.embedding_scale
    return np.ascontiguousarray(x.to(torch.device("cpu"), torch.float32).numpy()).copy()


@dataclass
class PromptExperts:
    """A mixture's prepared arguments for a prompt's experts (decode_layer.moe_experts_tokens)."""
    key: tuple
    args: tuple | None       # None: the unfused path (why says why)
    why: str = ""
    keep: list = field(default_factory=list)
    q4: bool = False
    calls: int = 0           # prompts computed here (tests check the path is taken)


def moe_prompt(ffn: TieredMoe, x: torch.Tensor, routing) -> torch.Tensor | None:
    """A mixture's FFN over a prompt's tokens (x fp32 [T, d], routing's experts and weights) in
    one compiled call, the tokens split across the threads: fp32 [T, d]; or None (nothing done)
    where the kernel cannot read this mixture now (TieredMoe's own path then runs)."""
    if x.device.type != "cpu" or x.dim() != 2 or not enabled():
        return None
    runtime = ffn.runtime
    if runtime.scoring_mode is not None:
        return None
    dl = kernels()
    if dl is None or not numba_pool.usable(dl.moe_experts_tokens):
        return None
    key = (ffn.predictors, ffn.hot, ffn.cold, getattr(ffn.hot, "epoch", None), getattr(ffn.cold, "epoch", None),
           runtime.mode)
    plan = getattr(ffn, "fused_prompt", None)
    if plan is None or not all(a is b or (type(a) in (int, str) and a == b) for a, b in zip(plan.key, key)):
        built = moe_expert_args(dl, ffn)
        plan = ffn.fused_prompt = (PromptExperts(key, None, built) if isinstance(built, str)
                                   else PromptExperts(key, built[0], keep=built[1], q4=built[2]))
    if plan.args is None or (plan.q4 and not cpu_q4.int8_activations(numba_pool.module())):
        return None
    hms = x.to(torch.float32).contiguous().numpy()
    chosen = routing.experts.to("cpu", torch.int64).contiguous().numpy()
    weights = routing.weights.to("cpu", torch.float32).contiguous().numpy()
    stats = np.empty((*chosen.shape, 2, 2), dtype=np.int64)
    with numba_pool.lock:
        numba_pool.use_threads(numba_pool.module())
        ys = dl.moe_experts_tokens(hms, chosen, weights, *plan.args, stats)
    plan.calls += 1
    return torch.from_numpy(ys)


def _disk_layer(dl, kern, ffn: DiskFfn, plan: FusedLayer, x: np.ndarray, start: int, cos, sin,
                pthr: float) -> tuple[int, int]:
    """A disk tier's layer: attention and the predictor, the predicted cold rows made resident
    (the reads; the next layer's read ahead started), then the rows and the residual."""
    front, (back, hot) = plan.disk
    with numba_pool.lock:
        hm, logits = dl.decode_layer_front(x, start, numba_pool.use_threads(kern), cos, sin, *front)
    slots, pred_ids, cold_y = ffn.fused_cold(x, hm, logits)
    use_cold_y = cold_y is not None
    with numba_pool.lock:
        return dl.decode_layer_rows(x, hm, logits, numba_pool.use_threads(kern), pthr, *back,
                                    _EMPTY_IDS if use_cold_y else slots, _EMPTY_IDS if use_cold_y else pred_ids,
                                    *hot, cold_y if use_cold_y else _EMPTY_F32, use_cold_y)


def warm(model, cache, keep: bool = True, behind: list | None = None) -> bool:
    """Load the compiled layer and head functions now (numba's disk cache; a first compile takes
    minutes) rather than in the first decoded token: one call of the first layer at position 0,
    whose cache slot the prompt overwrites before anything reads it, and one of the head.
    `keep`: the prepared arguments stay on the model for the first token; False (a background
    warm-up beside a running engine, over a scratch cache) leaves the model untouched.
    `behind` (the load's warm-up, which the engine's computations wait for): a disk tier's or a
    mixture's layer calls that numba's cache does not hold are not run but added to this list,
    for `compile_behind` once the unfused decode's kernels are loaded (a compile holds numba's
    compiler lock, which loading a kernel from its cache takes too); they stay unusable
    (numba_pool.compiling_behind) and the decode unfused until they are in.
    Returns whether the decode is fused: every layer on the CPU, the first layer's and the
    head's calls prepared."""
    if not enabled() or kernels() is None or not model.layers:
        return False
    dl = kernels()
    layer = model.layers[0]
    plan = _build_layer(dl, model, 0, layer, cache)
    head = _build_head(dl, model)
    if keep:
        layer.fused, model.fused_head = plan, head
    table = model.rotary.get(torch.device("cpu"))
    if (plan.args is None and plan.disk is None) or head.args is None or table is None \
            or table.cos.dtype != torch.float32:
        return False
    calls = _warm_calls(dl, model, layer, plan, head, table)
    untracked = [(f, args) for f, args, _ in calls if f.__name__ in UNTRACKED]
    if behind is not None and untracked \
            and not all(numba_pool.loads_without_compiling(f, *args) for f, args in untracked):
        functions = [f for f, _ in untracked]
        if not any(f in numba_pool.compiling_behind for f in functions):  # else another load compiles them
            numba_pool.compiling_behind.update(functions)
            behind.append((functions, calls))
        return False
    _run_calls(calls)
    return all(getattr(la, "device", torch.device("cpu")).type == "cpu" for la in model.layers)


def _warm_calls(dl, model, layer, plan: FusedLayer, head: FusedLayer, table) -> list[tuple]:
    """The warm-up's calls as (function, arguments, slots): `_run_calls` puts the thread count
    in the first slot and the previous call's results in the rest (a disk layer's second call
    reads the first's hm and logits); stand-ins of the same types hold them here."""
    x = np.zeros(model.config.hidden_size, dtype=np.float32)
    cos, sin = table.cos.numpy(), table.sin.numpy()
    if plan.disk is not None:  # every position through slot 0: no read, no cache counter moves
        front, (back, hot) = plan.disk
        neuron_cache = layer.ffn.cache
        ids = neuron_cache.cold_ids[layer.ffn.layer]
        vector = np.zeros(1, dtype=np.float32)  # hm and logits
        calls = [(dl.decode_layer_front, (x, 0, 1, cos, sin, *front), (2,)),
                 (dl.decode_layer_rows, (x, vector, vector, 1, 0.0, *back, np.zeros(len(ids), dtype=np.int64),
                                         neuron_cache.pred_ids(ids), *hot, _EMPTY_F32, False), (3, 1, 2))]
    elif plan.moe is not None:  # its counters untouched: the warm-up is no decoded token
        m = plan.moe
        calls = [(dl.decode_moe_layer, (x, 0, 1, cos, sin, *plan.args, m.chosen, m.weights, m.stats), (2,))]
        prompt = moe_expert_args(dl, layer.ffn)  # and a prompt's experts (moe_prompt), one token here
        if not isinstance(prompt, str):
            calls.append((dl.moe_experts_tokens,
                          (x[None], m.chosen[None], m.weights[None], *prompt[0], m.stats[None].copy()), ()))
    else:
        calls = [(dl.decode_layer, (x, 0, 1, cos, sin, 0.0, *plan.args), (2,))]
    return calls + [(dl.decode_head, (x, 1, *head.args), (1,))]


def _run_calls(calls: list[tuple]) -> None:
    kern = numba_pool.module()
    with numba_pool.lock:
        threads = numba_pool.use_threads(kern)
        out = ()
        for f, args, slots in calls:
            args = list(args)
            for slot, value in zip(slots, (threads, *out)):
                args[slot] = value
            out = f(*args)
            out = out if isinstance(out, tuple) else ()


# Threads compiling a disk tier's or a mixture's layer calls that nobody waits for
# (`compile_behind`); the process waits for them at exit: a thread cut off inside numba's
# compiler aborts the interpreter.
_BEHIND: set = set()


def compile_behind(functions: list, calls: list[tuple]) -> None:
    """Compile (and run once) `calls` on a thread of their own, what `warm` set aside;
    `functions` stay unusable (numba_pool.compiling_behind) until it ends, so a decode takes
    the unfused path meanwhile and comes to the fused one at a token's start. Where that thread
    fails they stay unusable: the unfused path is the reference."""
    def compile_calls():
        try:
            _run_calls(calls)
        except Exception as exc:  # noqa: BLE001 - the decode stays on the unfused path
            warnings.warn(f"the fused decode's {', '.join(f.__name__ for f in functions)} could not be compiled "
                          f"({exc}); decoding on the unfused path", RuntimeWarning, stacklevel=1)
        else:
            numba_pool.compiling_behind.difference_update(functions)
        finally:
            _BEHIND.discard(thread)

    thread = threading.Thread(target=compile_calls, name="thermocline-kernel-compile-behind", daemon=True)
    _BEHIND.add(thread)
    thread.start()


@atexit.register
def wait_compiled_behind() -> None:
    """Wait for what `compile_behind` compiles (a caller that needs the fused decode now: the
    tests of its mixture's and disk tier's calls; the process at exit)."""
    for thread in list(_BEHIND):
        thread.join()
