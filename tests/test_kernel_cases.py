"""Every case of the kernel case table (tests/kernel_cases.py: the sparse FFN by ids, by the
predictor's logits, for a few tokens and for a prefill, the products, decode attention,
Triton's down projection and predictor) on every backend present: numba, the torch fallback,
Triton under the interpreter (CUDA when there is a GPU) in each launch configuration, against
one fp64 reference per op with one error measure. `python -m bench.kernel_cases` times the
same table.
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
    assert {c.op for c in CASES} == {"sparse_ffn", "sparse_ffn_predicted", "sparse_ffn_batch", "sparse_ffn_tokens",
                                     "matvec", "matmul_q4", "matmul_int8", "decode_attention", "down_proj",
                                     "predictor", "decode_linear_q4_1", "moe_ffn"}
    assert {c.route for c in CASES if c.op == "sparse_ffn_predicted"} == {"logits", "row-ids"}
    assert {c.route for c in CASES if c.op == "sparse_ffn_tokens"} == {"union", "per_token"}
    for name, backend in BACKENDS.items():
        assert any(backend.supports(c) for c in CASES), name
    for case in [c for c in CASES if c.op != "sparse_ffn_tokens" and c.op.startswith("sparse") and 0 < c.fraction < 1]:
        chosen = int(build_layer(case).selected.sum())
        assert 0 < chosen < case.n, case.id
    for case in [c for c in CASES if c.op == "sparse_ffn_tokens" and c.fraction < 1]:
        chosen = build_layer(case).selected.sum(1)
        assert chosen[0] == 0 and (0 < chosen[1:]).all() and (chosen[1:] < case.n).all(), case.id


def test_a_wrong_kernel_result_fails_the_check(monkeypatch):
    """The check can fail: a kernel that drops one selected neuron is caught."""
    from engine.kernels import cpu

    case = next(c for c in CASES if c.weights == "fp32" and c.fraction == 1.0)
    real = cpu.sparse_ffn

    def drops_one(x, rows, active, *a, out_acts=None):
        return real(x, rows, active[1:], *a, out_acts=out_acts[1:])

    monkeypatch.setattr(cpu, "sparse_ffn", drops_one)
    assert check(case, BACKENDS["torch"]) > case.tol


def test_wrong_activations_fail_the_check(monkeypatch):
    """The activations a kernel hands out are checked too: one neuron's left unwritten (NaN) fails."""
    from engine.kernels import cpu

    case = next(c for c in CASES if c.op == "sparse_ffn_predicted" and c.weights == "fp32" and c.fraction == 1.0)
    real = cpu.sparse_ffn_predicted

    def forgets_one(*a, out_acts=None, **k):
        y = real(*a, out_acts=out_acts, **k)
        out_acts[0] = float("nan")
        return y

    monkeypatch.setattr(cpu, "sparse_ffn_predicted", forgets_one)
    assert check(case, BACKENDS["torch"]) > case.tol


def test_an_exact_row_fails_on_a_difference_of_one_bit(monkeypatch):
    """A row whose reference is another kernel run (many tokens == one token at a time) has bound 0."""
    import torch

    from engine.kernels import cpu_q4

    backend = BACKENDS["numba-int8act"]
    if not backend.available():
        pytest.skip("needs the int8-activation kernels (numba, AVX2)")
    case = next(c for c in CASES if c.route == "matvec" and c.n > 1)
    real = cpu_q4.matvec_q4
    monkeypatch.setattr(cpu_q4, "matvec_q4", lambda x, q, cols: torch.nextafter(real(x, q, cols), torch.tensor(1e9)))
    assert check(case, backend) > 0


def test_a_mixture_missing_its_hot_rows_fails_the_check(monkeypatch):
    """The mixture's check can fail: an expert table that leaves out the split experts' hot rows."""
    from engine.runtime import fused_decode

    if not BACKENDS["numba-fused"].available():
        pytest.skip("the fused decode does not run here")
    case = next(c for c in CASES if c.op == "moe_ffn" and c.weights == "int8")
    real = fused_decode.moe_ffn_args

    def without_hot_rows(*a, **k):
        args, out = real(*a, **k)
        table = args[-1].copy()
        table[1] = 0
        return (*args[:-1], table), out

    assert check(case, BACKENDS["numba-fused"]) <= case.tol
    monkeypatch.setattr(fused_decode, "moe_ffn_args", without_hot_rows)
    assert check(case, BACKENDS["numba-fused"]) > case.tol


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
