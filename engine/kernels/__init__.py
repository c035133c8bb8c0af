"""Sparse FFN kernels over the row layout of docs/ARCHITECTURE.md.

- `reference`: pure torch, the reference every kernel is tested against and the fallback;
- `cpu`: the cold (CPU) partition, numba row kernels over fp32 or int8 rows;
- `triton_ffn`: the hot (GPU) partition, Triton kernels over fp16/bf16 rows.
Submodules are imported on demand: importing this package loads neither numba nor triton.
"""
