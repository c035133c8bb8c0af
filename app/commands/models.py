"""`thermocline models list|download|remove|import|add-remote|verify|fit [--json]`: the models folder.

Downloads report progress on stderr (one redrawn line on a terminal, a line every few
seconds otherwise); Ctrl-C keeps the partial files and the next download resumes them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from engine.activations import NAMES as ACTIVATION_NAMES
from engine.errors import UserError
from engine.units import format_rate, format_size

from .common import size_arg


def register(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list, download, remove or import models")
    sub = parser.add_subparsers(dest="models_command", required=True, parser_class=type(parser))

    p = sub.add_parser("list", help="catalogue and downloaded models, with a fit estimate for this machine")
    p.add_argument("--ctx", type=int, default=2048, help="context length for the fit estimate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("download", help="download a catalogue model or any supported Hugging Face repo")
    p.add_argument("model", help="catalogue id (see `models list`) or org/name repo id")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: the catalogue's, else main)")
    p.add_argument("--no-predictors", action="store_true", help="skip the PowerInfer predictor repo")
    p.add_argument("--offline", action="store_true", default=None, help="no network: use what is downloaded")
    p.add_argument("--token", default=None, help="Hugging Face token for gated repos (default: HF_TOKEN or saved)")
    p.add_argument("--save-token", action="store_true", help="remember --token for later sessions")
    p.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(handler=cmd_download)

    p = sub.add_parser("remove", help="delete a downloaded or imported model")
    p.add_argument("model", help="catalogue id, org/name or local/<name>")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_remove)

    p = sub.add_parser("import", help="add a local model folder (Hugging Face layout) or a .gguf file (llama.cpp's "
                                      "or PowerInfer's) as local/<name>")
    p.add_argument("folder", help="model folder or .gguf file")
    p.add_argument("--activation", default=None, choices=ACTIVATION_NAMES,
                   help="a plain llama GGUF's activation (GGUFs do not record it; PowerInfer's files are relu)")
    p.add_argument("--name", default=None, help="name under local/ (default: the folder's name)")
    p.add_argument("--predictors", default=None, metavar="DIR", help="PowerInfer predictor folder (model_N.pt)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_import)

    p = sub.add_parser("add-remote", help="use a model on any OpenAI-compatible server as remote/NAME")
    p.add_argument("name", help="the name after remote/")
    p.add_argument("--url", required=True, help="the server's OpenAI API base, e.g. http://gpu-box:8000/v1")
    p.add_argument("--model", default=None, metavar="REMOTE_ID", help="the model id on that server "
                   "(default: the first it lists)")
    p.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable that holds the "
                   "API key (the key itself is never stored; without it the OS keyring is asked)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_add_remote)

    p = sub.add_parser("verify", help="re-check a downloaded model's files against the Hub's hashes")
    p.add_argument("model", help="catalogue id or org/name")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("fit", help="will a model fit this machine: bytes per part and a verdict")
    p.add_argument("model", help="catalogue id, repo id or model folder (need not be downloaded if catalogued)")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--vram-budget", type=size_arg, default=None, metavar="SIZE", help="default: suggested")
    p.add_argument("--ram-budget", type=size_arg, default=None, metavar="SIZE", help="default: suggested")
    p.add_argument("--cpu-weights", default="int8", choices=("int4", "int8", "fp32"),
                   help="format of the weights on the CPU tier (as generate/chat --cpu-weights)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_fit)


# -- list ------------------------------------------------------------------------------------
def cmd_list(args) -> int:
    from models_registry.hardware import probe_hardware
    from models_registry.manage import list_models
    from models_registry.paths import models_dir
    from models_registry.remotes import list_remotes

    from engine.validation import check_ctx

    check_ctx(args.ctx, "--ctx")
    listings = list_models(hardware=probe_hardware(), ctx=args.ctx)
    remotes = list_remotes()
    if args.json:
        print(json.dumps({"models_dir": str(models_dir()), "ctx": args.ctx,
                          "models": [m.to_dict() for m in listings],
                          "remotes": [r.to_dict() for r in remotes]}, indent=2))
        return 0
    print(f"models folder: {models_dir()}")
    for m in listings:
        size = format_size(m.size_bytes) if m.size_bytes else "?"
        fit = m.fit["verdict"] if m.fit else "-"
        kind = (m.entry or {}).get("kind_note", "")
        print(f"{m.id:24} {m.status:15} {size:>11}  {fit:30} {m.repo or '':40} {kind}".rstrip())
    for r in remotes:
        print(f"{r.id:24} {'remote':15} {'':>11}  {'runs elsewhere':30} {r.url} {r.model or ''}")
    return 0


def cmd_add_remote(args) -> int:
    from models_registry.remotes import add_remote

    remote = add_remote(args.name, args.url, args.model, args.api_key_env)
    if args.json:
        print(json.dumps(remote.to_dict()))
    else:
        print(f"added {remote.id} -> {remote.url}" + (f" (model {remote.model})" if remote.model else "")
              + (f", key from ${remote.api_key_env}" if remote.api_key_env else ""))
    return 0


# -- download --------------------------------------------------------------------------------
def _eta(seconds) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


class _Printer:
    """Download events -> stderr."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last = 0.0

    def __call__(self, ev) -> None:
        if ev.kind == "progress":
            now = time.monotonic()
            if not self.tty and now - self._last < 5.0:
                return
            self._last = now
            pct = 100.0 * ev.done / ev.total if ev.total else 100.0
            line = (f"{ev.repo} {pct:5.1f}% {format_size(ev.done)}/{format_size(ev.total)} "
                    f"{format_size(ev.speed_bps)}/s ETA {_eta(ev.eta_s)} {ev.filename}")
            self.stream.write("\r" + line + "\033[K" if self.tty else line + "\n")
        elif ev.kind in ("plan", "retry", "corrupt", "paused", "resumed", "predictors", "convert", "done"):
            prefix = "\n" if self.tty and ev.kind != "plan" else ""
            self.stream.write(f"{prefix}{ev.kind}: {ev.message or ev.filename or ''}\n")
        self.stream.flush()


def _predictor_importer():
    """engine.loading.predictor_import.import_powerinfer_predictors, or None while the engine lacks it."""
    try:
        from engine.loading.predictor_import import import_powerinfer_predictors
    except ModuleNotFoundError as exc:
        if exc.name != "engine.loading.predictors":
            raise
        return None
    except ImportError as exc:
        if "import_powerinfer_predictors" not in str(exc):
            raise
        return None
    return import_powerinfer_predictors


def _pickle_converter():
    """engine.loading.checkpoint_convert in this process (the registry would start a child process)."""
    from engine.loading.checkpoint_convert import convert_pytorch_checkpoint

    return convert_pytorch_checkpoint


def cmd_download(args) -> int:
    from models_registry.download import download_model
    from models_registry.token import save_token

    if args.save_token:
        if not args.token:
            raise UserError("--save-token needs --token")
        save_token(args.token)
    importer = None if args.no_predictors else _predictor_importer()
    try:
        result = download_model(args.model, revision=args.revision, endpoint=args.endpoint, token=args.token,
                                progress=_Printer(), offline=args.offline,
                                with_predictors=not args.no_predictors, on_predictors_downloaded=importer,
                                convert_pickles=_pickle_converter())
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted: partial files are kept; run the same command to resume\n")
        return 130
    if result.predictors == "downloaded" and importer is None:
        sys.stderr.write("warning: predictors downloaded but not imported: this engine has no "
                         "engine.loading.predictor_import.import_powerinfer_predictors\n")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"{result.repo} ready at {result.model_dir} (revision {result.revision[:12]}, "
              f"{format_size(result.bytes_total)}, predictors {result.predictors})")
    return 0


# -- remove / import -------------------------------------------------------------------------
def cmd_remove(args) -> int:
    from models_registry.manage import model_folder, remove_model
    from models_registry.remotes import is_remote, remove_remote

    if is_remote(args.model):  # only the entry goes; nothing of the server's is touched
        remote = remove_remote(args.model)
        print(json.dumps({"removed": remote.id}) if args.json else f"removed {remote.id}")
        return 0

    folder = model_folder(args.model)
    freed = remove_model(args.model)
    if args.json:
        print(json.dumps({"removed": str(folder), "bytes_freed": freed}))
    else:
        print(f"removed {folder} ({format_size(freed)} freed)")
    return 0


def cmd_import(args) -> int:
    from models_registry.manage import LOCAL_ORG, import_model

    if Path(args.folder).expanduser().is_file() or args.folder.lower().endswith(".gguf"):
        return _import_gguf(args)
    importer = _predictor_importer() if args.predictors else None
    target = import_model(args.folder, args.name, predictors_dir=args.predictors, on_predictors=importer,
                          convert_pickles=_pickle_converter())
    model_id = f"{LOCAL_ORG}/{target.name.split('--', 1)[1]}"
    if args.json:
        print(json.dumps({"id": model_id, "path": str(target)}))
    else:
        print(f"imported as {model_id} at {target}")
    return 0


def _import_gguf(args) -> int:
    from engine.loading.gguf_import import import_gguf
    from models_registry.manage import LOCAL_ORG, import_gguf_file

    from .progress_bar import ProgressBar

    if args.predictors:
        raise UserError("--predictors is for model folders; a PowerInfer GGUF carries its predictors")
    bar = ProgressBar("import", quiet=args.json)
    target, summary = import_gguf_file(
        args.folder, args.name,
        convert=lambda src, dst: import_gguf(src, dst, activation=args.activation, progress=bar))
    bar.done()
    model_id = f"{LOCAL_ORG}/{target.name.split('--', 1)[1]}"
    if args.json:
        print(json.dumps({"id": model_id, "path": str(target), **summary}))
    else:
        kinds = ", ".join(summary["tensor_types"])
        extra = " with predictors" if summary["predictors"] else ""
        print(f"imported {summary['architecture']} GGUF ({kinds}){extra} as {model_id} at {target}")
        for note in summary.get("notes", []):
            print(f"note: {note}")
    return 0


def cmd_verify(args) -> int:
    from models_registry.download import verify_files
    from models_registry.manage import model_folder

    folder = model_folder(args.model)
    if not folder.is_dir():
        raise UserError(f"{args.model} is not downloaded; nothing to verify")
    report = verify_files(folder)
    if args.json:
        print(json.dumps({"path": str(folder), "damaged": report.bad, "missing": report.missing,
                          "different": report.different}))
    elif report.bad:
        parts = ([f"missing: {', '.join(report.missing)}"] if report.missing else []) + \
                ([f"different from the Hub's: {', '.join(report.different)}"] if report.different else [])
        print(f"{len(report.bad)} file(s) of {args.model} do not match the pinned revision ({'; '.join(parts)}); "
              f"run `thermocline models download {args.model}` to fetch them again")
    else:
        print(f"all files of {args.model} match the Hub's hashes")
    return 1 if report.bad else 0


# -- fit -------------------------------------------------------------------------------------
def cmd_fit(args) -> int:
    from models_registry.catalogue import find_entry
    from models_registry.fit import BytesModel, estimate_fit
    from models_registry.hardware import probe_hardware
    from models_registry.resolve import resolve_model

    from engine.arch import read_config_json
    from engine.validation import check_ctx

    check_ctx(args.ctx, "--ctx")
    entry = find_entry(args.model)
    folder = None
    try:
        folder = resolve_model(args.model)
        config = read_config_json(folder)
    except UserError:
        if entry is None or not entry.config:
            raise
        config = entry.config  # not downloaded: size it from the catalogue's shape
    hw = probe_hardware()
    est = estimate_fit(config, ctx=args.ctx, vram_budget=args.vram_budget, ram_budget=args.ram_budget,
                       hardware=hw, model_dir=folder, known_activation=entry.activation if entry else None,
                       bytes_model=BytesModel(cpu_weights=args.cpu_weights, fast_device="cuda" if hw.gpus else "cpu"),
                       sparsity=entry.sparsity if entry else None)
    if args.json:
        print(json.dumps(dict(est.to_dict(), model=args.model), indent=2))
        return 0
    print(f"{args.model} at ctx {est.ctx}: {est.verdict} ({est.reason})")
    print(f"  budgets: VRAM {format_size(est.vram_budget)}, RAM {format_size(est.ram_budget)}; suggested for "
          f"this machine: VRAM {format_size(est.suggested_vram_budget or 0)}, "
          f"RAM {format_size(est.suggested_ram_budget or 0)}")
    rows = (("dense (attention, embeddings, norms)", est.dense_gpu_bytes, est.dense_cpu_bytes),
            ("predictors", est.predictor_gpu_bytes, est.predictor_cpu_bytes),
            ("KV cache", est.kv_gpu_bytes, est.kv_cpu_bytes),
            (f"FFN hot {est.hot_neurons} / cold {est.cold_neurons} neurons", est.hot_ffn_bytes, est.cold_ffn_bytes),
            ("total", est.vram_bytes, est.ram_bytes))
    print(f"  {'':44} {'GPU':>12} {'CPU':>12}")
    for label, gpu, cpu in rows:
        print(f"  {label:44} {format_size(gpu):>12} {format_size(cpu):>12}")
    if est.disk_neurons:
        print(f"  disk: {format_size(est.disk_bytes)} of FFN rows in the prepared file, {est.cache_neurons} neurons "
              f"cached in RAM; reads {format_size(int(est.disk_read_per_token))} from disk per token · runs from "
              f"disk at about {format_rate(est.words_per_s)} words a second")
    print(f"  least RAM budget at this VRAM budget: {format_size(est.min_ram_bytes)}")
    if est.dense:
        print("  dense: a SwiGLU model's neurons are never zero, so every one is computed (no predictors); "
              "`thermocline profile --target-sparsity 0.5` calibrates an opt-in sparse mode at a perplexity cost")
    return 0
