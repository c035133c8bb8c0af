"""The sparse runtime's tensor moves: a freshly loaded FFN split into hot rows (fast device)
and cold rows (CPU kernels' storage), a placement applied by moving only what changes tier
(dense layer parts with their KV cache, single neurons, the head), and each tier's storage
of a weight matrix. `TierMoves` is a mixin of `engine.hotcold.sparse.SparseRuntime` (reads config,
fast, storage, cpu_weights, predictors, model, cache, plan).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import host_memory
from engine.hotcold.hybrid_ffn import ColdRows, HotRows, HybridFfn, concat_rows
from engine.hotcold.hot_q4 import HOT_INT4, Q4HotRows, move_neurons_q4
from engine.kernels import cpu as cpu_kernels
from engine.kernels import q4_format, q4_rows
from engine.loading.loader import compute_dtype
from engine.model.q4_ffn import Q4StagedFfn
from engine.model.layers import DenseFfn
from engine.hotcold.placement import Placement
from engine.kernels.quantized import QuantMatrix, quantize_matrix
from engine.model.rope import RotaryTable


class TierMoves:
    def fast_dtype(self) -> torch.dtype:
        return compute_dtype(self.fast, self.storage)

    def _where(self, on_fast: bool) -> tuple[torch.device, torch.dtype]:
        cpu = torch.device("cpu")
        return (self.fast, self.fast_dtype()) if on_fast else (cpu, torch.float32)

    def split_ffn(self, layer: int, dense: DenseFfn | Q4StagedFfn, hot_ids: np.ndarray, all_rows=None) -> HybridFfn:
        """Split a freshly loaded FFN into hot and cold rows: an fp32 CPU DenseFfn, or a
        checkpoint's 4-bit rows (Q4StagedFfn: no fp32 copy; the float hot rows are read exactly
        from the checkpoint). `all_rows`: the whole layer already in the CPU format (rows are
        quantized one by one, so the cold rows are a selection of them)."""
        hot_idx = torch.as_tensor(hot_ids, dtype=torch.long)
        cold_mask = torch.ones(dense.n_ff, dtype=torch.bool)
        cold_mask[hot_idx] = False
        cold_idx = torch.nonzero(cold_mask).flatten()
        device, dtype = self._where(True)

        def float_rows(idx):  # (gate, up, down_t) fp32 rows of neurons idx
            if isinstance(dense, Q4StagedFfn):
                return dense.float_rows(idx)
            return (None if dense.gate is None else dense.gate[idx]), dense.up[idx], dense.down_t[idx]

        if getattr(self, "hot_weights", None) == HOT_INT4:  # 4-bit hot rows (hot_q4)
            if all_rows is not None and all_rows.quant == q4_format.QUANT:  # the same codes as the CPU's
                hot = Q4HotRows.from_rows(all_rows.select(hot_idx), hot_idx, device, dtype)
            else:
                hot = Q4HotRows.from_float(*float_rows(hot_idx), hot_idx, device, dtype)
        else:
            gate, up, down_t = float_rows(hot_idx)
            hot = HotRows(None if gate is None else _hot_rows(gate, device, dtype),
                          _hot_rows(up, device, dtype), _hot_rows(down_t, device, dtype), hot_idx.to(device))
        if all_rows is not None:
            rows = all_rows if len(cold_idx) == dense.n_ff else all_rows.select(cold_idx)
        else:
            rows = cold_rows_from_dense(*float_rows(cold_idx), self.cpu_weights)
        cold = ColdRows(rows, cold_idx)
        return HybridFfn(layer, dense.gated, self.config.activation, self.config.ffn_threshold(layer),
                         dense.n_ff, hot, cold, self.ffn_context(layer))

    def cold_ffn(self, layer: int, rows) -> HybridFfn:
        """A layer whose neurons all sit on the CPU, from rows already in the CPU format
        (a prepared file's mapped rows: taken as they are)."""
        device, dtype = self._where(True)
        d, n = self.config.hidden_size, self.config.intermediate_size
        empty = torch.empty(0, d, device=device, dtype=dtype)
        if getattr(self, "hot_weights", None) == HOT_INT4:
            hot = Q4HotRows.empty(rows.gated, d, device, dtype)
        else:
            hot = HotRows(empty if rows.gated else None, empty, empty, torch.empty(0, dtype=torch.long, device=device))
        return HybridFfn(layer, rows.gated, self.config.activation, self.config.ffn_threshold(layer), n, hot,
                         ColdRows(rows, torch.arange(n)), self.ffn_context(layer))

    def apply(self, plan: Placement) -> None:
        """Move what changed tier; called with the engine lock held (or between tokens)."""
        model = self.model
        if plan.head_on_fast != self.plan.head_on_fast:
            device, dtype = self._where(plan.head_on_fast)
            model.lm_head = self._head_weights(plan.head_on_fast)
            norm = model.final_norm
            norm.weight = norm.weight.to(device, dtype)
            norm.bias = None if norm.bias is None else norm.bias.to(device, dtype)
        for i, layer in enumerate(model.layers):
            if plan.layer_on_fast[i] != self.plan.layer_on_fast[i]:
                self._move_layer_dense(i, plan.layer_on_fast[i])
            new_ids = plan.hot_ids[i]
            if not np.array_equal(new_ids, self.plan.hot_ids[i]):
                self._move_neurons(layer.ffn, new_ids)
        self.plan = plan

    def _head_weights(self, on_fast: bool) -> torch.Tensor | QuantMatrix:
        """The output head for its tier. A tied head shares the embeddings on the CPU tier;
        on the fast tier it is its own copy, even when the CPU stands in for the GPU, so
        the bytes are those a GPU would hold."""
        model = self.model
        device, dtype = self._where(on_fast)
        if not self.config.tie_word_embeddings:
            return self._tier_matrix(model.lm_head, on_fast)
        return model.embed.to(device, dtype, copy=True) if on_fast else model.embed

    def _tier_matrix(self, w: torch.Tensor | QuantMatrix, on_fast: bool) -> torch.Tensor | QuantMatrix:
        """A dense weight matrix in its tier's storage: the fast tier's dtype, or on the CPU
        tier fp32, or int8 / 4-bit rows when the CPU weights are int8 / int4 (a quarter /
        about an eighth of the bytes to read per token)."""
        if not on_fast and self.cpu_weights != "fp32":
            return quantize_matrix(w, self.cpu_weights)
        device, dtype = self._where(on_fast)
        return w.to_dense(device, dtype) if isinstance(w, QuantMatrix) else w.to(device, dtype)

    def place_predictor(self, i: int, on_fast: bool) -> None:
        """Layer i's predictor in its tier's storage (int8 rows on an int8 CPU tier)."""
        if self.predictors is not None:
            quant = self.cpu_weights if not on_fast and self.cpu_weights != "fp32" else None
            self.predictors.to(i, *self._where(on_fast), quant=quant)

    def convert_layer_dense(self, layer, on_fast: bool) -> None:
        """The attention matrices of a freshly loaded layer into its tier's storage."""
        layer.qkv = self._tier_matrix(layer.qkv, on_fast)
        layer.out = self._tier_matrix(layer.out, on_fast)

    def _ensure_rotary(self, device: torch.device, dtype: torch.dtype) -> None:
        if device not in self.model.rotary:
            self.model.rotary[device] = RotaryTable(self.config.rope, self.config.head_dim, self.cache.slots,
                                                    dtype, device)

    def _move_layer_dense(self, i: int, to_fast: bool) -> None:
        device, dtype = self._where(to_fast)
        layer = self.model.layers[i]
        self.convert_layer_dense(layer, to_fast)
        for name in ("qkv_bias", "out_bias"):
            t = getattr(layer, name)
            if t is not None:
                setattr(layer, name, t.to(device, dtype))
        for norm in (layer.attn_norm, layer.mlp_norm):
            if norm is not None:
                norm.weight = norm.weight.to(device, dtype)
                norm.bias = None if norm.bias is None else norm.bias.to(device, dtype)
        layer.device = device
        self.place_predictor(i, to_fast)
        kv_dtype = self.cache.storage_dtype(device, dtype)  # the conversation moves with its layer
        self.cache.k[i] = self.cache.k[i].to(device, kv_dtype)
        self.cache.v[i] = self.cache.v[i].to(device, kv_dtype)
        self._ensure_rotary(device, dtype)

    def _move_neurons(self, ffn: HybridFfn, new_hot: np.ndarray) -> None:
        """Promote and demote only the neurons whose tier changes."""
        if isinstance(ffn.hot, Q4HotRows):
            return move_neurons_q4(ffn, new_hot, self.cpu_weights,
                                   lambda g, u, d: cold_rows_from_dense(g, u, d, self.cpu_weights))
        old_hot_ids = ffn.hot.ids.cpu().numpy()
        new_hot = np.asarray(new_hot, dtype=np.int64)
        keep_hot = np.isin(old_hot_ids, new_hot)
        promote = np.setdiff1d(new_hot, old_hot_ids)
        cold_ids = ffn.cold.ids.numpy()
        keep_cold = ~np.isin(cold_ids, promote)
        device, dtype = self._where(True)

        # Hot rows: those that stay plus the promoted ones read from the cold tier.
        promote_pos = torch.as_tensor(np.flatnonzero(~keep_cold))
        pg, pu, pd = ffn.cold.rows.select(promote_pos).dequantized() if len(promote_pos) else (None, None, None)
        stay = torch.as_tensor(np.flatnonzero(keep_hot), device=ffn.hot.up.device)

        def hot_rows(old: torch.Tensor | None, promoted: torch.Tensor | None):
            if old is None:
                return None
            parts = [old.index_select(0, stay)]
            if promoted is not None:
                parts.append(promoted.to(device, dtype))
            return torch.cat(parts)

        ids = np.concatenate([old_hot_ids[keep_hot], cold_ids[~keep_cold]])
        order = torch.as_tensor(np.argsort(ids, kind="stable"))
        gate, up, down_t = (hot_rows(ffn.hot.gate, pg), hot_rows(ffn.hot.up, pu), hot_rows(ffn.hot.down_t, pd))
        dev_order = order.to(device)
        new_hot_rows = HotRows(None if gate is None else _hot_rows(gate[dev_order], device, dtype),
                               _hot_rows(up[dev_order], device, dtype), _hot_rows(down_t[dev_order], device, dtype),
                               torch.as_tensor(ids[order.numpy()], device=device))

        # Cold rows: those that stay plus the demoted ones copied back from the fast device.
        demote_pos = np.flatnonzero(~keep_hot)
        kept = ffn.cold.rows.select(torch.as_tensor(np.flatnonzero(keep_cold)))
        parts = [kept]
        if len(demote_pos):
            g, u, d = ffn.hot.fp32_rows()
            pos = torch.as_tensor(demote_pos)
            parts.append(cold_rows_from_dense(None if g is None else g[pos], u[pos], d[pos], self.cpu_weights))
        cold_all = np.concatenate([cold_ids[keep_cold], old_hot_ids[demote_pos]])
        cold_order = torch.as_tensor(np.argsort(cold_all, kind="stable"))
        rows = concat_rows(parts).select(cold_order) if len(parts) > 1 else kept
        ffn.hot = new_hot_rows
        ffn.cold = ColdRows(rows, torch.as_tensor(cold_all[cold_order.numpy()]))


def _hot_rows(rows: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Hot rows for the fast tier; when the CPU stands in for it, on huge pages like the
    cold rows, since the same CPU kernels read them at random."""
    if device.type == "cpu":
        return host_memory.copy_of(rows, dtype)
    return rows.to(device, dtype).contiguous()


def cold_rows_from_dense(gate, up, down_t, quant: str):
    """Float rows [n, d] in the CPU kernels' storage for `quant` (int4, int8 or fp32)."""
    if quant == q4_format.QUANT:
        return q4_rows.Q4FfnRows.from_dense(gate, up, down_t)
    return cpu_kernels.CpuFfnRows.from_dense(gate, up, down_t, quant=quant)
