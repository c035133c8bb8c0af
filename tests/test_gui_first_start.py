"""The window on a first start (no CPU kernels compiled for this machine): the model answers
at once, the status bar shows the kernels being prepared ("3 of 14") until they are all in,
and nothing says "loaded" before the model can answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import cpu_numba
from engine.runtime import kernel_preparation as kp
from gui_helpers import close_window, make_window, send, wait_idle
from kernel_steps import HeldSteps, forget_preparation

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not cpu_numba.HAS_AVX2, reason="the fused decode runs on AVX2 hosts")]


def test_status_bar_shows_the_kernels_preparing_while_the_model_answers(qtbot, tmp_path, llama_dir, monkeypatch):
    from engine import Engine
    from engine.runtime.engine import _KernelWarmup

    Engine.load(llama_dir, mode="dense", cpu_weights="int8")  # compiled in this process: the held steps are quick
    _KernelWarmup.run_all("dense", "int8")
    kind = kp.kind_of("dense", "int8")
    forget_preparation(kind)
    monkeypatch.setenv("THERMOCLINE_KERNELS", "background")
    steps = HeldSteps(monkeypatch)
    w = make_window(qtbot, tmp_path, llama_dir, start=False, monkeypatch=monkeypatch)
    said = []
    w.client.loading.connect(lambda _fraction, text: said.append(text))
    try:
        w.start()
        qtbot.waitUntil(lambda: w.client.model_info is not None, timeout=120_000)
        item = w.kernel_status
        total = len(kp._dispatchers("int8"))
        qtbot.waitUntil(item.isVisible, timeout=10_000)
        assert item.text() == f"Preparing fast CPU kernels: 0 of {total}"
        assert "first start only" in item.toolTip()
        assert item in w.statusBar().findChildren(type(item))
        assert not any("loaded" in text.lower() for text in said), said
        assert "loaded" not in w.model_status.text().lower()

        send(qtbot, w, "hello there")  # the model answers before any kernel is compiled
        wait_idle(qtbot, w)
        assert w.chat.view.last().text().strip()
        assert item.isVisible() and item.text() == f"Preparing fast CPU kernels: 0 of {total}"

        steps.release()
        qtbot.waitUntil(lambda: not item.isVisible(), timeout=300_000)
        assert kp.is_cached(kind)
        assert w.statusBar().currentMessage().startswith("Fast CPU kernels ready")
    finally:
        steps.release()
        close_window(w)


def test_no_kernel_item_on_a_start_whose_kernels_are_compiled(qtbot, tmp_path, llama_dir, monkeypatch):
    from engine import Engine

    Engine.load(llama_dir, mode="dense", cpu_weights="int8")
    kp.mark_cached(kp.kind_of("dense", "int8"))
    monkeypatch.setenv("THERMOCLINE_KERNELS", "background")
    w = make_window(qtbot, tmp_path, llama_dir, monkeypatch=monkeypatch)
    try:
        qtbot.wait(200)
        assert not w.kernel_status.isVisible() and w.client.engine.kernel_preparation is None
    finally:
        close_window(w)


# A machine where a dense preparation completed (`generate`, a dense chat) and the window's own
# (hybrid: sparse, int8) did not; what the splash compiled before the window showed.
PRELOAD_CHILD = """
import json
from engine.runtime import kernel_preparation as kp
kp.mark_cached(kp.kind_of("dense", "int8"))
from app.gui.main import preload_engine
preload_engine()
from numba.core.dispatcher import Dispatcher
from engine.kernels import cpu_numba
print(json.dumps(sorted(n for n, v in vars(cpu_numba).items() if isinstance(v, Dispatcher) and v.overloads)))
"""


def test_the_splash_compiles_no_kernel_when_the_windows_kind_was_never_prepared(tmp_path):
    """The splash loads the kernels only where the preparation of the kernels it loads (sparse
    int8: `cpu.warmup`'s) completed; another kind's stamp is no reason to compile them there,
    minutes before the window shows."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "THERMOCLINE_KERNELS": "background"}
    out = subprocess.run([sys.executable, "-c", PRELOAD_CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
