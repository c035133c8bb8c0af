"""Compile every Triton kernel variant for NVIDIA GPUs on a machine without one.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute but not that they
compile: constexpr rules, types across branches and register use only show up in the real
compiler. This lowers each variant the launcher can ask for to a cubin for the given
architectures (triton ships ptxas) and reports registers and spills from `ptxas -v`.

    python -m bench.triton_aot [--arch 90 --arch 80] [--quick] [--json]
                                        (default: sm_90, every variant)

Exit status 1 when a variant fails to compile or spills registers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

from engine.kernels.triton_ffn import DEFAULT_CONFIG, PREDICTOR_CONFIG, LaunchConfig

# Interpreted kernels cannot be compiled; this tool needs the real decorators.
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("unset TRITON_INTERPRET to compile the kernels")

import triton
from triton.backends.compiler import GPUTarget

from engine.kernels import triton_kernels as K


def _ptxas_stats(ptx: str, arch: int) -> dict:
    """Registers and spill bytes of the kernel in `ptx`, from the ptxas that triton ships."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", src,
                              "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) if spill else 0}


# Arguments the JIT sees divisible by 16 at run time for 7B-class shapes (it specialises
# on that): pointers from the caching allocator, d, n and row strides. Without the hint the
# weight loads would not be vectorised and the register counts would mislead.
_ALIGNED_INTS = ("n", "d", "stride_gate", "stride_up", "stride_down", "rows_per_split")


def _compile(fn, signature: dict, constexprs: dict, warps: int, arch: int) -> dict:
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, ty in signature.items()
             if ty.startswith("*") or a in _ALIGNED_INTS}
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": warps})
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    ptx = compiled.asm["ptx"]
    stats = _ptxas_stats(ptx, arch)
    # 128-bit weight loads (8 fp16/bf16 per thread): the loads that can reach bandwidth.
    stats["vector_loads"] = ptx.count("ld.global.L1::evict_first.L2::cache_hint.v4")
    return stats


def variants(cfg: LaunchConfig = DEFAULT_CONFIG):
    """(name, kernel, signature, constexprs, warps) for the variants the launcher uses:
    every activation and option in fp16, one case of each kernel in bf16 (compiling all
    of them twice takes minutes on a small CPU)."""
    act_cases = [(True, True, False, "relu"), (True, True, True, "fatrelu"),
                 (True, True, False, "drelu"), (True, False, False, "relu2"),
                 (False, True, True, "relu"), (False, True, False, "relu2"),
                 (False, False, False, "relu")]
    for wdt, packed in itertools.product(("fp16", "bf16"), (True, False)):
        chunk, tile = (cfg.act_chunk_n if packed else cfg.act_tile_n), cfg.act_tile_n
        for gate, pred, rid, act in act_cases if wdt == "fp16" else act_cases[:1]:
            sig = {"x_ptr": "*fp16", "gate_ptr": f"*{wdt}", "up_ptr": f"*{wdt}",
                   "pred_ptr": "*fp32", "row_ids_ptr": "*i32", "act_ptr": "*fp32",
                   "n": "i32", "d": "i32", "stride_gate": "i32", "stride_up": "i32",
                   "pred_threshold": "fp32", "act_threshold": "fp32"}
            consts = {"HAS_GATE": gate, "HAS_PRED": pred, "HAS_ROW_IDS": rid,
                      "ACT": K.ACTIVATION_CODES[act], "PACKED": packed, "CHUNK_N": chunk,
                      "TILE_N": tile, "BLOCK_D": cfg.act_block_d}
            name = (f"ffn_act {wdt} packed={packed} gate={gate} pred={pred} "
                    f"row_ids={rid} {act}")
            yield name, K.ffn_act_kernel, sig, consts, cfg.act_warps
        chunk, tile = (cfg.down_chunk_n if packed else cfg.down_tile_n), cfg.down_tile_n
        sig = {"act_ptr": "*fp32", "down_ptr": f"*{wdt}", "part_ptr": "*fp32",
               "count_ptr": "*i32", "y_ptr": "*fp32", "n": "i32", "d": "i32",
               "stride_down": "i32", "rows_per_split": "i32", "n_splits": "i32"}
        consts = {"PACKED": packed, "CHUNK_N": chunk, "TILE_N": tile,
                  "BLOCK_D": cfg.down_block_d}
        yield f"down {wdt} packed={packed}", K.down_kernel, sig, consts, cfg.down_warps
    # The predictor: fc1 (relu) and fc2 (identity) with its own configuration.
    p = PREDICTOR_CONFIG
    for act, xdt in (("relu", "fp16"), ("identity", "fp32")):
        sig = {"x_ptr": f"*{xdt}", "gate_ptr": "*fp16", "up_ptr": "*fp16", "pred_ptr": "*fp32",
               "row_ids_ptr": "*fp32", "act_ptr": "*fp32", "n": "i32", "d": "i32",
               "stride_gate": "i32", "stride_up": "i32", "pred_threshold": "fp32",
               "act_threshold": "fp32"}
        consts = {"HAS_GATE": False, "HAS_PRED": False, "HAS_ROW_IDS": False,
                  "ACT": K.ACTIVATION_CODES[act], "PACKED": p.packed, "CHUNK_N": p.act_tile_n,
                  "TILE_N": p.act_tile_n, "BLOCK_D": p.act_block_d}
        yield f"predictor {act}", K.ffn_act_kernel, sig, consts, p.act_warps


QUICK = ("ffn_act fp16 packed=True gate=True pred=True row_ids=True fatrelu",
         "ffn_act fp16 packed=False gate=False pred=True row_ids=False relu2",
         "down fp16 packed=True", "down bf16 packed=False")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, action="append", help="SM version, e.g. 90 (repeat)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true",
                    help="one variant of each kernel and mode (the test suite's check)")
    args = ap.parse_args(argv)
    chosen = list(variants())
    if args.quick:
        chosen = [v for v in chosen if v[0] in QUICK]
    results, failed = [], False
    for arch in args.arch or [90]:
        for name, fn, sig, consts, warps in chosen:
            row = {"arch": arch, "kernel": name, "warps": warps}
            try:
                row.update(_compile(fn, sig, consts, warps, arch))
                # Every variant must read its weight rows with 128-bit loads.
                failed |= row["spill_bytes"] > 0 or row["vector_loads"] == 0
            except Exception as e:  # noqa: BLE001 - report every failing variant, not just the first
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                failed = True
            results.append(row)
            if not args.json:
                print(f"sm_{arch} {name}: " + (row.get("error") or
                      f"{row['registers']} registers, {row['spill_bytes']} spill bytes, "
                      f"{row['vector_loads']} 128-bit weight loads"))
    if args.json:
        print(json.dumps({"ok": not failed, "variants": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
