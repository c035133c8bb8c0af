"""The sparse runtime's memory accounting: bytes really allocated per tier (weights,
predictors, KV cache, index maps), which `engine.hotcold.placement` predicts and the tests compare.
`MemoryAccounting` is a mixin of `engine.hotcold.sparse.SparseRuntime` (reads model, plan,
predictors, cache, fast).
"""

from __future__ import annotations


class MemoryAccounting:
    def memory(self) -> dict:
        """Bytes really allocated per tier (weights, predictors, KV cache, index maps)."""
        model, plan = self.model, self.plan

        def nb(*tensors):
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        head = nb(model.final_norm.weight, model.final_norm.bias) + model.head_nbytes
        # the disk tier's embeddings, mapped from the prepared file, are on disk: a token reads one row
        embed = 0 if getattr(self, "embed_mapped", False) and plan.embed_on_disk else nb(model.embed)
        tiers = {"fast_dense": 0, "fast_kv": 0, "fast_ffn": 0, "cpu_dense": embed, "cpu_kv": 0,
                 "cpu_ffn": 0}
        tiers["fast_dense" if plan.head_on_fast else "cpu_dense"] += head
        for i, layer in enumerate(model.layers):
            tier = "fast" if plan.layer_on_fast[i] else "cpu"
            predictor = self.predictors.nbytes(i) if self.predictors is not None else 0
            predictor += getattr(layer.ffn, "predictor_nbytes", 0)  # a mixture's experts' own (TurboSparse-Mixtral)
            tiers[f"{tier}_dense"] += layer.dense_nbytes + predictor
            tiers[f"{tier}_kv"] += nb(self.cache.k[i], self.cache.v[i])
            tiers["fast_ffn"] += layer.ffn.hot.nbytes
            tiers["cpu_ffn"] += layer.ffn.cold.nbytes
        if getattr(self, "neuron_cache", None) is not None:  # the disk tier's cache, counted once
            tiers["cpu_ffn"] += self.neuron_cache.nbytes
        vram = tiers["fast_dense"] + tiers["fast_kv"] + tiers["fast_ffn"]
        ram = tiers["cpu_dense"] + tiers["cpu_kv"] + tiers["cpu_ffn"]
        return {"vram_bytes": vram, "ram_bytes": ram, "device": str(self.fast), "tiers": tiers}
