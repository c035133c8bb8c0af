"""Running the real `thermocline` command as a hostile user would, one process per case.

`run_cli` starts `python -m app.cli ...` with its models, data, config and Hub folders inside
a temporary root, optionally under a memory limit (RLIMIT_AS, set in the child before it
runs), with a generous wall-clock limit that only catches hangs. `Outcome.assert_clean_error`
is the contract of bad input: exit code 2, exactly one `error: ...` line, no traceback.
`Sandbox` records every file under the root before a case and reports new files that
appeared outside the folders the program may write to.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "resources" / "demo"
HANG_GUARD_S = 240  # a hang guard on a busy shared machine, not a speed target
GiB = 1 << 30


@dataclass
class Outcome:
    argv: list
    rc: int
    stdout: str
    stderr: str
    seconds: float

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def assert_clean_error(self, *expect: str) -> str:
        where = f"{self.argv!r}\nstdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-3000:]}"
        assert "Traceback" not in self.stderr, where
        assert self.rc == 2, where
        lines = self.error_lines()
        assert len(lines) == 1, where
        for text in expect:
            assert text.lower() in lines[0].lower(), where
        return lines[0]

    def assert_ok(self) -> None:
        where = f"{self.argv!r}\nstdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-3000:]}"
        assert "Traceback" not in self.stderr and self.rc == 0, where


class Sandbox:
    """A temporary root: `models/`, `data/`, `config/`, `hf_home/` may be written, the rest not."""

    WRITABLE = ("models", "data", "config", "hf_home")

    def __init__(self, root: Path):
        self.root = root
        for name in self.WRITABLE + ("cwd", "outside"):
            (root / name).mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.env.update({
            "THERMOCLINE_MODELS_DIR": str(root / "models"), "THERMOCLINE_DATA_DIR": str(root / "data"),
            "THERMOCLINE_CONFIG_DIR": str(root / "config"), "HF_HOME": str(root / "hf_home"),
            "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(REPO),
        })
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "THERMOCLINE_OFFLINE", "DISPLAY"):
            self.env.pop(var, None)
        self._before = self._files()

    def _files(self) -> set[Path]:
        return {p for p in self.root.rglob("*") if not p.is_dir()}

    def stray_files(self) -> list[Path]:
        """Files that appeared under the root but outside the writable folders."""
        allowed = [self.root / name for name in self.WRITABLE]
        return sorted(p for p in self._files() - self._before
                      if not any(a == p or a in p.parents for a in allowed))

    def run(self, *argv, stdin: bytes | None = None, mem_gib: float | None = None,
            timeout: float = HANG_GUARD_S, env: dict | None = None) -> Outcome:
        return run_cli(list(argv), cwd=self.root / "cwd", env=dict(self.env, **(env or {})), stdin=stdin,
                       mem_gib=mem_gib, timeout=timeout)


def _limit_memory(gib: float):
    def apply():
        size = int(gib * GiB)
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    return apply


def run_cli(argv: list, *, cwd: Path, env: dict, stdin: bytes | None = None, mem_gib: float | None = None,
            timeout: float = HANG_GUARD_S) -> Outcome:
    cmd = [sys.executable, "-m", "app.cli", *argv]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, input=stdin if stdin is not None else b"",
                              capture_output=True, timeout=timeout,
                              preexec_fn=_limit_memory(mem_gib) if mem_gib else None)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{argv!r} hung: still running after {timeout} s\n"
                             f"stderr: {(exc.stderr or b'')[-2000:]!r}") from None
    return Outcome(argv, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                   proc.stderr.decode("utf-8", "replace"), time.monotonic() - start)


def demo_copy(dest: Path, *, weights: str = "link") -> Path:
    """The demo model's files in `dest`; the 20 MB weights symlinked unless `weights="copy"`."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for src in DEMO.iterdir():
        if src.is_dir():
            continue
        if src.name == "model.safetensors" and weights == "link":
            (dest / src.name).symlink_to(src)
        elif src.name == "model.safetensors" and weights == "none":
            continue
        else:
            shutil.copy2(src, dest / src.name)
    return dest
