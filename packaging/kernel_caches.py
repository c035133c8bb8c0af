"""Build the kernel caches an installer ships, one per CPU tier (packaging/kernel_tiers.py), into a
frozen bundle: `_internal/numba-cache/<tier>/<source folder>/` and `_internal/numba-cache/tiers.json`.

For each tier the bundle itself runs its kernel preparation (THERMOCLINE_PREPARE_KERNELS=1:
every kernel the window, the terminal chat and `generate` run by default, stamped complete as a
first start stamps them) with numba's target set to the tier's CPU, into an empty cache; the
folders numba wrote for the bundle's kernel sources move into the seed under their path
relative to `_internal`, where each user's start finds them (packaging/entry.py). A tier
compiles on any x86-64 build machine: code generation for a named CPU does not need that CPU,
and the preparation's warm-up calls run on the build machine (it must have the tier's features
to run them: build on an AVX-512 machine for both tiers).

    python packaging/kernel_caches.py BUNDLE_DIR [--exe thermocline] [--tiers avx512,avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_tiers


def build_tier(bundle: Path, exe: str, tier: str, seed: Path) -> dict:
    internal = bundle / "_internal"
    scratch = Path(tempfile.mkdtemp(prefix=f"thermocline-cache-{tier}-"))
    try:
        env = {**os.environ, **kernel_tiers.target_env(tier), "NUMBA_CACHE_DIR": str(scratch / "numba"),
               "THERMOCLINE_PREPARE_KERNELS": "1", "HOME": str(scratch), "XDG_CACHE_HOME": str(scratch / "cache")}
        start = time.monotonic()
        subprocess.run([str(bundle / exe)], env=env, cwd=scratch, check=True, timeout=7200)
        folders = []
        for sub in sorted((scratch / "numba").iterdir()):
            source = next((p for p in _source_folders(internal) if kernel_tiers.cache_subpath(str(p)) == sub.name), None)
            if source is None:
                raise SystemExit(f"error: numba cached {sub.name}, which is no folder of {internal}")
            rel = source.relative_to(internal).as_posix()
            dst = seed / tier / rel
            shutil.rmtree(dst, ignore_errors=True)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(sub), dst)
            folders.append(rel)
        stamps = sorted(p.name for p in (seed / tier).rglob("thermocline-kernels-*.json"))
        if not stamps:
            raise SystemExit(f"error: the {tier} preparation stamped nothing complete")
        return {"folders": folders, "stamps": stamps, "seconds": round(time.monotonic() - start, 1),
                **kernel_tiers.TIERS[tier]}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _source_folders(internal: Path):
    seen = set()
    for py in internal.rglob("*.py"):
        if py.parent not in seen:
            seen.add(py.parent)
            yield py.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--exe", default="thermocline.exe" if sys.platform == "win32" else "thermocline",
                        help="the bundle's console executable (Windows: thermocline-cli.exe)")
    parser.add_argument("--tiers", default=",".join(kernel_tiers.TIERS))
    args = parser.parse_args(argv)
    seed = args.bundle / "_internal" / kernel_tiers.SEED
    shutil.rmtree(seed, ignore_errors=True)
    seed.mkdir(parents=True)
    manifest = {"tiers": {}}
    here = kernel_tiers.host_features()
    for tier in args.tiers.split(","):
        missing = [f for f in kernel_tiers.TIERS[tier]["needs"] if not here.get(f)]
        if missing:  # the preparation runs the kernels it compiles: this machine must have the tier
            print(f"WARNING: no kernel cache for {tier}: this build machine lacks {', '.join(missing)}",
                  file=sys.stderr)
            continue
        manifest["tiers"][tier] = build_tier(args.bundle, args.exe, tier, seed)
        print(f"kernel cache for {tier}: {manifest['tiers'][tier]}", flush=True)
    (seed / kernel_tiers.MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
