"""The installers' kernel caches per CPU tier (packaging/kernel_tiers.py): a cache built with
numba's target set to a tier, in one place on disk, is found by a process started from
another place with the same tier, which compiles nothing; the host's own target does not
share it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "packaging"))

import kernel_tiers  # noqa: E402

# Two real kernels, the way the engine calls them; prints what numba compiled and loaded.
RUN_KERNELS = """
import json, torch
from engine.kernels import cpu, cpu_numba, cpu_quant
from numba.core.registry import cpu_target
q, s = cpu_quant.quantize_rows_int8(torch.randn(64, 256))
cpu.matvec_int8(torch.randn(256), q, s)
ds = [cpu_numba.quantize_rows_int8, cpu_numba.matvec_rows_int8]
print(json.dumps({"target": list(cpu_target.target_context.codegen().magic_tuple()),
                  "compiled": sum(sum(d.stats.cache_misses.values()) for d in ds),
                  "from_cache": sum(sum(d.stats.cache_hits.values()) for d in ds)}))
"""


def test_the_best_tier_this_cpu_has():
    avx2 = {f: True for f in kernel_tiers.TIERS["avx2"]["needs"]}
    avx512 = {f: True for f in kernel_tiers.TIERS["avx512"]["needs"]}
    assert kernel_tiers.host_tier(avx512) == "avx512"
    assert kernel_tiers.host_tier(avx2) == "avx2"
    assert kernel_tiers.host_tier({**avx512, "avx512vnni": False}) == "avx2"  # Skylake-SP: no VNNI
    assert kernel_tiers.host_tier({"avx": True, "sse4.2": True}) is None  # compiles for itself


def test_cache_subpath_is_numbas():
    from numba.core.caching import _CacheLocator

    here = str(ROOT / "engine" / "kernels" / "cpu_numba.py")
    assert kernel_tiers.cache_subpath(os.path.dirname(here)) == _CacheLocator.get_suitable_cache_subpath(here)


def unset_target(monkeypatch) -> None:
    """No NUMBA_CPU_* in this process now, and none after the test. seed_user_cache sets them
    in os.environ for the numba a start imports next; a bare delenv of a missing name records
    nothing to undo, so they stayed set for the rest of the suite and every later subprocess
    compiled all its kernels again for the tier's target (about 5 minutes of a cold run)."""
    for k in kernel_tiers.target_env("avx2"):
        monkeypatch.setenv(k, "")  # recorded as absent before: removed again at the test's end
        monkeypatch.delenv(k)


def _bundle(at: Path) -> Path:
    """The kernels' sources as a bundle holds them (`_internal/engine/...`)."""
    internal = at / "_internal"
    shutil.copytree(ROOT / "engine", internal / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    return internal


def _run(internal: Path, env: dict) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}  # only `env`'s target
    out = subprocess.run([sys.executable, "-c", RUN_KERNELS], cwd=internal, capture_output=True, text=True,
                         timeout=1200, env={**base, "PYTHONPATH": str(internal), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(1800)
def test_a_tier_cache_built_in_one_place_is_used_from_another_and_compiles_nothing(tmp_path, monkeypatch):
    from llvmlite import binding

    if not binding.get_host_cpu_features().get("avx2"):
        pytest.skip("the AVX2 tier's kernels run only on an AVX2 CPU")
    built = _bundle(tmp_path / "build")
    tier_env = kernel_tiers.target_env("avx2")
    first = _run(built, {**tier_env, "NUMBA_CACHE_DIR": str(tmp_path / "build-cache")})
    assert first["target"][1:] == ["haswell", ""] and first["compiled"] == 2  # no host in the key
    # What kernel_caches.py ships: the folder numba wrote, under its path inside the bundle.
    seed = built / kernel_tiers.SEED
    (seed / "avx2").mkdir(parents=True)
    shutil.move(str(tmp_path / "build-cache" / kernel_tiers.cache_subpath(str(built / "engine" / "kernels"))),
                seed / "avx2" / "engine" / "kernels")
    (seed / kernel_tiers.MANIFEST).write_text(json.dumps({"tiers": {"avx2": {"folders": ["engine/kernels"]}}}))

    installed = tmp_path / "elsewhere" / "Thermocline"  # another user's install folder
    shutil.copytree(built.parent, installed)
    internal = installed / "_internal"
    user = tmp_path / "user-cache"
    avx2_cpu = {f: True for f in kernel_tiers.TIERS["avx2"]["needs"]}
    unset_target(monkeypatch)
    assert kernel_tiers.seed_user_cache(str(internal), str(user), avx2_cpu) == "avx2"
    assert {k: os.environ[k] for k in tier_env} == tier_env  # set for numba, before it is imported
    second = _run(internal, {**tier_env, "NUMBA_CACHE_DIR": str(user)})
    assert second["compiled"] == 0 and second["from_cache"] == 2
    native = _run(internal, {"NUMBA_CACHE_DIR": str(user)})  # the host's own target: not this cache
    assert native["compiled"] == 2 and native["target"][1] != "haswell"


@pytest.mark.parametrize("missing", ["not built", "folder missing"])
def test_a_cpu_whose_best_tier_has_no_cache_takes_the_next_lower_one(tmp_path, monkeypatch, missing):
    """An AVX-512 CPU and a bundle without the AVX-512 tier's cache (built on an AVX2 machine,
    or its folder lost): the AVX2 tier's cache is seeded and numba's target set to it, instead
    of a first start that compiles every kernel for itself."""
    internal = tmp_path / "_internal"
    seed = internal / kernel_tiers.SEED
    (seed / "avx2" / "engine" / "kernels").mkdir(parents=True)
    (seed / "avx2" / "engine" / "kernels" / "cpu_numba.kernel.nbi").write_bytes(b"index")
    tiers = {"avx2": {"folders": ["engine/kernels"]}}
    if missing == "folder missing":
        tiers["avx512"] = {"folders": ["engine/kernels"]}  # in the manifest, not on disk
    (seed / kernel_tiers.MANIFEST).write_text(json.dumps({"tiers": tiers}))
    unset_target(monkeypatch)
    avx512_cpu = {f: True for f in kernel_tiers.TIERS["avx512"]["needs"]}
    user = tmp_path / "user-cache"
    assert kernel_tiers.seed_user_cache(str(internal), str(user), avx512_cpu) == "avx2"
    assert os.environ["NUMBA_CPU_NAME"] == kernel_tiers.TIERS["avx2"]["cpu_name"]
    copied = user / kernel_tiers.cache_subpath(str(internal / "engine" / "kernels")) / "cpu_numba.kernel.nbi"
    assert copied.read_bytes() == b"index"
    no_tier = {"avx": True}
    assert kernel_tiers.seed_user_cache(str(internal), str(tmp_path / "other"), no_tier) is None


def test_an_upgrade_replaces_the_cache_an_older_build_seeded(tmp_path, monkeypatch):
    """The installers keep the build's file times (dpkg, Inno Setup), older than the files the
    user's starts wrote: a new build's seed still replaces an older build's cache, and the
    kernels numba added to the user's index files since are kept while the build is the same."""
    internal = tmp_path / "_internal"
    shipped = internal / kernel_tiers.SEED / "avx2" / "engine" / "kernels"
    shipped.mkdir(parents=True)
    (internal / kernel_tiers.SEED / kernel_tiers.MANIFEST).write_text(
        json.dumps({"tiers": {"avx2": {"folders": ["engine/kernels"]}}}))
    index, stamp = "cpu_numba.ffn_rows-199.py311.nbi", f"{kernel_tiers.STAMP_PREFIX}sparse-int8.json"

    def ship(build: str) -> None:  # a build's seed, with its build machine's (old) file times
        (shipped / index).write_text(f"index of build {build}")
        (shipped / stamp).write_text(json.dumps({"sources": build}))
        for p in shipped.iterdir():
            os.utime(p, (1_000_000_000, 1_000_000_000))

    unset_target(monkeypatch)
    avx2_cpu = {f: True for f in kernel_tiers.TIERS["avx2"]["needs"]}
    user = tmp_path / "user-cache"
    mine = user / kernel_tiers.cache_subpath(str(internal / "engine" / "kernels"))
    ship("1")
    assert kernel_tiers.seed_user_cache(str(internal), str(user), avx2_cpu) == "avx2"
    (mine / index).write_text("index of build 1 + an int4 kernel compiled since")  # numba, a later start
    kernel_tiers.seed_user_cache(str(internal), str(user), avx2_cpu)
    assert (mine / index).read_text() == "index of build 1 + an int4 kernel compiled since"
    ship("2")  # the upgrade
    kernel_tiers.seed_user_cache(str(internal), str(user), avx2_cpu)
    assert (mine / index).read_text() == "index of build 2" and json.loads((mine / stamp).read_text()) == {"sources": "2"}
