"""Benchmarks: each module runs with `python -m bench.<name>` and prints one JSON object as
its last line. They measure speed; the test suite checks behaviour, never wall time."""

import os

# As the engine does (engine/__init__.py): torch's spinning OpenMP workers would otherwise
# steal the cores from the numba kernels. Set here so it precedes every benchmark's torch import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def emit(result: dict, json_only: bool) -> None:
    """A readable table unless --json, then the result as one JSON object on the last line."""
    import json

    if not json_only:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    print(json.dumps(result))


def llama_cpp_missing() -> str | None:
    """Why llama.cpp's side of a benchmark cannot run here, or None when llama-cpp-python imports."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e}); pip install -e '.[bench]'"
    return None
