#!/usr/bin/env bash
# GPU checks of the Triton kernels, for a short lease of a CUDA machine (about 5 minutes).
#
#   bench/gpu.sh            (from anywhere; outputs under $OUT, default bench/out-gpu)
#
# Assumptions about the (bare) machine: an NVIDIA driver (nvidia-smi), and a python3 (or
# $PYTHON) whose torch is a CUDA build with triton >= 3.0, as device images ship. The
# machine may have no internet, so the script downloads nothing it can avoid:
#   - a venv with --system-site-packages reuses that torch/triton; the project goes into it
#     with `pip install --no-deps --no-build-isolation -e .` (offline), and the repository
#     root is on PYTHONPATH as well, so nothing breaks if that install fails;
#   - modules the steps import and the machine lacks (pytest; the engine package's own
#     imports such as safetensors or tokenizers) are installed from $WHEELHOUSE when set
#     (pip --no-index --find-links), else from the package index if it is reachable.
#     Prepare one where there is internet, for the device's Python version, e.g.
#       pip download -d wheels --only-binary=:all: --python-version 3.11 \
#           pytest pytest-timeout safetensors tokenizers jinja2 sentencepiece numpy
#     and pass WHEELHOUSE=wheels (carry the folder to the machine).
#
# Steps: each is logged and time-limited; a failing step does not stop the next ones,
# and the script exits 1 at the end if any failed.
#   1. versions: nvidia-smi, python, torch (+CUDA), triton;
#   2. pytest tests/test_kernels_triton.py, test_cuda_engine.py and test_kernel_cases.py on CUDA (TRITON_INTERPRET unset),
#      and the three-tier placement of test_beyond_ram.py (hot neurons on the GPU, a neuron cache in
#      RAM, cold rows on disk: the same logits as every cold row in RAM);
#   3. python -m bench.ffn --device cuda --json: dense cuBLAS fp16 vs the Triton kernels
#      (target at 10% active: >= 5x and >= 60% of the copy bandwidth);
#   4. python -m bench.triton_tune --json: launch configurations compared, the
#      best one named, predictor_triton vs predictor_torch;
#   5. python -m bench.hybrid --json: end-to-end decode of 8 layers of 7B shapes, hot neurons on
#      the GPU and cold on the CPU, against our all-CPU sparse decode and a layer-offload
#      baseline with the same VRAM (25% and 50% of the FFN), logits checked against the CPU's.
# Outputs in $OUT: versions.txt, pytest.txt, ffn.json (+ ffn.log), tune.json (+ tune.log),
# hybrid.json (+ hybrid.log), summary.txt. DRY_RUN=1 checks the script itself on a machine without a GPU (Triton
# interpreter, tiny tuning shapes, no bench.ffn).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/bench/out-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
VENV="${VENV:-${TMPDIR:-/tmp}/thermocline-gpu-venv}"
unset TRITON_INTERPRET
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
FAILED=()

log() { echo "[gpu.sh $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }

# step NAME SECONDS COMMAND...: run with a time limit, record success or failure.
step() {
    local name="$1" limit="$2"
    shift 2
    log "start $name (limit ${limit}s)"
    local rc=0
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    if [ "$rc" -eq 0 ]; then
        log "ok    $name"
    else
        log "FAIL  $name (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
        FAILED+=("$name")
    fi
}

: > "$OUT/summary.txt"
log "repository $ROOT, outputs $OUT"

# ---- 1. environment and versions
if "$PY" -m venv --system-site-packages "$VENV" >/dev/null 2>&1 \
        && "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    PY="$VENV/bin/python"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
        || log "note: pip install -e . failed; using PYTHONPATH"
else
    log "note: no usable venv over $PY's packages; using $PY with PYTHONPATH"
fi

pip_install() {  # pip_install ARGS...: from $WHEELHOUSE if set, else the index (fail fast)
    if [ -n "${WHEELHOUSE:-}" ]; then
        "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" "$@"
    else
        "$PY" -m pip install -q --retries 0 --timeout 10 "$@"
    fi
}

{
    nvidia-smi || echo "nvidia-smi failed"
    "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          f"{p.total_memory / 2**30:.0f} GiB")
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton missing:", e)
EOF
} 2>&1 | tee "$OUT/versions.txt" || true

if [ "${DRY_RUN:-0}" = 1 ]; then
    # Check this script's plumbing on a machine without a GPU: interpreter tests, a tiny
    # tuning run, no bench.ffn.
    export TRITON_INTERPRET=1
    log "DRY_RUN=1: CPU interpreter, tiny shapes, bench.ffn skipped"
elif ! "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    log "FAIL  no CUDA torch with triton in $PY: nothing to run"
    exit 1
fi
"$PY" -c "import pytest" 2>/dev/null || pip_install pytest pytest-timeout \
    || log "note: could not install pytest"
if ! "$PY" -c "import engine.kernels.triton_ffn" 2>"$OUT/import.txt"; then
    log "note: the engine does not import ($(tail -1 "$OUT/import.txt")); installing deps"
    pip_install -e . || log "note: installing the project's dependencies failed"
fi

# ---- 2. kernel tests on CUDA
step "pytest tests/test_kernels_triton.py tests/test_cuda_engine.py tests/test_kernel_cases.py" 240 \
    bash -c "'$PY' -m pytest tests/test_kernels_triton.py tests/test_cuda_engine.py tests/test_kernel_cases.py -q -p no:cacheprovider 2>&1 | tee '$OUT/pytest.txt'; exit \${PIPESTATUS[0]}"
step "pytest tests/test_beyond_ram.py -k three_tiers (VRAM, RAM cache, disk)" 240 \
    bash -c "'$PY' -m pytest tests/test_beyond_ram.py -k three_tiers -q -p no:cacheprovider 2>&1 | tee '$OUT/pytest_three_tiers.txt'; exit \${PIPESTATUS[0]}"

# ---- 3. the benchmark: dense cuBLAS vs Triton
if [ "${DRY_RUN:-0}" != 1 ]; then
    step "bench.ffn --device cuda" 150 \
        bash -c "'$PY' -m bench.ffn --device cuda --json > '$OUT/ffn.json' 2> '$OUT/ffn.log'"
fi
# bench.ffn prints its table on stderr: keep the table lines (not warnings) in the summary.
grep -E '^(cuda|[[:space:]]*(shape|7B|13B))' "$OUT/ffn.log" >> "$OUT/summary.txt" 2>/dev/null || true

# ---- 4. launch configurations
step "triton_tune" 150 \
    bash -c "'$PY' -m bench.triton_tune --json $([ "${DRY_RUN:-0}" = 1 ] && echo --smoke) > '$OUT/tune.json' 2> '$OUT/tune.log'"
# triton_tune --json prints its table on stderr.
grep -E '^(  |[a-z0-9_]+ \(|predictor|NVIDIA|.*copy [0-9])' "$OUT/tune.log" >> "$OUT/summary.txt" || true

# ---- 5. the headline: hybrid decode vs all-CPU and vs layer offload
step "bench.hybrid" 360 \
    bash -c "'$PY' -m bench.hybrid --json $([ "${DRY_RUN:-0}" = 1 ] && echo --smoke) > '$OUT/hybrid.json' 2> '$OUT/hybrid.log'"
"$PY" - "$OUT/hybrid.json" >> "$OUT/summary.txt" 2>/dev/null <<'EOF' || true
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(f"hybrid: {r['shape']}, cuda {r['cuda']}, all-CPU sparse {r['cpu']['decode_tok_s']:.2f} tok/s")
for b in r["budgets"]:
    print(f"  VRAM {b['vram_share_of_ffn']:.0%} of FFN: hybrid {b['hybrid']['decode_tok_s']:.2f} tok/s "
          f"({b['hybrid_vs_offload']}x layer offload, {b['hybrid_vs_cpu']}x all-CPU), "
          f"cosine vs CPU {b['hybrid']['cosine_vs_cpu']}")
EOF

if [ "${#FAILED[@]}" -gt 0 ]; then
    log "failed steps: ${FAILED[*]}"
    exit 1
fi
log "all steps passed"
