"""Paths that come from outside (a Hub listing, a shard index, a catalogue) stay in their folder.

A name from outside is a relative POSIX path: no absolute path, no drive, no backslash, no
`..`, no empty or control-character part. `confined(root, name)` also resolves symlinks
already on disk and checks the result is still under `root`, so a link planted inside the
folder cannot lead out of it either. Callers check every name before writing anything.
Torch-free: the model registry uses it too.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from engine.errors import UserError


class PathEscapeError(UserError):
    """A file name from outside would land outside its folder."""


def check_relative_name(name: object, what: str) -> PurePosixPath:
    """`name` as a clean relative POSIX path, or PathEscapeError naming `what` it came from."""
    if not isinstance(name, str) or not name:
        raise PathEscapeError(f"{what} names a file {name!r} that is not a file name; refusing it")
    bad = (name.startswith(("/", "\\")) or "\\" in name or (len(name) > 1 and name[1] == ":")
           or any(ord(c) < 32 for c in name))
    parts = PurePosixPath(name).parts
    if bad or not parts or any(p in ("..", ".", "") for p in name.split("/")):
        raise PathEscapeError(
            f"{what} names the file {name!r}, which would land outside its folder; refusing it")
    return PurePosixPath(name)


def confined(root: Path, name: object, what: str) -> Path:
    """`root / name`, refused when `name` (or a symlink on the way) leads out of `root`."""
    rel = check_relative_name(name, what)
    root = Path(root)
    target = root.joinpath(*rel.parts)
    real_root = root.resolve()
    real = target.resolve()  # follows links already on disk; missing tails resolve lexically
    if real != real_root and real_root not in real.parents:
        raise PathEscapeError(f"{what} names the file {name!r}, which leads outside {root}; refusing it")
    return target
