"""The models a window lists, as plain rows: state on disk, fit on this machine, the speed it
would answer at, and the one chat model to recommend here.

Every verdict comes from one estimate (`fit.estimate_fit` on the model's config, before the
download for catalogue entries, which carry theirs), so a verdict and its reason never
disagree; a model whose config is not known yet gets a rough verdict from its download size,
worded against the same usable RAM. The recommended model follows the machine: the most
capable chat model that fits and answers at a readable pace here (`speed`).
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.budget_policy import usable_ram
from engine.units import format_size

from .catalogue import load_catalogue, recommended_entry
from .fit import VERDICT_FITS, VERDICT_HYBRID, VERDICT_NO, BytesModel, estimate_fit
from .hardware import cpu_feature_words, probe_hardware
from .resolve import demo_model_dir, downloaded_model_dir, is_ready
from .speed import READABLE_WORDS_PER_S, measured_reason, read_bandwidth, speed_words, words_per_second
from .state import read_state


def rough_fit(size_bytes: int | None, hw) -> tuple[str, str]:
    """A verdict from the download size alone, for models whose config we do not have yet."""
    if not size_bytes:
        return "fit unknown", "fit is estimated once the size is known"
    vram = hw.usable_vram_free
    if size_bytes <= vram * 0.85:
        return VERDICT_FITS, "estimate from the download size"
    cold = max(0, size_bytes - vram) // 2  # cold neurons are stored as 8-bit rows in RAM
    room = usable_ram(hw.ram_available)
    if cold <= room:
        return VERDICT_HYBRID, "estimate from the download size"
    return VERDICT_NO, (f"needs about {format_size(cold)} of RAM; {format_size(room)} of the "
                        f"{format_size(hw.ram_available)} free can be used (the rest is left for the system)")


def _folder_size(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def _read_config(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def machine_words(hw) -> str:
    gpu = f"{hw.gpus[0].name} ({format_size(hw.gpus[0].vram_total)})" if hw.gpus else "no NVIDIA GPU"
    cpu = cpu_feature_words(hw.simd)
    return (f"This machine: {format_size(hw.ram_total)} RAM ({format_size(hw.ram_available)} free), {gpu}, "
            f"{hw.cpu_logical_cores or '?'} CPU threads" + (f", {cpu}" if cpu else ""))


CPU_FORMATS = ("int4", "int8", "fp32")  # 4-bit (llama.cpp's Q4_0 blocks), 8-bit rows, exact


def scan_models(custom: list[str], ctx: int, active: str = "", cpu_weights: str = "int8",
                weights_by_spec: dict[str, str] | None = None) -> dict:
    """Every model the page lists, with its state on disk, fit and speed on this machine, and
    `recommended`: the spec of the chat model to suggest here. Each model is sized in its own
    CPU weight format (`weights_by_spec`, else `cpu_weights`); `formats` says what each of
    the three would need in memory and how fast it would answer."""
    hw = probe_hardware()
    bandwidth = read_bandwidth()
    weights_by_spec = dict(weights_by_spec or {})
    rows = []
    seen = set()

    def row(spec: str, folder: Path, *, title: str, repo: str | None, entry=None, local: bool = False) -> dict:
        state = read_state(folder) or {}
        has_config = (folder / "config.json").is_file()
        if has_config and is_ready(folder):
            status = "ready"
        elif state.get("status") == "downloading" or (folder.exists() and not has_config and not local):
            status = "partial"
        else:
            status = "absent"
        size = state.get("size_bytes") or (entry.size_bytes if entry else None)  # the Hub's listing once known
        if status == "ready" and not size:
            size = _folder_size(folder)
        verdict, reason = rough_fit(size, hw)
        words_s, capability, formats = None, 0, {}
        chosen = weights_by_spec.get(spec, cpu_weights)
        chosen = chosen if chosen in CPU_FORMATS else "int8"
        config = (_read_config(folder) if has_config else None) or (entry.config if entry else None)
        if config:
            try:
                common = dict(ctx=ctx, model_dir=folder if has_config else None,
                              known_activation=entry.activation if entry else None,
                              sparsity=entry.sparsity if entry else None)
                est = estimate_fit(config, hardware=hw, bytes_model=BytesModel(cpu_weights=chosen), **common)
                # The other formats at the same VRAM and all the RAM that can be used (the suggestion
                # is the slow part: once per model).
                # Only for models on disk (where a format can be chosen): a scan lists every entry.
                room = max(est.ram_budget, usable_ram(hw.ram_available))
                estimates = {f: est if f == chosen else
                             estimate_fit(config, vram_budget=est.vram_budget, ram_budget=room,
                                          bytes_model=BytesModel(cpu_weights=f), **common)
                             for f in CPU_FORMATS} if status == "ready" else {}
            except Exception as exc:  # noqa: BLE001 - a model we cannot size is still listed
                verdict, reason = "unknown", str(exc)
            else:
                formats = {f: {"memory": e.ram_bytes + e.vram_bytes, "words_s": words_per_second(e, bandwidth),
                               "verdict": e.verdict} for f, e in estimates.items()}
                verdict, reason = est.verdict, measured_reason(est)
                sparsity = entry.sparsity if entry else None
                words_s = words_per_second(est, bandwidth)
                shape = est.shape
                # What a token computes with: a mixture's chosen experts, a sparse model's whole width.
                capability = est.total_params - (int(shape["n_ff"] * 3 * shape["expert_ff"] * shape["d"]
                                                     * shape["n_layers"] * (sparsity or 0)) if shape["expert_ff"] else 0)
        return {"spec": spec, "title": title, "repo": repo, "folder": str(folder), "status": status,
                "size": size, "license": entry.license if entry else "see the model card",
                "params": entry.params if entry else "", "sparsity": entry.sparsity if entry else None,
                "description": entry.description if entry else ("Local folder" if local else "Added by hand"),
                "verdict": verdict, "reason": reason, "custom": entry is None, "local": local,
                "downloadable": repo is not None, "chat": bool(entry and entry.chat),
                "words_s": words_s, "speed": speed_words(words_s) if words_s is not None else "",
                "capability": capability, "cpu_weights": chosen, "formats": formats}

    for entry in load_catalogue():
        folder = demo_model_dir() if entry.repo is None else downloaded_model_dir(entry.repo)
        rows.append(row(entry.id, folder, title=entry.id, repo=entry.repo, entry=entry))
        seen.update({entry.id.lower(), (entry.repo or "").lower()})
    from .remotes import list_remotes

    for remote in list_remotes():  # models served elsewhere (Add remote…, models add-remote)
        seen.add(remote.id.lower())
        rows.append({"spec": remote.id, "title": remote.id, "repo": None, "folder": remote.url, "status": "ready",
                     "size": None, "license": "see the server", "params": "", "sparsity": None,
                     "description": f"Runs elsewhere: {remote.model or 'the first model'} at {remote.url}",
                     "verdict": "runs elsewhere", "reason": "", "custom": True, "local": False,
                     "downloadable": False, "remote": True, "chat": False, "words_s": None, "speed": "",
                     "capability": 0})
    # The active model is listed even when it was chosen by path rather than added here.
    extra = custom + ([active] if active and Path(active).expanduser().is_absolute() else [])
    for spec in extra:
        if spec.lower() in seen:
            continue
        seen.add(spec.lower())
        path = Path(spec).expanduser()
        if path.is_absolute():
            rows.append(row(spec, path, title=path.name, repo=None, local=True))
        else:
            rows.append(row(spec, downloaded_model_dir(spec), title=spec, repo=spec))
    recommended = recommend(rows)
    for r in rows:
        if r["spec"] == recommended:
            r["title"] += " · recommended for this machine"
    return {"rows": rows, "machine": machine_words(hw), "recommended": recommended,
            "bandwidth": bandwidth}


def recommend(rows: list[dict]) -> str | None:
    """The most capable downloadable chat model that fits and writes at a readable pace here;
    if none is that fast, the fastest one that fits; else the catalogue's first download."""
    fits = [r for r in rows if r["chat"] and r["downloadable"] and r["words_s"] is not None
            and r["verdict"] in (VERDICT_FITS, VERDICT_HYBRID)]
    readable = [r for r in fits if r["words_s"] >= READABLE_WORDS_PER_S]
    if readable:
        return max(readable, key=lambda r: r["capability"])["spec"]
    if fits:
        return max(fits, key=lambda r: r["words_s"])["spec"]
    entry = recommended_entry()
    return entry.id if entry else None


def probe_for_model(model_spec: str, ctx: int) -> dict:
    """Hardware totals and the suggested budgets for a model (the budgets panel's probe)."""
    from models_registry.resolve import resolve_model

    hw = probe_hardware()
    out = {"ram_total": hw.ram_total, "ram_available": hw.ram_available,
           "vram_total": hw.gpus[0].vram_total if hw.gpus else 0,
           "gpu_name": hw.gpus[0].name if hw.gpus else "", "gpu_note": hw.gpu_note,
           "suggested_vram": None, "suggested_ram": None, "suggest_error": ""}
    try:
        folder = resolve_model(model_spec)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        trained = config.get("max_position_embeddings") or config.get("n_positions")
        if isinstance(trained, int) and trained > 0:
            out["trained_ctx"] = trained
            ctx = min(ctx, trained)
        est = estimate_fit(config, ctx=ctx, hardware=hw, model_dir=folder)
        out["suggested_vram"], out["suggested_ram"] = est.suggested_vram_budget, est.suggested_ram_budget
    except Exception as exc:  # noqa: BLE001 - no suggestion is fine; say why in the panel
        out["suggest_error"] = str(exc)
    return out
