"""Which torch this Thermocline runs on: CPU or CUDA build, and whether a GPU is usable.

`torch_build()` is what the window shows (e.g. in the About box or the status bar) and what
a bug report should include. It never initialises CUDA beyond `torch.cuda.is_available()`
and never imports triton.

Installers come in two flavours (see packaging/README.md): `cpu` (everyone, small) and `cuda`
(NVIDIA GPUs). A CPU build on a machine with an NVIDIA GPU reports `gpu_present=True` with
`gpu_visible=False`, so the app can suggest the GPU installer.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch


@functools.cache
def bundle_info() -> dict | None:
    """The installer's build record (flavour, version, commit) in a frozen bundle, else None."""
    base = getattr(sys, "_MEIPASS", None)
    if not getattr(sys, "frozen", False) or base is None:
        return None
    try:
        return json.loads((Path(base) / "thermocline_build.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _nvidia_gpus() -> list[str]:
    """Names of NVIDIA GPUs the driver reports (NVML), whatever torch was built for."""
    try:
        import pynvml  # nvidia-ml-py; missing or no driver: no NVIDIA GPU to offer
    except Exception:  # noqa: BLE001
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / no library
        return []
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names
    except Exception:  # noqa: BLE001
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def torch_build() -> dict:
    """{"torch": "2.13.0+cpu", "cuda": "12.6" | None, "flavour": "cpu" | "cuda",
    "gpu_visible": bool (torch can use a CUDA device), "gpu_name": str | None,
    "gpu_present": bool (the driver reports an NVIDIA GPU, even if this build cannot use it),
    "frozen": bool (running from an installer's bundle), "bundle": {...} | None,
    "summary": one line for the UI}"""
    cuda = torch.version.cuda
    flavour = "cuda" if cuda else "cpu"
    visible = bool(cuda) and torch.cuda.is_available()
    gpu_name = torch.cuda.get_device_name(0) if visible else None
    nvidia = [] if visible else _nvidia_gpus()
    present = visible or bool(nvidia)
    if visible:
        summary = f"GPU build (torch {torch.__version__}, CUDA {cuda}) on {gpu_name}"
    elif cuda:
        summary = f"GPU build (torch {torch.__version__}, CUDA {cuda}), but no usable GPU: running on the CPU"
    elif present:
        summary = (f"CPU build (torch {torch.__version__}); an NVIDIA GPU ({nvidia[0]}) is present: "
                   "install the GPU version of Thermocline to use it")
    else:
        summary = f"CPU build (torch {torch.__version__})"
    return {
        "torch": torch.__version__,
        "cuda": cuda,
        "flavour": flavour,
        "gpu_visible": visible,
        "gpu_name": gpu_name or (nvidia[0] if nvidia else None),
        "gpu_present": present,
        "frozen": bool(getattr(sys, "frozen", False)),
        "bundle": bundle_info(),
        "summary": summary,
    }


if __name__ == "__main__":
    print(json.dumps(torch_build(), indent=1))
