"""Argument checks and conversions shared by the CPU row kernels' entry points (`cpu` for
fp32/int8 rows, `cpu_q4` for 4-bit rows), and the properties their row containers share."""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import reference


def as_numpy(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """t as a contiguous CPU numpy array of dtype: a view when it already is one (the
    usual case, and a conversion costs tens of microseconds when caches are cold)."""
    if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and not t.requires_grad:
        return t.numpy()
    return t.detach().to(device="cpu", dtype=dtype).contiguous().numpy()


def id_array(name: str, t: torch.Tensor) -> np.ndarray:
    """A 1-D int32/int64 id tensor as an int64 numpy array (ValueError otherwise)."""
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected int32/int64 [k], got {t.dtype} {tuple(t.shape)}")
    return as_numpy(t, torch.int64)


def check_ffn_call(x: torch.Tensor, rows, activation: str, out_acts: torch.Tensor | None, k: int) -> None:
    """A one-token FFN call's arguments: x [rows.dim], a known activation, out_acts fp32 [k]."""
    reference.check_activation(activation)
    if x.shape != (rows.dim,):
        raise ValueError(f"x: expected [{rows.dim}], got {tuple(x.shape)}")
    if out_acts is not None and (out_acts.shape != (k,) or out_acts.dtype != torch.float32
                                 or not out_acts.is_contiguous() or out_acts.is_cuda):
        raise ValueError(f"out_acts: expected contiguous CPU fp32 [{k}]")


def check_predicted_call(x: torch.Tensor, rows, activation: str, out_acts: torch.Tensor | None,
                         pred_logits: torch.Tensor, row_ids: torch.Tensor | None) -> np.ndarray | None:
    """A selection-by-logits call's arguments (`sparse_ffn_predicted`): those of `check_ffn_call`
    with out_acts [n], pred_logits [n] or, with row_ids [n], the layer's; the row ids as int64."""
    n = rows.n_neurons
    check_ffn_call(x, rows, activation, out_acts, n)
    ids = id_array("row_ids", row_ids) if row_ids is not None else None
    if ids is not None and ids.shape[0] != n:
        raise ValueError(f"row_ids: expected [{n}], got [{ids.shape[0]}]")
    if pred_logits.dim() != 1 or (ids is None and pred_logits.shape[0] != n):
        raise ValueError(f"pred_logits: expected [{n}] (or the layer's with row_ids), got {tuple(pred_logits.shape)}")
    return ids


def predicted_in_torch(ffn, pred_logits: torch.Tensor, ids: np.ndarray | None, pred_threshold: float,
                       out_acts: torch.Tensor | None) -> torch.Tensor:
    """Selection by logits without the kernels: the ids whose logit >= pred_threshold, then
    `ffn(active, acts)` over them (the fallback's FFN by ids); out_acts [n] gets 0 elsewhere."""
    logits = pred_logits.detach().to(device="cpu", dtype=torch.float32)
    if ids is not None:
        logits = logits[torch.from_numpy(ids)]
    active = torch.nonzero(logits >= pred_threshold).squeeze(1)
    acts = torch.empty(active.numel())
    y = ffn(active, acts)
    if out_acts is not None:
        out_acts.zero_().index_copy_(0, active, acts)
    return y


class FfnRowsShape:
    """What `cpu.CpuFfnRows` and `cpu_q4.Q4FfnRows` share: neurons are rows of `up`
    (`gate` None when the FFN is ungated)."""

    @property
    def n_neurons(self) -> int:
        return self.up.shape[0]

    @property
    def gated(self) -> bool:
        return self.gate is not None

    def checked_ids(self, neuron_ids) -> torch.Tensor:
        """neuron_ids as a long [k] tensor, IndexError when one is not a neuron of these rows."""
        ids = torch.as_tensor(neuron_ids, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n_neurons):
            raise IndexError(f"neuron ids out of range [0, {self.n_neurons})")
        return ids
