"""One layer's FFN split into a hot tier (fast device) and a cold tier (CPU rows).

Decode (one token): the predictor's logits pick the neurons to compute; the hot part
runs on the fast device while the cold part runs in the CPU kernels, and one add merges
them. Prefill (many tokens) uses dense matmuls over both tiers. `oracle` computes every
neuron's activation and projects the ones that fired: the exactness reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import cpu as cpu_kernels
from engine.kernels import cpu_q4, q4_format, q4_rows
from engine.kernels.cpu_quant import dequantize_rows_int8
from engine.kernels.reference import activations

_PREFILL_CHUNK = 4096  # rows dequantized at a time when a prefill reads int8 cold rows


@dataclass
class FfnCounters:
    """Per generation: neurons considered, computed (predicted active), computed on the fast tier."""
    considered: int = 0
    computed: torch.Tensor | int = 0
    computed_hot: torch.Tensor | int = 0

    def fractions(self) -> tuple[float, float]:
        computed = float(self.computed)
        return (computed / self.considered if self.considered else 0.0,
                float(self.computed_hot) / computed if computed else 0.0)


class HotRows:
    """Hot neurons packed contiguously on the fast device, with their neuron ids."""

    def __init__(self, gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor, ids: torch.Tensor):
        self.gate, self.up, self.down_t, self.ids = gate, up, down_t, ids
        self.device, self.dtype, self.dim = up.device, up.dtype, up.shape[1]  # metadata: no row is read
        # With the CPU standing in for the fast device, the CPU kernels compute the hot rows too.
        self.cpu_rows = (cpu_kernels.CpuFfnRows(gate, up, down_t, quant="fp32")
                         if self.device.type == "cpu" and up.dtype == torch.float32 else None)

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down_t, self.ids) if t is not None)

    def fp32_rows(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        def cpu32(t):
            return None if t is None else t.to("cpu", torch.float32)
        return cpu32(self.gate), cpu32(self.up), cpu32(self.down_t)

    def dense(self, *parts: str) -> tuple[torch.Tensor | None, ...]:
        """The matrices `parts` ("gate", "up", "down_t") for the many-token paths, in self.dtype
        (Q4HotRows dequantizes each once per call)."""
        return tuple(getattr(self, part) for part in parts)


class ColdRows:
    """Cold neurons in the CPU kernels' storage (fp32, int8 or 4-bit rows), with their neuron ids."""

    def __init__(self, rows: cpu_kernels.CpuFfnRows, ids: torch.Tensor):
        self.rows, self.ids = rows, ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.ids.numel() * self.ids.element_size()


def concat_rows(parts: list):
    """Cold rows of one storage (fp32, int8 or 4-bit) stacked in order, as one set of rows."""
    if parts[0].quant == q4_format.QUANT:
        return q4_rows.Q4FfnRows.concat(parts)
    def cat(name):
        tensors = [getattr(p, name) for p in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    return cpu_kernels.CpuFfnRows(cat("gate"), cat("up"), cat("down_t"), cat("gate_scale"), cat("up_scale"),
                                  cat("down_scale"), quant=parts[0].quant)


class ColdIds:
    """Cold neuron ids whose rows are not held (a disk load's layer while it loads)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    nbytes = 0


class HybridFfn:
    def __init__(self, layer: int, gated: bool, activation: str, threshold: float, n_ff: int,
                 hot: HotRows, cold: ColdRows, context):
        self.layer, self.gated, self.activation, self.threshold = layer, gated, activation, threshold
        self.n_ff = n_ff
        self.hot, self.cold = hot, cold
        self.context = context  # engine.sparse_tokens.FfnContext: predictor, threshold, mode, counters

    @property
    def nbytes(self) -> int:
        return self.hot.nbytes + self.cold.nbytes

    # ------------------------------------------------------------------ decode
    def __call__(self, x: torch.Tensor, pred_input: torch.Tensor, layer: int, observer=None) -> torch.Tensor:
        if x.shape[0] > 1 or observer is not None:
            if observer is None and self._prefill_predicted():
                return self._predicted_tokens(x, pred_input)
            return self._batched(x, pred_input, observer)
        if self.context.mode == "oracle":
            logits = mask = None  # compute every neuron, project those that fired
        else:
            logits = self.context.logits(pred_input[0])
            mask = logits >= self.context.threshold
        # The cold part needs the logits on the CPU: copy them before the hot kernel is
        # queued, so the GPU computes the hot rows while the CPU computes the cold ones.
        cold_logits = None if logits is None or not len(self.cold) else logits.to("cpu")
        y_hot = self._hot_decode(x[0], logits)
        y_cold = self._cold_decode(x[0], cold_logits)
        counters = self.context.counters
        counters.considered += self.n_ff
        if mask is None:
            counters.computed += self.n_ff
            counters.computed_hot += len(self.hot)
        else:
            counters.computed = counters.computed + mask.sum()
            if len(self.hot):
                counters.computed_hot = counters.computed_hot + mask[self.hot.ids].sum()
        if y_hot is None:
            return y_cold.to(x.device, x.dtype)[None]
        return (y_hot + y_cold.to(y_hot.device)).to(x.dtype)[None]

    def _hot_decode(self, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor | None:
        hot = self.hot
        if not len(hot):
            return None
        threshold = self.context.threshold
        if getattr(hot, "quant", None) == "int4":  # 4-bit hot rows: engine.hotcold.hot_q4
            return hot.decode(x, logits, threshold, self.activation, self.threshold)
        if hot.cpu_rows is not None:
            return self._cpu_rows(x.float(), hot.cpu_rows, logits, threshold, hot.ids)
        from engine.kernels.triton_ffn import sparse_ffn_triton

        # The kernel thresholds the logits itself: no host sync, a static launch grid.
        logits = None if logits is None else logits.float()
        return sparse_ffn_triton(x, hot.gate, hot.up, hot.down_t, logits, threshold if logits is not None else 0.0,
                                 self.activation, self.threshold, row_ids=hot.ids if logits is not None else None)

    def _cold_decode(self, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        if not len(self.cold):
            return torch.zeros(x.shape[-1], dtype=torch.float32)
        return self._cpu_rows(x.to("cpu", torch.float32), self.cold.rows, logits,
                              self.context.threshold, self.cold.ids)

    def _cpu_rows(self, x, rows, logits, threshold, ids) -> torch.Tensor:
        """The CPU kernel over a tier's rows: all of them (oracle) or those predicted active,
        selected inside the kernel from the layer's logits."""
        kernels = cpu_q4 if rows.quant == q4_format.QUANT else cpu_kernels
        if logits is None:
            return kernels.sparse_ffn(x, rows, None, self.activation, self.threshold)
        return kernels.sparse_ffn_predicted(x, rows, logits, threshold, self.activation, self.threshold,
                                                row_ids=ids)

    # ------------------------------------------------------------ many tokens
    def _prefill_predicted(self) -> bool:
        """Whether many tokens compute their predicted neurons (sparse and hybrid modes,
        and scoring as them) rather than every neuron (oracle, the exactness reference)."""
        mode = self.context.scoring_mode or self.context.mode
        return mode in ("sparse", "hybrid") and self.context.has_predictors

    def _predicted_tokens(self, x: torch.Tensor, pred_input: torch.Tensor) -> torch.Tensor:
        """A prefill as decoding each token alone would compute it: per token, the neurons
        its predictor selects. Each cold row is read once for all tokens, in its int8 or
        fp32 storage (no dequantized copy of the layer); a row no token selects is not read,
        so the time grows with the prompt, not with the layer's cold rows."""
        threshold = self.context.threshold
        logits = self.context.logits(pred_input).to("cpu", torch.float32)
        xc = x.to("cpu", torch.float32)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        if len(self.cold) and self.cold.rows.quant == q4_format.QUANT:
            # 4-bit rows: the decode kernel per token (the many-token kernel reads int8 and
            # fp32 rows), each token over the rows its predictor selects, as decoding it would
            for t in range(x.shape[0]):
                out[t] += cpu_q4.sparse_ffn_predicted(xc[t], self.cold.rows, logits[t], threshold, self.activation,
                                                      self.threshold, row_ids=self.cold.ids)
        elif len(self.cold):
            out += cpu_kernels.sparse_ffn_tokens(xc, self.cold.rows, logits[:, self.cold.ids].contiguous(),
                                                 threshold, self.activation, self.threshold)
        hot = self.hot
        if len(hot):
            hot_logits = logits[:, hot.ids.cpu()].contiguous()
            if hot.cpu_rows is not None:
                out += cpu_kernels.sparse_ffn_tokens(xc, hot.cpu_rows, hot_logits, threshold, self.activation,
                                                     self.threshold)
            else:  # the GPU: its dense matmuls over the hot rows, masked per token
                xh = x.to(hot.device, hot.dtype)
                gate_w, up_w, down_w = hot.dense("gate", "up", "down_t")
                gate = F.linear(xh, gate_w) if self.gated else None
                acts = activations(gate, F.linear(xh, up_w), self.activation, self.threshold)
                acts = acts * (hot_logits >= threshold).to(hot.device)
                out += (acts @ down_w).to("cpu", torch.float32)
        return out.to(x.device, x.dtype)

    def _cold_chunks(self, parts: tuple[str, ...] = ("gate", "up", "down_t")):
        """(ids, gate, up, down_t) fp32 blocks of the cold rows; int8 rows are dequantized
        a block at a time so a prefill never holds the whole layer in fp32."""
        rows = self.cold.rows
        for lo in range(0, len(self.cold), _PREFILL_CHUNK):
            hi = min(lo + _PREFILL_CHUNK, len(self.cold))
            if rows.quant == "fp32":
                gate, up, down_t = rows.gate[lo:hi] if self.gated else None, rows.up[lo:hi], rows.down_t[lo:hi]
            elif rows.quant == q4_format.QUANT:
                gate, up, down_t = rows.dequantized(lo, hi, parts)
            else:  # a slice of the rows is contiguous: dequantize it in place of a copy
                def block(q, scale):
                    return None if q is None else dequantize_rows_int8(q[lo:hi], scale[lo:hi])

                gate, up, down_t = (block(rows.gate, rows.gate_scale), block(rows.up, rows.up_scale),
                                    block(rows.down_t, rows.down_scale))
            yield self.cold.ids[lo:hi], gate, up, down_t

    def _tier_activations(self, x: torch.Tensor) -> torch.Tensor:
        """True activations [T, n_ff] (fp32, on the CPU) from dense matmuls over both tiers."""
        acts = torch.zeros(x.shape[0], self.n_ff, dtype=torch.float32)
        if len(self.hot):
            xh = x.to(self.hot.device, self.hot.dtype)
            gate_w, up_w = self.hot.dense("gate", "up")
            gate = F.linear(xh, gate_w) if self.gated else None
            hot_acts = activations(gate, F.linear(xh, up_w), self.activation, self.threshold)
            acts[:, self.hot.ids.cpu()] = hot_acts.to("cpu", torch.float32)
        xc = x.to("cpu", torch.float32)
        rows = self.cold.rows
        if len(self.cold) and rows.quant == q4_format.QUANT:  # the int8 x 4-bit kernel, no fp32 copy
            up = cpu_q4.matmul_q4(xc, rows.up, rows.dim)
            if up is not None:
                gate = cpu_q4.matmul_q4(xc, rows.gate, rows.dim) if self.gated else None
                acts[:, self.cold.ids] = activations(gate, up, self.activation, self.threshold)
                return acts
        for ids, gate, up, _ in self._cold_chunks():
            acts[:, ids] = activations(F.linear(xc, gate) if gate is not None else None, F.linear(xc, up),
                                       self.activation, self.threshold)
        return acts

    def _project(self, acts: torch.Tensor) -> torch.Tensor:
        """acts [T, n_ff] (CPU) -> [T, d] fp32 on the CPU through both tiers' down rows."""
        out = torch.zeros(acts.shape[0], self.hot.dim if len(self.hot) else self.cold.rows.dim)
        if len(self.hot):
            hot_acts = acts[:, self.hot.ids.cpu()].to(self.hot.device, self.hot.dtype)
            out += (hot_acts @ self.hot.dense("down_t")[0]).to("cpu", torch.float32)
        for ids, _, _, down_t in self._cold_chunks(("down_t",)):
            out += acts[:, ids] @ down_t
        return out

    def _batched(self, x: torch.Tensor, pred_input: torch.Tensor, observer) -> torch.Tensor:
        acts = self._tier_activations(x)
        if observer is not None:
            observer(self.layer, pred_input, acts)
        if self.context.scoring_mode in ("sparse", "hybrid"):
            # Per-token predicted sets: what decoding each token alone would compute.
            logits = self.context.logits(pred_input)
            acts = acts * (logits >= self.context.threshold).to("cpu")
        return self._project(acts).to(x.device, x.dtype)
