"""The model floor: the layer types (`layers`), the transformer and its decode (`transformer`), the KV cache, RoPE, the FFN variants (mixture of experts, 4-bit staged rows)."""
