"""The transformer: plain tensors and functions, one decode step at a time.

Attention is dense on the device of its layer; each layer's FFN is whatever object the
load put there (engine/model/layers.py). A one-token step may instead run through
`Transformer.decoder`, a hook the engine supplies (engine.runtime.fused_decode: one
compiled call per CPU layer), and a batch's decode step through `batch_decoder`
(engine.runtime.fused_batch); the layers below stay the reference and the fallback.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.kernels import cpu as cpu_kernels
from engine.kernels.thread_tuner import ThreadTuner
from engine.kernels.quantized import Int8Matrix, matrix_nbytes
from engine.model.kv_cache import KVCache
from engine.model.layers import FfnObserver, Layer, Norm, linear
from engine.model.moe import route
from engine.model.rope import RotaryTable, apply_rotary

# A one-token decode in place of the layers: (model, ids [1], position, cache) -> logits
# [1, vocab], or None where it cannot run this step (the layers below then run).
Decoder = Callable[["Transformer", torch.Tensor, int, KVCache], "torch.Tensor | None"]
# A step of R rows (model, ids [R], positions, caches, heads) -> logits [len(heads), vocab] of the
# rows `heads` (None: all), or None. Rows may share a cache: a prompt's piece is consecutive rows
# of one cache at consecutive positions.
BatchDecoder = Callable[["Transformer", torch.Tensor, list[int], list[KVCache], "list[int] | None"],
                        "torch.Tensor | None"]


class Transformer:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[Layer], final_norm: Norm,
                 lm_head: torch.Tensor | Int8Matrix, rotary: dict[torch.device, RotaryTable]):
        self.config = config
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.rotary = rotary
        self.ffn_observer: FfnObserver | None = None
        self.decoder: Decoder | None = None  # set by the engine (runtime.fused_decode.decode_step)
        self.batch_decoder: BatchDecoder | None = None  # set by the engine (runtime.fused_batch.decode_batch_step)
        self.batch_fused = False  # whether batch_decoder ran the last forward_batch that tried it
        self.thread_tuner: ThreadTuner | None = None  # set by the engine (engine.kernels.thread_tuner)
        self.fused_head = None  # the decoder's prepared call of the final norm and the head
        self.scale = config.head_dim ** -0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # muP scales (MiniCPM, engine/arch/minicpm.py); None where the architecture has none.
        self.embedding_scale = config.embedding_scale if config.embedding_scale != 1.0 else None
        self.residual_scale = config.residual_scale if config.residual_scale != 1.0 else None
        self.logit_scale = config.logit_scale if config.logit_scale != 1.0 else None

    @property
    def head_device(self) -> torch.device:
        return self.lm_head.device

    @property
    def head_nbytes(self) -> int:
        """Bytes of the output head beyond the embeddings (0 when it is them: tied, same tier)."""
        shared = isinstance(self.lm_head, torch.Tensor) and self.lm_head.data_ptr() == self.embed.data_ptr()
        return 0 if shared else matrix_nbytes(self.lm_head)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run tokens `ids` [T] at positions start.. ; returns logits [T or 1, vocab] (fp32).
        With a `thread_tuner` (set by the engine), a one-token step runs on the thread count
        it chooses and reports its time; many tokens run on every thread."""
        tuner = self.thread_tuner
        if tuner is None:
            return self._forward(ids, start, cache, all_logits)
        if ids.shape[0] != 1:
            return self._forward(ids, start, cache, all_logits)
        with tuner.apply():  # this step's kernels, on this thread: no other engine or batch inherits it
            began = time.perf_counter()
            try:
                return self._forward(ids, start, cache, all_logits)
            finally:
                tuner.record(time.perf_counter() - began)

    def _forward(self, ids: torch.Tensor, start: int, cache: KVCache, all_logits: bool) -> torch.Tensor:
        count = ids.shape[0]
        if count == 1 and self.decoder is not None:  # decode: one compiled call per layer where it can
            logits = self.decoder(self, ids, start, cache)
            if logits is not None:
                return logits
        cache.prepare(start, count)
        x = self.embed[ids.to(self.embed.device)]
        if self.embedding_scale is not None:
            x = x * self.embedding_scale
        mask = cache.mask(start, count)
        window_masks: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            if x.device != layer.device or x.dtype != layer.dtype:  # the hidden state crosses tiers
                x = x.to(layer.device, layer.dtype)
            layer_mask = mask
            if layer.window is not None:  # a windowed layer among full ones (SmallThinker)
                if layer.window not in window_masks:
                    window_masks[layer.window] = _window_mask(cache, start, count, layer.window)
                layer_mask = window_masks[layer.window]
            x = self._layer(index, layer, x, start, cache, layer_mask)
        if not all_logits:
            x = x[-1:]
        x = self.final_norm(x.to(self.final_norm.weight.device, self.final_norm.weight.dtype))
        if self.logit_scale is not None:
            x = x * self.logit_scale
        return linear(x, self.lm_head).float()

    def can_batch(self, caches: list[KVCache]) -> bool:
        """Whether `forward_batch` runs these sequences' step: no experts, no windowed or rolling
        attention (their masks are per sequence), every layer on the CPU."""
        return (all(layer.router is None and layer.window is None and layer.device.type == "cpu"
                    for layer in self.layers) and not any(c.rolling for c in caches))

    @torch.inference_mode()
    def forward_batch(self, segments: list[tuple[torch.Tensor | list[int], int, KVCache]],
                      fuse_prompts: bool = False) -> torch.Tensor:
        """One step of B sequences at once: segment b is token ids [T_b] (a tensor or a list) at positions start_b..
        over its own cache (T_b = 1: a decode step; more: a piece of its prompt). Returns the
        logits [B, vocab] (fp32) of each segment's last token. Every weight matrix is read once
        for all the rows (the FFN's own many-token path: each row over the neurons its predictor
        selects, each neuron read once for all rows); attention reads each sequence's cache.
        A decode step goes through `batch_decoder` where it can; with `fuse_prompts` a step with
        prompt pieces does too, each prompt token a row (its FFN over its own neurons)."""
        prompts = any(len(ids) > 1 for ids, _, _ in segments)
        # One tensor for the step's ids: a torch op hands the GIL to any thread waiting for it (the
        # server's event loop), and one op per sequence made the engine wait out its turn each time.
        ids = torch.tensor([t for part, _, _ in segments
                            for t in (part.tolist() if isinstance(part, torch.Tensor) else part)], dtype=torch.long)
        if self.batch_decoder is not None and (fuse_prompts or not prompts):
            # one compiled call per layer for all the rows, where it can
            positions, caches, heads = [], [], []
            for part, start, cache in segments:
                positions += range(start, start + len(part))
                caches += [cache] * len(part)
                heads.append(len(positions) - 1)
            logits = self.batch_decoder(self, ids, positions, caches, heads if prompts else None)
            self.batch_fused = logits is not None
            if logits is not None:
                return logits
        spans, row = [], 0
        for part, start, cache in segments:
            count = len(part)
            cache.prepare(start, count)
            spans.append((row, row + count, start, cache, cache.mask(start, count)))
            row += count
        x = self.embed[ids.to(self.embed.device)]
        if self.embedding_scale is not None:
            x = x * self.embedding_scale

        def attend(index: int, layer: Layer, h: torch.Tensor) -> torch.Tensor:
            return self._attention_batch(index, layer, h, spans)

        for index, layer in enumerate(self.layers):
            if x.device != layer.device or x.dtype != layer.dtype:
                x = x.to(layer.device, layer.dtype)
            x = self._layer(index, layer, x, 0, None, None, attend)
        x = x[[hi - 1 for _, hi, _, _, _ in spans]]
        x = self.final_norm(x.to(self.final_norm.weight.device, self.final_norm.weight.dtype))
        if self.logit_scale is not None:
            x = x * self.logit_scale
        return linear(x, self.lm_head).float()

    def decode_batch(self, ids: torch.Tensor, positions: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One decode step of B sequences: token ids [B], sequence b at positions[b]."""
        return self.forward_batch([(ids[b : b + 1], p, c) for b, (p, c) in enumerate(zip(positions, caches))])

    def _attention_batch(self, index: int, layer: Layer, x: torch.Tensor, spans: list) -> torch.Tensor:
        cfg = self.config
        qkv = linear(x, layer.qkv, layer.qkv_bias)  # the projections once for all rows
        outs = []
        for lo, hi, start, cache, mask in spans:
            count = hi - lo
            rows = qkv[lo:hi]
            q = rows[:, : self.q_size].view(count, cfg.num_heads, cfg.head_dim).transpose(0, 1)
            k = rows[:, self.q_size : self.q_size + self.kv_size].view(count, cfg.num_kv_heads,
                                                                       cfg.head_dim).transpose(0, 1)
            v = rows[:, self.q_size + self.kv_size :].view(count, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            if layer.rope:
                cos, sin = self.rotary[layer.device].at(start, count)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            cache.write(index, k, v, start)
            if count == 1:
                outs.append(cpu_kernels.decode_attention(q[:, 0], cache.k[index], cache.v[index], start + 1,
                                                         self.scale).to(q.dtype).reshape(1, self.q_size))
                continue
            keys, values = cache.keys_values(index, start + count)  # a prompt's piece: causal over the cache
            if keys.dtype != q.dtype:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=self.scale,
                                                 enable_gqa=cfg.num_heads != cfg.num_kv_heads)[0]
            outs.append(out.transpose(0, 1).reshape(count, self.q_size))
        return linear(torch.cat(outs), layer.out, layer.out_bias)

    def _layer(self, index: int, layer: Layer, x: torch.Tensor, start: int, cache: KVCache,
               mask: torch.Tensor | None, attend=None) -> torch.Tensor:
        routing = None
        cfg = self.config
        if layer.router is not None and cfg.router_input == "layer":  # the experts are known before attention runs
            routing = route(layer.router, x, cfg.experts_per_token, cfg.router_softmax)
            before_attention = getattr(layer.ffn, "before_attention", None)
            if before_attention is not None:  # where cold experts beyond RAM would start loading
                before_attention(routing)
        h_attn = layer.attn_norm(x)
        if attend is not None:  # a batch of sequences, each over its own cache (forward_batch)
            attn = attend(index, layer, h_attn)
        else:
            attn = self._attention(index, layer, h_attn, start, cache, mask)
        scale = self.residual_scale
        if layer.parallel:
            h_mlp = layer.mlp_norm(x) if layer.mlp_norm is not None else h_attn
            return x + attn + layer.ffn(h_mlp, x, index, self.ffn_observer)
        h = x + (attn if scale is None else attn * scale)
        h_mlp = layer.mlp_norm(h)
        if layer.router is not None and routing is None:  # Mixtral: the router reads the FFN's input
            routing = route(layer.router, h_mlp, cfg.experts_per_token, cfg.router_softmax)
        ffn = layer.ffn(h_mlp, h if routing is None else routing, index, self.ffn_observer)
        return h + (ffn if scale is None else ffn * scale)

    def _attention(self, index: int, layer: Layer, x: torch.Tensor, start: int, cache: KVCache,
                   mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        count = x.shape[0]
        qkv = linear(x, layer.qkv, layer.qkv_bias)
        q = qkv[:, : self.q_size].view(count, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(count, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = qkv[:, self.q_size + self.kv_size :].view(count, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        if layer.rope:
            cos, sin = self.rotary[layer.device].at(start, count)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        cache.write(index, k, v, start)
        if count == 1 and mask is None and q.device.type == "cpu" and not cache.rolling:
            # Decode on the CPU: one numba call over the cache, fp32 or 16-bit (cpu.decode_attention).
            out = cpu_kernels.decode_attention(q[:, 0], cache.k[index], cache.v[index], start + count,
                                               self.scale).to(q.dtype).reshape(1, self.q_size)
            return linear(out, layer.out, layer.out_bias)
        keys, values = cache.keys_values(index, start + count)
        if keys.dtype != q.dtype:  # a 16-bit CPU cache under fp32 compute
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if count == 1 and mask is None:
            # Decode: group query heads by their KV head, two small batched matmuls.
            group = cfg.num_heads // cfg.num_kv_heads
            qg = q.reshape(cfg.num_kv_heads, group, cfg.head_dim)
            scores = torch.softmax(torch.bmm(qg, keys.transpose(1, 2)) * self.scale, dim=-1)
            out = torch.bmm(scores, values).reshape(1, self.q_size)
        else:
            attn_mask = mask.to(x.device) if mask is not None else None
            out = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=attn_mask, scale=self.scale,
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )[0]
            out = out.transpose(0, 1).reshape(count, self.q_size)
        return linear(out, layer.out, layer.out_bias)


def _window_mask(cache: KVCache, start: int, count: int, window: int) -> torch.Tensor:
    """[count, keys] mask of a windowed layer in a cache shared with full-attention layers
    (which never rolls): each query sees itself and the window - 1 positions before it."""
    query_pos = torch.arange(start, start + count)[:, None]
    key_pos = torch.arange(start + count)[None, :]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)
