"""Which files of a folder being imported may be taken, and how they are brought in.

A folder the user imports is not trusted to stay inside itself: a symlink in it may point at
`/etc/passwd` or `/dev/zero`. `SourceFiles` resolves each file once and refuses a link whose
target leaves the source (for a Hugging Face cache snapshot, the source includes the repo's
`blobs/` folder that its relative links point into), and anything that is not a regular
file (FIFOs, devices, sockets). `bring_in` hard-links only a regular file that is the one name
of its inode inside the source (so the user's own copy is the only other name, and nothing
outside the source is ever shared), else copies exactly the size that was checked, reading
from a descriptor opened without blocking, so a FIFO swapped in meanwhile cannot hang it.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError
from engine.units import format_size

from .hardware import free_disk

COPY_CHUNK = 4 << 20


@dataclass(frozen=True)
class SourceFile:
    path: Path  # as found in the source folder (maybe a link)
    real: Path  # the regular file it is
    size: int
    linkable: bool  # the one name of its inode: a hard link shares nothing else


def _quoted(path: Path) -> str:
    text = str(path)
    return repr(text if len(text) <= 160 else text[:150] + "...")


class SourceFiles:
    """The roots a source folder's files may resolve into, and the checks of one file."""

    def __init__(self, src: Path):
        self.src = Path(src)
        real = self.src.resolve()
        self.roots = [real]
        if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
            self.roots.append((real.parent.parent / "blobs").resolve())  # a Hugging Face cache snapshot

    def check(self, path: Path) -> SourceFile:
        """`path` as a regular file inside the source, or UserError naming it."""
        path = Path(path)
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise UserError(f"{_quoted(path)} is a broken link; the model folder is incomplete") from None
        if not any(real == root or root in real.parents for root in self.roots):
            raise UserError(f"{_quoted(path)} is a link to {_quoted(real)}, outside the folder being "
                            "imported; refusing to import it (copy the file into the folder instead)")
        try:
            info = os.stat(real)
        except OSError as exc:
            raise UserError(f"cannot read {_quoted(path)}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{_quoted(path)} is not a regular file (a pipe, device or socket); "
                            "refusing to import it")
        return SourceFile(path, real, info.st_size, linkable=info.st_nlink == 1)


def check_space(files: list[SourceFile], target_root: Path) -> None:
    """Refuse before copying when the copies (files that cannot be hard-linked) will not fit."""
    try:
        dev = os.stat(target_root).st_dev
    except OSError:
        dev = None
    need = sum(f.size for f in files if not (f.linkable and os.stat(f.real).st_dev == dev))
    where, free = free_disk(target_root)
    if free is not None and need > free:
        raise UserError(f"not enough free disk to import: it needs {format_size(need)} and {where} has "
                        f"{format_size(free)} free; free some space or choose another models folder")


def bring_in(f: SourceFile, dst: Path) -> None:
    """Hard-link `f` (when it is its inode's one name and on this filesystem) or copy it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if f.linkable:
        try:
            os.link(f.real, dst, follow_symlinks=False)
            return
        except OSError:
            pass  # another filesystem, or links not allowed: copy
    _copy_exactly(f, dst)


def _copy_exactly(f: SourceFile, dst: Path) -> None:
    fd = os.open(f.real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != f.size:
            raise UserError(f"{_quoted(f.path)} changed while it was imported; run the import again")
        os.set_blocking(fd, True)
        left = f.size
        with os.fdopen(fd, "rb", closefd=False) as src, open(dst, "xb") as out:
            while left > 0:
                block = src.read(min(COPY_CHUNK, left))
                if not block:
                    raise UserError(f"{_quoted(f.path)} became shorter while it was imported; "
                                    "run the import again")
                out.write(block)
                left -= len(block)
        shutil.copystat(f.real, dst)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise UserError("the disk is full; free some space and run the import again") from None
        raise
    finally:
        os.close(fd)
