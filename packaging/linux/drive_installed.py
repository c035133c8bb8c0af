"""Drive the *installed* Thermocline under Xvfb from outside, like a user (run by
packaging/test_linux.sh; needs only the standard library, xdotool and ImageMagick's `import`).

Starts the app with the Exec line of its menu entry, as the given user, then measures:
- `window_s`: launch -> the main window is mapped;
- `ready_s`: launch -> the model is loaded (the first Enter that the app accepts: while the
  model loads, the input box keeps the text and ignores Enter);
- then checks that an answer streams (the assistant message grows in the app's database over
  several polls and ends `complete`), saves screenshots, and quits the app.
Prints one JSON object on stdout.

    python3 drive_installed.py --user U --home H --display :N --out DIR [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

DESKTOP = Path("/usr/share/applications/thermocline.desktop")


def sh(*args: str, check: bool = False, env: dict | None = None) -> str:
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if check and r.returncode:
        raise RuntimeError(f"{args}: {r.stderr.strip()}")
    return r.stdout.strip()


class X:
    def __init__(self, display: str):
        self.env = dict(os.environ, DISPLAY=display)
        self.display = display

    def run(self, *args: str) -> str:
        return sh(*args, env=self.env)

    def windows(self) -> list[tuple[int, str, int, int]]:
        """Visible top-level windows of the app: (id, title, width, height)."""
        out = []
        for wid in self.run("xdotool", "search", "--onlyvisible", "--classname", "thermocline").split():
            geo = self.run("xdotool", "getwindowgeometry", wid)
            m = re.search(r"Geometry: (\d+)x(\d+)", geo)
            title = self.run("xdotool", "getwindowname", wid)
            if m:
                out.append((int(wid), title, int(m.group(1)), int(m.group(2))))
        return out

    def main_window(self) -> int | None:
        """The largest window titled "Thermocline" or "<conversation> — Thermocline" (not the
        splash, which is small; not the welcome dialog, which is smaller than the window)."""
        found = [(w * h, wid) for wid, title, w, h in self.windows()
                 if w >= 500 and h >= 300 and (title == "Thermocline" or title.endswith("Thermocline"))
                 and not title.startswith("Welcome")]
        return max(found)[1] if found else None

    def dialog(self, title: str) -> int | None:
        """A window titled `title` (Qt may append " — Thermocline")."""
        for wid, t, _w, _h in self.windows():
            if t == title or t.startswith(title + " "):
                return wid
        return None

    def key(self, wid: int, *keys: str) -> None:
        self.run("xdotool", "windowfocus", "--sync", str(wid))
        self.run("xdotool", "key", "--clearmodifiers", *keys)

    def type(self, wid: int, text: str) -> None:
        self.run("xdotool", "windowfocus", "--sync", str(wid))
        self.run("xdotool", "type", "--delay", "20", text)

    def click(self, wid: int, x: int, y: int) -> None:
        self.run("xdotool", "mousemove", "--window", str(wid), str(x), str(y), "click", "1")

    def geometry(self, wid: int) -> tuple[int, int]:
        m = re.search(r"Geometry: (\d+)x(\d+)", self.run("xdotool", "getwindowgeometry", str(wid)))
        return (int(m.group(1)), int(m.group(2))) if m else (1280, 800)

    def screenshot(self, path: Path) -> None:
        self.run("import", "-display", self.display, "-window", "root", str(path))


def messages(db: Path) -> list[tuple[str, str, str]]:
    if not db.exists():
        return []
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)
        try:
            return con.execute("SELECT role, content, status FROM messages ORDER BY id").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return []


def launch(user: str, home: Path, display: str, log: Path) -> subprocess.Popen:
    exec_line = next(line.split("=", 1)[1] for line in DESKTOP.read_text().splitlines()
                     if line.startswith("Exec="))
    argv = [a for a in shlex.split(exec_line) if not a.startswith("%")]
    env = {"HOME": str(home), "USER": user, "LOGNAME": user, "DISPLAY": display, "PATH": "/usr/bin:/bin",
           "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": str(home / ".runtime")}
    (home / ".runtime").mkdir(mode=0o700, exist_ok=True)
    sh("chown", f"{user}:{user}", str(home / ".runtime"))
    cmd = ["runuser", "-u", user, "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()], *argv]
    # From the home folder, as a menu launcher starts it (not from this checkout, whose sources
    # relative paths could resolve to).
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=home)


def stop(proc: subprocess.Popen, x: X, wid: int | None) -> str:
    """Close the window like a user would (WM_DELETE via the window's close), else SIGTERM."""
    if wid is not None:
        x.key(wid, "alt+F4")  # no window manager here: Qt ignores it; kept for a WM session
    try:
        proc.wait(timeout=3)
        return "closed"
    except subprocess.TimeoutExpired:
        pass
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
        return "terminated"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "killed"


def run_once(args, tag: str, x: X, db: Path, first: bool) -> dict:
    res: dict = {"run": tag}
    log = args.out / f"app-{tag}.log"
    before = len(messages(db))
    t0 = time.monotonic()
    proc = launch(args.user, args.home, args.display, log)
    wid = None
    deadline = t0 + args.timeout
    while time.monotonic() < deadline and proc.poll() is None:
        wid = x.main_window()
        if wid:
            break
        time.sleep(0.1)
    if not wid:
        res["error"] = f"no main window within {args.timeout} s (exit code {proc.poll()}); see {log}"
        stop(proc, x, None)
        return res
    res["window_s"] = round(time.monotonic() - t0, 2)
    time.sleep(1.0)  # the first paint
    x.screenshot(args.out / f"{tag}-1-window.png")

    if first:  # the first-start welcome dialog
        end = time.monotonic() + 15
        dlg = None
        while time.monotonic() < end and not dlg:
            dlg = x.dialog("Welcome")
            time.sleep(0.2)
        res["welcome_dialog"] = bool(dlg)
        if dlg:
            x.screenshot(args.out / f"{tag}-2-welcome.png")
            for key in ("Return", "Escape"):  # "Start chatting", else close it
                x.key(dlg, key)
                time.sleep(0.7)
                if not x.dialog("Welcome"):
                    break
            res["welcome_closed"] = not x.dialog("Welcome")

    # The prompt box spans the bottom of the chat column (left of the budgets panel).
    w, h = x.geometry(wid)
    x.click(wid, int(w * 0.4), h - 50)
    time.sleep(0.3)
    x.type(wid, args.prompt)
    # Enter until the app takes the prompt (it keeps the text and ignores Enter while the model
    # loads); from the first Enter on, the database is polled every 20 ms so that the answer's
    # growth is seen even when a small model writes it in a fraction of a second.
    lengths, status, text = [], "", ""
    accepted_at = None
    shot_mid = False
    next_enter = 0.0
    while time.monotonic() < deadline and proc.poll() is None:
        now = time.monotonic()
        if accepted_at is None and now >= next_enter:
            x.key(wid, "Return")
            next_enter = time.monotonic() + 0.3
        rows = messages(db)[before:]
        if accepted_at is None and any(r == "user" and c.strip() == args.prompt for r, c, _s in rows):
            accepted_at = time.monotonic()
        answers = [m for m in rows if m[0] == "assistant"]
        if accepted_at is not None and answers:
            _r, text, status = answers[-1]
            if not lengths or len(text) != lengths[-1]:
                lengths.append(len(text))
            if status == "streaming" and text and not shot_mid:
                x.screenshot(args.out / f"{tag}-3-streaming.png")
                shot_mid = True
            if status != "streaming":
                break
        time.sleep(0.02)
    if accepted_at is None:
        res["error"] = f"the prompt was never accepted within {args.timeout} s; see {log}"
        x.screenshot(args.out / f"{tag}-error.png")
        stop(proc, x, wid)
        return res
    res["ready_s"] = round(accepted_at - t0, 2)
    res["answer_status"] = status
    res["answer_chars"] = len(text)
    res["answer_head"] = text[:200]
    res["distinct_lengths_seen"] = len(lengths)
    res["answered"] = status == "complete" and len(text) > 0
    # Seen part-written: the answer grew in front of us (a short answer of a fast model can
    # be written between two polls, so the test asks this of at least one run, not each).
    res["streamed"] = len([n for n in lengths if n > 0]) >= 2
    res["answer_s"] = round(time.monotonic() - t0, 2)
    time.sleep(0.5)
    x.screenshot(args.out / f"{tag}-4-answer.png")
    res["exit"] = stop(proc, x, wid)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--user", required=True)
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--display", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", default="Tell me a short story about a fox.")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    x = X(args.display)
    db = args.home / ".local" / "share" / "Thermocline" / "conversations.db"
    results = []
    for i in range(args.runs):
        tag = "first" if i == 0 else f"again{i}"
        r = run_once(args, tag, x, db, first=i == 0)
        results.append(r)
        print(json.dumps(r), file=sys.stderr)
        if "error" in r:
            break
    ok = (len(results) == args.runs and all("error" not in r and r.get("answered") for r in results)
          and any(r.get("streamed") for r in results))
    print(json.dumps({"ok": ok, "runs": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
