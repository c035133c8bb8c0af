"""Benchmarks: each module runs with `python -m bench.<name>` and prints one JSON object as
its last line. They measure speed; the test suite checks behaviour, never wall time."""
