"""House rules that tools check: the lint configured in pyproject.toml ([tool.ruff]) passes,
as pre-commit and .ci/run run it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    try:
        import ruff  # noqa: F401 - only whether it is installed
    except ImportError:
        raise AssertionError("ruff is missing: pip install -e '.[test]' (it is in the test extra)") from None
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
