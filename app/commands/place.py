"""`thermocline place`: the neuron placement for given budgets, without loading weights."""

from __future__ import annotations

import json

from engine.units import format_size

from .common import disk_speed_line, disk_words_per_s, size_arg


def register(subparsers) -> None:
    parser = subparsers.add_parser("place", help="show where neurons go for given VRAM and RAM budgets")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--vram-budget", type=size_arg, required=True, metavar="SIZE")
    parser.add_argument("--ram-budget", type=size_arg, required=True, metavar="SIZE")
    parser.add_argument("--ctx", type=int, default=None,
                        help="context length (default: the engine's, capped at the model's positions)")
    parser.add_argument("--device", default=None, help="fast device (default: cuda:0 if present, else the CPU)")
    parser.add_argument("--cpu-weights", default="int8", choices=("int4", "int8", "fp32"))
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from engine.arch import read_config
    from engine.hotcold.placement import solve
    from engine.hotcold.sparse_solve import pick_fast_device, problem_for_model
    from models_registry.resolve import resolve_model

    from engine.validation import check_ctx

    check_ctx(args.ctx, "--ctx")
    model_dir = resolve_model(args.model)
    config = read_config(model_dir)
    fast = pick_fast_device(args.device)
    problem = problem_for_model(model_dir, config, config.context_length(args.ctx), fast, args.cpu_weights)
    plan = solve(problem, args.vram_budget, args.ram_budget)
    summary = plan.summary()
    summary["min_ram_bytes_at_full_vram"] = solve(problem, 1 << 62, 1 << 62).ram_bytes
    summary["disk"]["words_per_s"] = disk_words_per_s(plan)
    if args.json:
        print(json.dumps(summary))
        return 0 if plan.fits else 2
    print(f"model {model_dir.name} · fast device {plan.device} · {plan.verdict}")
    print(f"VRAM {format_size(plan.vram_bytes)} of {format_size(args.vram_budget)} · "
          f"RAM {format_size(plan.ram_bytes)} of {format_size(args.ram_budget)} · "
          f"expected hot hit fraction {plan.hot_hit_fraction:.1%} · solved in {plan.solve_s * 1000:.1f} ms")
    for tier, size in plan.tier_bytes.items():
        print(f"  {tier:10s} {format_size(size)}")
    if plan.disk_neurons:
        print(f"  disk_ffn   {format_size(plan.disk_bytes)} in the prepared file · neuron cache "
              f"{plan.cache_neurons} neurons, expected hit {plan.expected_cache_hit:.1%} · "
              f"{disk_speed_line(plan)}")
    unit = summary.get("unit", "neurons")
    if unit == "experts":
        tiers = summary["experts_per_tier"]
        print(f"  experts    {tiers['fast']} on the fast device, {tiers['split']} split (hot neurons on it), "
              f"{tiers['cpu']} on the CPU")
    for layer in summary["layers"]:
        where = "fast" if layer["dense_on_fast"] else "cpu "
        experts = f"neurons, {layer['hot_experts']} whole experts " if unit == "experts" else ""
        print(f"  layer {layer['layer']:3d}  dense on {where}  hot {layer['hot_neurons']:6d} "
              f"{experts}({layer['hot_fraction']:.0%})")
    if not plan.fits:
        import sys

        sys.stderr.write(f"error: does not fit: the CPU side needs at least {format_size(plan.min_ram_bytes)} of RAM "
                         f"at this VRAM budget; raise --ram-budget\n")
        return 2
    return 0
