"""First start against second start, as a new user meets them: seconds from the process start to
the first answer of the README's first command (`thermocline`, which with no display starts the
terminal chat on the demo model), and to a usable window (under Xvfb, when xvfb-run is here).

first start: numba's kernel cache is an empty folder (NUMBA_CACHE_DIR, `rm -rf` before the
round), so the CPU kernels compile in the background while the chat answers on the torch paths.
The session stays open until the preparation is stamped complete (`kernels_ready_s`), as a
person would keep chatting. second start: the same cache, now complete. window: the real
window (app.gui.main) on an empty cache, then again on the complete one: `shown_s` (the window
is on screen), `model_ready_s` (the model is loaded and takes a message), `first_token_s` (the
first word of the answer to a typed message). Each start is a fresh process; figures are from
one run, with the load average beside them.

    python -m bench.first_start [--rounds N] [--ready-timeout S] [--no-window] [--smoke]

--smoke (the suite's): each first start alone, with no wait for the background compile. The
second starts then meet a half-built cache, which measures nothing, so they are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "It is a truth universally acknowledged"
STAMP = "thermocline-kernels-sparse-int8.json"  # the window's and the chat's default: hybrid, int8

WINDOW_CHILD = """
import json, os, sys, time
start = float(sys.argv[1])
from PySide6.QtCore import QTimer, Qt
from PySide6.QtTest import QTest
from app.gui.main import make_application, preload_engine, build_window
app = make_application()
preload_engine()
window = build_window(show_welcome=False)
window.resize(1280, 800)
window.show()
app.processEvents()
marks = {"shown_s": time.time() - start}
def first_token(*_args):
    if "first_token_s" not in marks:
        marks["first_token_s"] = time.time() - start
        prep = getattr(window.client.engine, "kernel_preparation", None)
        marks["kernels_preparing_at_answer"] = prep is not None
        marks["kernel_item"] = window.kernel_status.text() if window.kernel_status.isVisible() else None
        print(json.dumps(marks), flush=True)
        os._exit(0)
window.client.token.connect(first_token)
def poll():
    if window.client.model_info is None:
        return
    timer.stop()
    marks["model_ready_s"] = time.time() - start
    marks["status_text"] = window.model_status.text()
    edit = window.chat.input.edit
    edit.setFocus()
    QTest.keyClicks(edit, sys.argv[2])
    QTest.keyClick(edit, Qt.Key.Key_Return)
timer = QTimer()
timer.timeout.connect(poll)
timer.start(20)
window.start()
app.exec()
"""


def child_env(home: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM",
                                                            "THERMOCLINE_KERNELS", "PYTHONDONTWRITEBYTECODE")}
    env.update(PYTHONPATH=str(ROOT), NUMBA_CACHE_DIR=str(cache), HOME=str(home),
               THERMOCLINE_CONFIG_DIR=str(home / "config"), THERMOCLINE_DATA_DIR=str(home / "data"),
               XDG_CACHE_HOME=str(home / "cache"))
    return env


def stamped(cache: Path) -> bool:
    return any(cache.rglob(STAMP))


def terminal_start(home: Path, cache: Path, ready_timeout: float) -> dict:
    """`thermocline` with no display: the terminal chat; one message, its answer, and (first
    start) the session kept open until the background preparation is complete."""
    empty = not stamped(cache)
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli"], cwd=ROOT, env=child_env(home, cache),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    out, marks, sent = b"", {}, False
    deadline = start + 1800
    while time.time() < deadline:
        if not sel.select(timeout=1.0):
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        out += chunk
        now = time.time() - start
        if not sent and b"you> " in out:
            marks["prompt_s"] = now
            proc.stdin.write((PROMPT + "\n").encode())
            proc.stdin.flush()
            sent = True
        if sent and "first_token_s" not in marks:
            tail = out.split(b"bot> ", 1)
            if len(tail) == 2 and tail[1].strip(b" "):
                marks["first_token_s"] = now
        if b"first word after" in out:
            marks["answer_done_s"] = now
            break
    text = out.decode("utf-8", "replace")
    if "answer_done_s" not in marks:
        proc.kill()
        raise SystemExit(f"error: the terminal chat gave no answer:\n{text[-2000:]}\n{proc.stderr.read().decode()[-2000:]}")
    marks["kernel_line"] = next((ln.strip() for ln in text.splitlines() if "fast CPU kernels" in ln), None)
    if empty:
        ready_by = time.time() + ready_timeout
        while not stamped(cache) and time.time() < ready_by and proc.poll() is None:
            time.sleep(0.5)
        marks["kernels_ready_s"] = round(time.time() - start, 2) if stamped(cache) else None
    proc.stdin.write(b"/quit\n")
    proc.stdin.flush()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    return {"empty_cache": empty, **{k: round(v, 2) if isinstance(v, float) else v for k, v in marks.items()}}


def window_start(home: Path, cache: Path) -> dict:
    empty = not stamped(cache)
    env = child_env(home, cache)
    start = time.time()
    out = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1280x800x24", sys.executable, "-c", WINDOW_CHILD,
                          repr(start), PROMPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"error: the window gave no answer:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    report = json.loads(lines[-1])
    return {"empty_cache": empty, **{k: round(v, 2) if isinstance(v, float) else v for k, v in report.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ready-timeout", type=float, default=1800,
                        help="seconds a first start's session stays open for the background compile")
    parser.add_argument("--no-window", action="store_true", help="leave out the window's starts")
    parser.add_argument("--smoke", action="store_true",
                        help="the first starts only, not waiting for the compile (--ready-timeout 0)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.ready_timeout = 0
    window = not args.no_window and shutil.which("xvfb-run") is not None
    scratch = Path(tempfile.mkdtemp(prefix="thermocline-first-start-"))
    rounds = []
    try:
        for r in range(args.rounds):
            home, cache = scratch / f"home{r}", scratch / f"numba{r}"
            shutil.rmtree(cache, ignore_errors=True)  # the empty kernel cache of a fresh machine
            cache.mkdir(parents=True)
            one = {"load_avg_before": os.getloadavg()}
            one["terminal_first"] = terminal_start(home, cache, args.ready_timeout)
            if not args.smoke:
                one["terminal_second"] = terminal_start(home, cache, args.ready_timeout)
            if window:
                wcache = scratch / f"numba-window{r}"
                wcache.mkdir(parents=True)
                one["window_first"] = window_start(home, wcache)
                if not args.smoke:
                    one["window_second"] = window_start(home, cache)  # the cache the terminal completed
            one["load_avg_after"] = os.getloadavg()
            rounds.append(one)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps({"cpus": os.cpu_count(), "rounds": rounds,
                      "window": "measured" if window else "left out (--no-window, or no xvfb-run)"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
