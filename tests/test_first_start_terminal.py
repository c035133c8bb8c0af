"""The terminal on a first start (no CPU kernels compiled for this machine): `generate` and
the terminal chat answer at once, say that the fast kernels are being prepared and how far,
and the chat says when they are all in. In process: an engine left preparing holds back no
other test's engine."""

from __future__ import annotations

import io
import threading

import pytest

from app.cli import main
from app.kernel_words import READY_LINE, preparing_line
from engine import Engine
from engine.kernels import cpu_numba
from engine.runtime import kernel_preparation as kp
from kernel_steps import HeldSteps, forget_preparation
from models_registry.resolve import demo_model_dir

pytestmark = pytest.mark.skipif(not cpu_numba.HAS_AVX2, reason="the fused decode runs on AVX2 hosts")


def compiled_once(mode: str) -> int:
    """The kernels of `mode` compiled in this process (the held steps then take no time)."""
    Engine.load(demo_model_dir(), mode=mode, cpu_weights="int8")
    from engine.runtime.engine import _KernelWarmup

    _KernelWarmup.run_all(mode, "int8")
    return len(kp._dispatchers("int8"))


def wait_prepared(kind: str) -> None:
    for _ in range(6000):
        if kp.is_cached(kind):
            return
        threading.Event().wait(0.1)
    raise AssertionError(f"the background preparation of {kind} did not finish")


def test_generate_answers_at_once_and_says_the_kernels_are_being_prepared(monkeypatch, capsys):
    total = compiled_once("dense")
    kind = kp.kind_of("dense", "int8")
    forget_preparation(kind)
    monkeypatch.setenv("THERMOCLINE_KERNELS", "background")
    steps = HeldSteps(monkeypatch)
    try:
        code = main(["generate", "--model", "demo", "--prompt", "It is a truth", "--max-new-tokens", "4",
                     "--temperature", "0"])
        out, err = capsys.readouterr()
        assert code == 0 and out.strip()  # the answer came while nothing was compiled
        assert f"({preparing_line(0, total)}; answers come meanwhile, more slowly)" in err.splitlines()
        assert f"({preparing_line(0, total)})" in err.splitlines()  # still preparing after the answer
    finally:
        steps.release()
    wait_prepared(kind)
    code = main(["generate", "--model", "demo", "--prompt", "It is a truth", "--max-new-tokens", "2",
                 "--temperature", "0"])
    assert code == 0 and "preparing fast CPU kernels" not in capsys.readouterr().err  # the second start


def test_terminal_chat_says_how_far_the_kernels_are_and_when_they_are_in(tmp_path, monkeypatch, capsys):
    total = compiled_once("sparse")
    kind = kp.kind_of("sparse", "int8")
    forget_preparation(kind)
    monkeypatch.setenv("THERMOCLINE_KERNELS", "background")
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("THERMOCLINE_DATA_DIR", str(tmp_path / "data"))
    steps = HeldSteps(monkeypatch)

    class Person(io.StringIO):
        """Types a line; before the second, lets the kernels compile and waits for them."""

        def __init__(self):
            super().__init__()
            self.lines = ["It is a truth\n", "universally acknowledged\n", "/quit\n"]

        def readline(self, *_args):
            if len(self.lines) == 2:
                steps.release()
                wait_prepared(kind)
            return self.lines.pop(0)

    monkeypatch.setattr("sys.stdin", Person())
    try:
        code = main(["chat", "--model", "demo", "--mode", "sparse", "--no-save", "--max-new-tokens", "4",
                     "--temperature", "0"])
    finally:
        steps.release()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert code == 0
    first = lines.index(f"({preparing_line(0, total)}; answers come meanwhile, more slowly)")
    answers = [i for i, line in enumerate(lines) if "first word after" in line]
    assert len(answers) == 2 and first < answers[0]
    assert lines[answers[0] + 1] == f"({preparing_line(0, total)})"  # the first answer came meanwhile
    assert lines[answers[1] + 1] == f"({READY_LINE})"


def test_serve_answers_on_a_first_start_and_says_when_the_kernels_are_in():
    """`thermocline serve` on a first start answers while the kernels are prepared, and says so
    in its log. It used to wait for them at the first request: the demo's first 8 streamed
    requests got their first token after 100 s on a 2-core host, with nothing said."""
    import os
    import subprocess
    import sys
    import time

    import openai

    compiled_once("dense")  # in numba's cache: the preparation loads them, in seconds
    kind = kp.kind_of("dense", "int8")
    forget_preparation(kind)
    env = {**os.environ, "THERMOCLINE_API_KEY": "", "THERMOCLINE_KERNELS": "background"}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model", "demo", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        first = proc.stderr.readline()
        assert " at http://127.0.0.1:" in first, first
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        reader.start()
        client = openai.OpenAI(base_url=first.split(" at ")[1].split()[0], api_key="unused", max_retries=0,
                               timeout=120)
        resp = client.completions.create(model="demo", prompt="It is a truth", max_tokens=3, temperature=0)
        assert resp.usage.completion_tokens >= 1
        deadline = time.monotonic() + 60
        while len(lines) < 2 and time.monotonic() < deadline:  # the note, and the request's log line
            time.sleep(0.1)
        assert lines and lines[0].startswith("preparing fast CPU kernels for this machine, first start only: ")
        assert lines[0].endswith("; requests are answered meanwhile, more slowly\n")
        deadline = time.monotonic() + 600
        while READY_LINE + "\n" not in lines and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    assert READY_LINE + "\n" in lines
    wait_prepared(kind)
