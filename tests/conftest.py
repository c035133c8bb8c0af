"""Shared fixtures: tiny random models of every family, built once per session."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import model_factory
import pytest
import torch


def pytest_configure(config):
    """The environment every test module needs, set once before any is collected: Qt draws
    offscreen, and without CUDA Triton interprets its kernels on CPU tensors (Triton picks
    compile-or-interpret when its decorators run, at a kernel module's first import; the
    engine runs Triton on the CPU only where a test asks, hot_q4.TRITON_ON_CPU). The
    repository and tests/ are on sys.path by pyproject's `pythonpath` (bench, tools, helpers)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    # The terminal chat, `generate` and the window answer on slower paths while a first start
    # compiles the CPU kernels (app.kernel_words); the suite's comparisons run on one set of
    # kernels, so its loads wait for them. The first-start tests ask for the background explicitly.
    os.environ.setdefault("THERMOCLINE_KERNELS", "wait")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


PREWARM_MIN_TESTS = 200  # a run of a few files compiles what it needs; only a whole suite gains
# Files that compile most of what they run at their first test. They run last when the prewarm
# runs, so that it has compiled their kernels by then: first, test_batching's first test took
# 179 s of a cold run and test_bench_smoke 369 s; run after them, test_beyond_ram's 4-bit disk
# test compiled the 4-bit kernels beside the prewarm compiling the same (157 s).
COMPILE_HEAVY_MODULES = ("test_batching.py", "test_bench_smoke.py", "test_beyond_ram.py")
_prewarm: subprocess.Popen | None = None


def _prewarm_wanted(config, items) -> bool:
    import importlib.util

    return len(items) >= PREWARM_MIN_TESTS and os.environ.get("THERMOCLINE_TEST_PREWARM", "1") != "0" \
        and not hasattr(config, "workerinput") and importlib.util.find_spec("numba") is not None


def pytest_collection_modifyitems(config, items):
    if _prewarm_wanted(config, items):  # a stable sort: each file keeps its own order
        items.sort(key=lambda item: item.path.name in COMPILE_HEAVY_MODULES)


def pytest_collection_finish(session):
    """A large run starts tests/kernel_prewarm.py beside it: numba compiles the CPU kernels
    there, on the core the suite leaves idle while it compiles or runs on one (see that file)."""
    global _prewarm
    if not _prewarm_wanted(session.config, session.items):
        return
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]))
    log = Path(tempfile.gettempdir()) / f"thermocline-prewarm-{os.getpid()}.log"  # what it did, and why a step failed
    with open(log, "wb") as out:
        _prewarm = subprocess.Popen([sys.executable, str(root / "tests" / "kernel_prewarm.py")], cwd=root, env=env,
                                    stdout=out, stderr=subprocess.STDOUT)


def pytest_unconfigure(config):
    if _prewarm is not None and _prewarm.poll() is None:
        _prewarm.terminate()  # numba writes each cache file whole and renames it: nothing is left half written
        try:
            _prewarm.wait(30)
        except subprocess.TimeoutExpired:
            _prewarm.kill()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": model_factory.llama_relu(root / "llama"),
        "mistral": model_factory.mistral_drelu(root / "mistral"),
        "falcon_mq": model_factory.falcon_relu(root / "falcon_mq"),
        "falcon_new": model_factory.falcon_relu(root / "falcon_new", new_arch=True),
    }


_NUMBA_TARGET = {k: v for k, v in os.environ.items() if k.startswith("NUMBA_CPU_")}  # as the suite started


@pytest.fixture(autouse=True)
def numba_target_kept():
    """No test leaves a NUMBA_CPU_* variable behind: every later subprocess would compile all its
    kernels again for that target (test_kernel_tiers once cost a cold run about 5 minutes so)."""
    yield
    now = {k: v for k, v in os.environ.items() if k.startswith("NUMBA_CPU_")}
    assert now == _NUMBA_TARGET, f"the test left the numba target {now} in os.environ"


@pytest.fixture(autouse=True, scope="session")
def default_kv_cache():
    """The CPU KV cache's default format (fp16) whatever the developer's shell says."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("THERMOCLINE_KV_CACHE", raising=False)
        mp.delenv("THERMOCLINE_FUSED_DECODE", raising=False)  # the fused decode on, its default
        yield


@pytest.fixture(scope="module")
def exact_kv_cache():
    """The CPU KV cache in fp32 (THERMOCLINE_KV_CACHE=fp32), the exact reference: for a
    module whose comparisons are exact to 1e-4 or tighter (`pytestmark =
    pytest.mark.usefixtures("exact_kv_cache")`); the fp16 default has its own bounded tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("THERMOCLINE_KV_CACHE", "fp32")
        yield


@pytest.fixture
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core CI box spinning
    OpenMP threads make them many times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine():
    """The embedded demo model, dense: the engine the server and remote tests serve (one per
    module, so a test's monkeypatching of it ends with its module; a module's own `engine`
    fixture takes its place there)."""
    from engine import Engine
    from models_registry.resolve import resolve_model

    return Engine.load(resolve_model("demo"), mode="dense")


@pytest.fixture(scope="module")
def server(engine):
    """The real uvicorn over `engine` on a free 127.0.0.1 port, as `thermocline serve` runs it."""
    from app.server.runner import ServerThread

    srv = ServerThread(lambda: engine, lambda: "demo", port=0, max_waiting=16).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def wide_llama_dir(tmp_path_factory) -> Path:
    """A tiny llama with wide FFNs (2 x 4096 neurons of d 256, 3.6 MB of 4-bit rows): the disk
    tier's tests, whose rows must outweigh the reader's buffers (1.6 MB) to run from disk."""
    return model_factory.llama_relu(tmp_path_factory.mktemp("wide") / "llama", hidden=256, ff=4096)
