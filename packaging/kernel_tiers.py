"""The CPU tiers an installer ships compiled kernels for, and how a bundle picks its own.

numba keys each cached kernel by the code generation target: the LLVM CPU name and feature
string, the host's own unless NUMBA_CPU_NAME and NUMBA_CPU_FEATURES say otherwise. With both set
(the features to "": the named CPU's own) the key names no host, so a cache built on one machine
is used on any other of the tier (measured: a second process with the same setting compiled
nothing and took both kernels from the cache; NUMBA_CPU_NAME alone keeps the host's feature
string in the key, and a cache built that way fits that host only). A machine of a tier runs
code for the tier's generic CPU, not tuned to its own model.

`packaging/kernel_caches.py` builds one cache per tier into the bundle
(`_internal/numba-cache/<tier>/<source folder>/`); at each start the bundle's entry (packaging/
entry.py) picks the best tier this CPU has a shipped cache for (a lower one where the best is missing), sets numba's target to it and seeds the user's cache
from it. A CPU of no tier compiles for itself in the background on its first start, as from
source. This module imports no numba (the target must be set before numba is imported).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

# Best first. Features as llvmlite names them (llvmlite.binding.get_host_cpu_features()): the
# ones the tier's CPU lets LLVM emit in the kernels' code.
TIERS = {
    "avx512": {"cpu_name": "cascadelake",  # Intel since Cascade Lake / Ice Lake, AMD since Zen 4
               "needs": ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512vnni",
                         "avx2", "fma", "f16c", "bmi", "bmi2", "lzcnt", "movbe", "popcnt"]},
    "avx2": {"cpu_name": "haswell",  # Intel since Haswell (2013), AMD since Excavator / Zen
             "needs": ["avx2", "fma", "f16c", "bmi", "bmi2", "lzcnt", "movbe", "popcnt"]},
}
MANIFEST = "tiers.json"
SEED = "numba-cache"  # under the bundle's _internal folder
STAMP_PREFIX = "thermocline-kernels-"  # a completed preparation's stamp (engine.runtime.kernel_preparation)


def target_env(tier: str) -> dict[str, str]:
    return {"NUMBA_CPU_NAME": TIERS[tier]["cpu_name"], "NUMBA_CPU_FEATURES": ""}


def host_features() -> dict[str, bool]:
    try:
        from llvmlite import binding

        return dict(binding.get_host_cpu_features())
    except Exception:  # noqa: BLE001 - unknown features: no tier, compile for this host
        return {}


def host_tiers(features: dict[str, bool] | None = None) -> list[str]:
    """Every tier this CPU has every feature of, best first (an AVX-512 CPU runs the AVX2 tier too)."""
    features = host_features() if features is None else features
    return [name for name, tier in TIERS.items() if all(features.get(f) for f in tier["needs"])]


def host_tier(features: dict[str, bool] | None = None) -> str | None:
    """The best tier this CPU has every feature of, or None."""
    tiers = host_tiers(features)
    return tiers[0] if tiers else None


def cache_subpath(source_dir: str) -> str:
    """The folder numba keeps a source folder's kernels in under NUMBA_CACHE_DIR (numba's
    _CacheLocator.get_suitable_cache_subpath: the folder's name and the SHA-1 of its path)."""
    path = os.path.abspath(source_dir)
    return "_".join([os.path.split(path)[-1], hashlib.sha1(path.encode()).hexdigest()])


def _seed_folders(seed: str, manifest: dict, tier: str) -> list[str] | None:
    """The tier's folders in the bundle's seed, or None where the manifest lacks it or a folder is missing."""
    entry = manifest.get("tiers", {}).get(tier)
    folders = entry.get("folders") if isinstance(entry, dict) else None
    if not isinstance(folders, list) or not all(isinstance(f, str) and os.path.isdir(os.path.join(seed, tier, f))
                                                for f in folders):
        return None
    return folders


def seed_user_cache(internal: str, user_cache: str, features: dict[str, bool] | None = None) -> str | None:
    """Set numba's target to this CPU's best tier the bundle has a cache for and copy that cache
    into the user's cache, under the folder numba looks in for this bundle's place on disk (the
    user's install folder need not be the build's). A tier whose cache the bundle lacks (not
    built, or its folder missing) gives way to the next lower one this CPU has: code for the
    lower tier runs here, where compiling for itself would take the first start minutes.
    Returns the tier, or None (no seed for this CPU)."""
    seed = os.path.join(internal, SEED)
    try:
        with open(os.path.join(seed, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    for tier in host_tiers(features):
        folders = _seed_folders(seed, manifest, tier)
        if folders is not None:
            break
    else:
        return None
    os.environ.update(target_env(tier))
    for source in folders:  # e.g. engine/kernels, relative to _internal
        src = os.path.join(seed, tier, source)
        dst = os.path.join(user_cache, cache_subpath(os.path.join(internal, source)))
        os.makedirs(dst, exist_ok=True)
        names = os.listdir(src)
        # The user's cache came from this build when its stamps are the seed's: keep its files
        # (numba adds the kernels compiled since to their index files). Otherwise (the first
        # start, or an upgrade: other kernel sources) every file is the seed's. File times say
        # nothing here: dpkg and the Windows installer keep the build's, older than the user's.
        same_build = all(_same_bytes(os.path.join(src, n), os.path.join(dst, n))
                         for n in names if n.startswith(STAMP_PREFIX))
        for name in names:
            target = os.path.join(dst, name)
            if not same_build or not os.path.exists(target):
                shutil.copy2(os.path.join(src, name), target)
    return tier


def _same_bytes(a: str, b: str) -> bool:
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False
