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


def test_the_architecture_page_lists_every_kernel_file_and_every_floor():
    """docs/ARCHITECTURE.md's kernel table names each file of engine/kernels/, and its floors
    diagram names each of engine's floors (import_graph.FLOORS), so neither goes stale."""
    import import_graph

    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    kernels = sorted(p.name for p in (ROOT / "engine" / "kernels").glob("*.py") if p.name != "__init__.py")
    assert not [k for k in kernels if f"`{k}`" not in page]
    diagram = page[page.index("### engine's floors"):page.index("### The kernel files")]
    assert all(f"\n{floor} " in diagram for floor in import_graph.FLOORS)
