"""The hardware probe: memory, CPU features, GPUs (NVML, else an already-imported torch), disk."""

from __future__ import annotations

import sys
import types

from models_registry import hardware
from models_registry.hardware import SIMD_FLAGS, free_disk, probe_hardware


def test_probe_reports_this_machine(tmp_path):
    hw = probe_hardware(tmp_path / "not" / "yet" / "created")
    assert 0 < hw.ram_available <= hw.ram_total
    assert hw.cpu_logical_cores >= 1 and hw.cpu_model
    assert set(hw.simd) <= set(SIMD_FLAGS)
    assert hw.disk_free and hw.disk_free > 0  # measured at the nearest existing parent
    if not hw.gpus:
        assert hw.gpu_note and hw.usable_vram_free == 0
    assert hw.to_dict()["ram_total"] == hw.ram_total


def test_free_disk_walks_up_to_an_existing_folder(tmp_path):
    where, free = free_disk(tmp_path / "a" / "b")
    assert where == tmp_path and free > 0


def test_torch_fallback_only_uses_an_already_imported_torch(monkeypatch):
    monkeypatch.setattr(hardware, "_probe_nvml", lambda: ([], "NVML unavailable (test)"))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    gpus, note = hardware.probe_gpus()
    assert gpus == [] and "NVML unavailable" in note and "torch" not in sys.modules

    cuda = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1,
        mem_get_info=lambda i: (6 * 2**30, 8 * 2**30), get_device_name=lambda i: "Some GPU")
    fake_torch = types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda="12.4"))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    gpus, note = hardware.probe_gpus()
    found = [(g.name, g.vram_total, g.vram_free, g.source) for g in gpus]
    assert found == [("Some GPU", 8 * 2**30, 6 * 2**30, "torch")]
    assert "torch.cuda" in note
