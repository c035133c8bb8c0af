"""Every case of the kernel case table (tests/kernel_cases.py: the sparse FFN, the int8 matvec,
decode attention) on every backend present: numba, the torch fallback, Triton under the
interpreter (CUDA when there is a GPU), against one fp64 reference per op with one error
measure. `python -m bench.kernel_cases` times the same table.
"""

import pytest

from kernel_cases import BACKENDS, CASES, build_layer, check

RUNS = [pytest.param(backend, case, id=f"{name}-{case.id}")
        for name, backend in BACKENDS.items() for case in CASES if backend.supports(case)]


@pytest.mark.parametrize("backend,case", RUNS)
def test_case_matches_the_fp64_reference(backend, case):
    if not backend.available():
        pytest.skip(f"{backend.name} is not available here")
    err, tol = check(case, backend), backend.bound(case)
    assert err <= tol, f"{backend.name} {case.id}: error {err:.2e} > {tol:.0e}"


def test_the_table_covers_every_activation_format_and_a_real_selection():
    ffn = [c for c in CASES if c.op == "sparse_ffn"]
    assert {c.activation for c in ffn} == {"relu", "fatrelu", "drelu", "relu2", "silu"}
    assert {c.weights for c in ffn} == {"fp32", "int8", "int4", "fp16", "bf16"}
    assert {c.op for c in CASES} == {"sparse_ffn", "matvec", "matmul_q4", "matmul_int8", "decode_attention",
                                      "decode_linear_q4_1"}
    for name, backend in BACKENDS.items():
        assert any(backend.supports(c) for c in CASES), name
    sparse = [c for c in ffn if c.fraction < 1]
    for case in sparse:
        chosen = int(build_layer(case).selected.sum())
        assert 0 < chosen < case.n, case.id


def test_a_wrong_kernel_result_fails_the_check(monkeypatch):
    """The check can fail: a kernel that drops one selected neuron is caught."""
    from engine.kernels import cpu

    case = next(c for c in CASES if c.weights == "fp32" and c.fraction == 1.0)
    real = cpu.sparse_ffn
    monkeypatch.setattr(cpu, "sparse_ffn", lambda x, rows, active, *a, **k: real(x, rows, active[1:], *a, **k))
    assert check(case, BACKENDS["torch"]) > case.tol


def test_a_wrong_attention_result_fails_the_check(monkeypatch):
    """The other ops' checks can fail too: attention that reads one position past `length`."""
    from engine.kernels import cpu

    case = next(c for c in CASES if c.op == "decode_attention" and c.length > 1)
    real = cpu.decode_attention
    monkeypatch.setattr(cpu, "decode_attention", lambda q, k, v, length, scale: real(q, k, v, length + 1, scale))
    assert check(case, BACKENDS["torch"]) > case.tol


def test_q4_1_products_without_their_block_offsets_fail_the_check(monkeypatch):
    """The fused decode's Q4_1 rows checked for their offsets: the Q4_0 part alone is caught."""
    if not BACKENDS["numba-int8act"].available():
        pytest.skip("no int8-activation kernels here")
    from engine.kernels import decode_layer as dl

    case = next(c for c in CASES if c.op == "decode_linear_q4_1" and c.n == 960)
    real = dl.linear
    monkeypatch.setattr(dl, "linear", lambda kind, wb, off, x, t: real(kind - dl.Q4MIN_SHIFT, wb, off[:0], x, t))
    assert check(case, BACKENDS["numba-int8act"]) > case.tol
