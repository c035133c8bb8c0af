"""One safetensors file written tensor by tensor, in a declared order, without a copy of the
whole: the prepared files (dense rows, MoE experts, the dense mode's model) are as big as the
model and are made while it loads.

The bytes go to `<name>.<pid>.partial` (two loads at once never share one), which `finish`
flushes to the disk and renames into place, so neither a killed load nor a power cut leaves a
file that a later load takes for a prepared one. A partial left by a process that no longer
runs is removed by the next writer of that file: each is as big as the model, and no other
code would ever remove it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

# dtype code -> (torch dtype, bytes per element); the prepared files hold only these
CODES = {"U8": (torch.uint8, 1), "I8": (torch.int8, 1), "F32": (torch.float32, 4)}
CODE_OF = {dtype: code for code, (dtype, _) in CODES.items()}
NUMPY = {"U8": np.uint8, "I8": np.int8, "F32": np.float32}


def remove_abandoned_partials(path: Path) -> None:
    """Delete the half-written files of `path` whose writer's pid no longer runs."""
    import psutil

    for tmp in path.parent.glob(f"{path.stem}.*.partial"):
        pid = tmp.suffixes[-2][1:] if len(tmp.suffixes) >= 2 else ""
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            tmp.unlink(missing_ok=True)


class StreamedSafetensors:
    """`entries` are (name, dtype code, shape) in file order; `write` takes them in that
    order and checks each tensor's dtype and shape against its entry, so the header written
    first is what the file holds."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]):
        header, offset = {"__metadata__": metadata}, 0
        for name, code, shape in entries:
            size = math.prod(shape) * CODES[code][1]
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path, self.entries, self.next, self.size = path, entries, 0, offset
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_partials(path)
        self.tmp = path.with_suffix(f".{os.getpid()}.partial")
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, t: torch.Tensor) -> None:
        if self.next >= len(self.entries):
            raise RuntimeError(f"{self.path.name}: {name} is beyond the declared tensors")
        want, code, shape = self.entries[self.next]
        if name != want or t.dtype != CODES[code][0] or tuple(t.shape) != tuple(shape):
            raise RuntimeError(f"{self.path.name}: {name} {t.dtype} {tuple(t.shape)} written where "
                               f"{want} {code} {tuple(shape)} was declared")
        self.f.write(memoryview(t.contiguous().numpy().reshape(-1).view(np.uint8)))
        self.next += 1

    def finish(self) -> Path:
        """Flush, rename into place and return the path; a file missing tensors is removed
        and raises RuntimeError (a load that stopped short keeps no model-sized partial)."""
        try:
            if self.next != len(self.entries):
                raise RuntimeError(f"{self.path.name} incomplete: {self.next} of {len(self.entries)} tensors written")
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            self.tmp.replace(self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)
