"""PowerInfer-style GGUF files for tests: the `gguf` package's writer, then PowerInfer's
post-processing (the first four bytes overwritten with `PWRI`, as its convert.py does)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def powerinfer_gguf(path: Path, *, layers: int, d: int, n_ff: int, rank: int = 8, vocab: int = 300,
                    threshold: float | None = 0.0, tokens: int = 4000, seed: int = 0,
                    fc1_f16: bool = True) -> dict[str, np.ndarray]:
    """Write a GGUF with a vocabulary (a header of some size), dense model tensors and per-layer
    predictors `blk.N.fc1.weight` [rank, d] / `blk.N.fc2.weight` [n_ff, rank]; return the predictors."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(n_ff)
    if threshold is not None:
        writer.add_float32("powerinfer.sparse_threshold", threshold)
    writer.add_token_list([f"tok{i}-{'x' * (i % 40)}" for i in range(tokens)])  # makes the header long
    predictors = {}
    writer.add_tensor("token_embd.weight", rng.standard_normal((vocab, d)).astype(np.float16))
    for i in range(layers):
        fc1 = rng.standard_normal((rank, d)).astype(np.float16 if fc1_f16 else np.float32)
        fc2 = rng.standard_normal((n_ff, rank)).astype(np.float32)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((n_ff, d)).astype(np.float16))
        writer.add_tensor(f"blk.{i}.fc1.weight", fc1)
        writer.add_tensor(f"blk.{i}.fc2.weight", fc2)
        writer.add_tensor(f"blk.{i}.ffn_down_t.weight", rng.standard_normal((n_ff, d)).astype(np.float16))
        predictors[f"layers.{i}.fc1.weight"], predictors[f"layers.{i}.fc2.weight"] = fc1, fc2
    writer.add_tensor("output.weight", rng.standard_normal((vocab, d)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(path, "r+b") as f:
        f.write(b"PWRI")
    return predictors
