"""`thermocline hw [--json]`: RAM, GPUs, CPU cores and SIMD features, free disk."""

from __future__ import annotations

import json

from engine.units import format_size


def register(subparsers) -> None:
    parser = subparsers.add_parser("hw", help="what this machine has for running models")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=cmd_hw)


def cmd_hw(args) -> int:
    from models_registry.hardware import probe_hardware

    hw = probe_hardware()
    if args.json:
        print(json.dumps(hw.to_dict(), indent=2))
        return 0
    print(f"RAM      {format_size(hw.ram_available)} available of {format_size(hw.ram_total)}")
    print(f"CPU      {hw.cpu_model}; {hw.cpu_physical_cores} cores, {hw.cpu_logical_cores} threads")
    print(f"SIMD     {' '.join(hw.simd) or 'none detected'}")
    if hw.gpus:
        for gpu in hw.gpus:
            print(f"GPU {gpu.index}    {gpu.name}: {format_size(gpu.vram_free)} free of "
                  f"{format_size(gpu.vram_total)}, driver {gpu.driver or '?'} (via {gpu.source})")
    else:
        print(f"GPU      none ({hw.gpu_note})")
    disk = format_size(hw.disk_free) if hw.disk_free is not None else "unknown"
    print(f"Disk     {disk} free at {hw.disk_path}")
    print(f"OS       {hw.os}")
    return 0
