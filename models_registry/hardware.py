"""What this machine has: RAM, NVIDIA GPUs, CPU cores and SIMD features, free disk.

GPUs come from NVML (nvidia-ml-py); when NVML is missing, from torch.cuda but only if the
process has already imported torch (this package never imports it). No GPU is a normal
answer, not an error.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from .paths import models_dir

# SIMD features worth showing: they decide which CPU kernels are fast (see DESIGN.md).
SIMD_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
    "neon", "asimd", "asimdhp", "asimddp", "sve", "sve2",
)
# llvmlite spells some of them differently.
_LLVM_NAMES = {"sse4.2": "sse4_2", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
               "avx512fp16": "avx512_fp16", "avxvnni": "avx_vnni", "amx-tile": "amx_tile",
               "amx-bf16": "amx_bf16", "amx-int8": "amx_int8", "fullfp16": "asimdhp",
               "dotprod": "asimddp"}

# The same features in words, strongest first within each group: what a card says of the CPU.
_FEATURE_WORDS = (
    (("avx512f",), "AVX-512"),
    (("avx512_vnni", "avx_vnni"), "fast 8-bit dot products (VNNI)"),
    (("avx512_bf16",), "bfloat16 math"),
    (("avx512_fp16",), "half-precision math"),
    (("amx_int8", "amx_tile"), "AMX matrix units"),
    (("avx2",), "AVX2"),
    (("f16c",), "half-precision conversion"),
    (("sve2", "sve"), "SVE vectors"),
    (("asimddp",), "fast 8-bit dot products"),
    (("neon", "asimd"), "NEON vectors"),
)


def cpu_feature_words(simd: list[str]) -> str:
    """`AVX-512, fast 8-bit dot products (VNNI), AMX matrix units` rather than raw flags;
    AVX2 is named only when there is no AVX-512 (it implies it)."""
    have = set(simd)
    words = [text for flags, text in _FEATURE_WORDS if have & set(flags)]
    if "AVX-512" in words and "AVX2" in words:
        words.remove("AVX2")
    if not any(w in words for w in ("AVX-512", "AVX2", "SVE vectors", "NEON vectors")) and "avx" in have:
        words.insert(0, "AVX (no AVX2: the slow kernels)")
    return ", ".join(words)


@dataclass
class GpuInfo:
    index: int
    name: str
    vram_total: int
    vram_free: int
    driver: str | None
    source: str  # "nvml" | "torch"


@dataclass
class HardwareInfo:
    ram_total: int
    ram_available: int
    cpu_model: str
    cpu_physical_cores: int | None
    cpu_logical_cores: int | None
    simd: list[str]
    gpus: list[GpuInfo] = field(default_factory=list)
    gpu_note: str = ""
    disk_path: str = ""
    disk_free: int | None = None
    os: str = ""

    @property
    def usable_vram_free(self) -> int:
        """Free VRAM of the first GPU (the engine uses one device); 0 without a GPU."""
        return self.gpus[0].vram_free if self.gpus else 0

    def to_dict(self) -> dict:
        return asdict(self)


def _probe_nvml() -> tuple[list[GpuInfo], str]:
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no usable GPU
        return [], f"NVML unavailable ({exc})"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else str(name),
                                int(mem.total), int(mem.free), driver, "nvml"))
        return gpus, ""
    except Exception as exc:  # noqa: BLE001 - any NVML failure means no GPU figures, said in words
        return [], f"NVML query failed ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting NVML down is best effort
            pass


def _probe_torch() -> list[GpuInfo]:
    torch = sys.modules.get("torch")  # only if already imported: never pay torch's import here
    if torch is None or not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GpuInfo(i, torch.cuda.get_device_name(i), int(total), int(free),
                            getattr(torch.version, "cuda", None), "torch"))
    return gpus


def probe_gpus() -> tuple[list[GpuInfo], str]:
    """(GPUs, a note on why there are none or where they came from)."""
    gpus, note = _probe_nvml()
    if gpus:
        return gpus, ""
    gpus = _probe_torch()
    if gpus:
        return gpus, f"{note}; read from torch.cuda"
    return [], note or "no NVIDIA GPU"


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def _llvm_features() -> set[str]:
    try:
        from llvmlite import binding
    except ImportError:
        return set()
    try:
        raw = binding.get_host_cpu_features()
    except Exception:  # noqa: BLE001 - a broken llvmlite only means no feature list
        return set()
    return {_LLVM_NAMES.get(name, name.replace(".", "_")) for name, on in raw.items() if on}


def probe_cpu() -> tuple[str, list[str]]:
    model, flags = _cpuinfo()
    if not flags:
        flags = _llvm_features()  # Windows and macOS: no /proc/cpuinfo
    if platform.machine().lower() in ("aarch64", "arm64"):
        flags.add("neon")  # mandatory on 64-bit ARM
    model = model or platform.processor() or platform.machine()
    return model, [f for f in SIMD_FLAGS if f in flags]


def free_disk(path: Path) -> tuple[Path, int | None]:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        return probe, shutil.disk_usage(probe).free
    except OSError:
        return probe, None


def probe_hardware(models_path: Path | None = None) -> HardwareInfo:
    mem = psutil.virtual_memory()
    cpu_model, simd = probe_cpu()
    gpus, note = probe_gpus()
    target = Path(models_path) if models_path else models_dir()
    _, disk = free_disk(target)
    return HardwareInfo(
        ram_total=int(mem.total), ram_available=int(mem.available), cpu_model=cpu_model,
        cpu_physical_cores=psutil.cpu_count(logical=False), cpu_logical_cores=os.cpu_count(),
        simd=simd, gpus=gpus, gpu_note=note, disk_path=str(target), disk_free=disk,
        os=f"{platform.system()} {platform.release()}",
    )
