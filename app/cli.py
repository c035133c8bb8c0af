"""The `thermocline` command line.

Each subcommand lives in `app/commands/<name>.py` and exposes `register(subparsers)`,
which adds its parser and sets `handler=` to a function taking the parsed args and
returning an exit code. With no subcommand the window opens.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

from engine.errors import UserError

# Module names under app.commands, in the order `--help` lists them.
COMMANDS = ("chat", "generate", "place", "profile", "train_predictors", "eval", "models", "hw",
            "serve")


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one `error:` line with exit code 2."""

    def error(self, message: str):
        sys.stderr.write(f"error: {self.prog}: {message} (see --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="thermocline", description="Local chat with sparse LLMs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    subparsers = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"app.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"app.commands.{name}":
                continue  # not built yet
            raise
        module.register(subparsers)
    return parser


def has_display() -> bool:
    """A window can open: always on Windows/macOS, with X11 or Wayland (or a Qt platform) on Linux."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.environ.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))


def _window() -> int:
    """The window; where its X11 libraries are missing, what to install, then the terminal
    chat where there is a terminal (the one place that decides the fallback)."""
    from app.gui.main import explain_missing_libraries, missing_window_libraries, run_window

    missing = missing_window_libraries()
    if not missing:
        return run_window()
    code = explain_missing_libraries(missing)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return code
    print("Starting the terminal chat instead…", file=sys.stderr)
    return main(["chat"])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            if not has_display():
                sys.stderr.write("no display found: starting the terminal chat (`thermocline chat`)\n")
                return main(["chat"])
            return _window()
        return int(args.handler(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"error: {one_line(str(exc))}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug or not is_disk_full(exc):
            raise
        # Downloads, profiles and predictor training keep what they finished: a rerun resumes.
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        sys.stderr.write(f"error: the disk is full{where}; free some space and run the same command "
                         "again: work already done is kept and resumes\n")
        return 2


MAX_ERROR_CHARS = 500


def one_line(message: str) -> str:
    """An error message as one short line: a message that quotes hostile input (a 200 MB
    string from a tokenizer.json, a library's many-line text) is cut, never echoed whole."""
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS - 30] + " … (message cut)"


_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# Libraries that write through their own I/O (safetensors' Rust writer, SQLite) report a full
# disk in their own exception types; their messages carry the OS's words.
_DISK_FULL_WORDS = ("no space left on device", "os error 28", "database or disk is full", "disk quota exceeded")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it came from) is the disk running out of space."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return True
        if any(word in str(exc).lower() for word in _DISK_FULL_WORDS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


if __name__ == "__main__":
    raise SystemExit(main())
