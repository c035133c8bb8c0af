"""The hot/cold split: the sparse runtime by job (per-token hooks, solving, moving tensors, memory accounting), the hybrid FFN, placement, predictors, statistics, mixture-of-experts tiers."""
