"""What is in the models folder: list, remove, import a local folder.

`list_models()` merges the catalogue with the folders on disk (models added from other
repos or imported from a folder show up too), each with its download state and, when a
hardware probe is given, a fit estimate for this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.errors import UserError
from engine.units import format_size

from .arch import detect_architecture
from .catalogue import CatalogueEntry, find_entry, load_catalogue
from .download import PREDICTOR_SUBDIR
from .import_files import SourceFile, SourceFiles, bring_in, check_space
from .paths import models_dir, repo_folder_name
from .pickles import convert_pickles as _convert_pickles
from .pickles import has_pickle_weights
from .resolve import DEMO_ID, demo_model_dir, is_repo_id
from .state import SIDECAR, read_state, write_state

LOCAL_ORG = "local"
# Sidecar files worth keeping from an imported folder (the rest is another download's state).
KEPT_SIDECAR_FILES = ("predictors.safetensors", "activation_stats.safetensors")
MAX_CONFIG_BYTES = 16 << 20


@dataclass
class ModelListing:
    id: str  # catalogue id, or org/name for other repos and local imports (local/<name>)
    repo: str | None
    status: str  # builtin | ready | downloading | not downloaded | damaged | missing | local
    path: str | None
    size_bytes: int | None  # full size (from the Hub, or the catalogue before download)
    bytes_on_disk: int = 0
    predictors: str = "none"
    in_catalogue: bool = False
    description: str = ""
    fit: dict | None = None
    entry: dict | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                pass
    return total


def _listing_for_folder(folder: Path, listing: ModelListing) -> ModelListing:
    state = read_state(folder)
    if not folder.is_dir():
        return listing
    listing.path = str(folder)
    listing.bytes_on_disk = _dir_bytes(folder)
    if state is None:
        # A folder placed by hand is taken as is; a local/ one without state is an unfinished import.
        by_hand = not folder.name.startswith(repo_folder_name(LOCAL_ORG + "/"))
        listing.status = "ready" if by_hand and (folder / "config.json").is_file() else "damaged"
    else:
        listing.status = {"ready": "ready", "downloading": "downloading"}.get(state.get("status"), "damaged")
        listing.predictors = state.get("predictors", listing.predictors)
        if state.get("size_bytes"):
            listing.size_bytes = state["size_bytes"]
    return listing


def _fit(config: dict | None, entry: CatalogueEntry | None, folder: Path | None, hardware, ctx: int):
    if hardware is None or not config:
        return None
    from .fit import estimate_fit

    try:
        est = estimate_fit(config, ctx=ctx, hardware=hardware, model_dir=folder,
                           known_activation=entry.activation if entry else None,
                           sparsity=entry.sparsity if entry else None)
    except (UserError, KeyError, ValueError, TypeError):
        return None
    return {"verdict": est.verdict, "vram_bytes": est.vram_bytes, "ram_bytes": est.ram_bytes,
            "disk_bytes": est.disk_bytes, "disk_read_per_token": est.disk_read_per_token,
            "words_per_s": est.words_per_s, "min_ram_bytes": est.min_ram_bytes,
            "suggested_vram_budget": est.suggested_vram_budget,
            "suggested_ram_budget": est.suggested_ram_budget, "hot_fraction": est.hot_fraction}


def _read_config(folder: Path | None) -> dict | None:
    if folder is None:
        return None
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def list_models(root: Path | None = None, hardware=None, ctx: int = 2048,
                extra: tuple[str, ...] | list[str] = ()) -> list[ModelListing]:
    """Catalogue entries (in catalogue order), then other model folders found on disk, then
    `extra`: models the user added by hand (repo ids not downloaded yet, or local folders)."""
    root = Path(root or models_dir())
    out, seen = [], set()
    for entry in load_catalogue():
        if entry.id == DEMO_ID:
            folder = demo_model_dir()
            ok = (folder / "config.json").is_file()
            listing = ModelListing(DEMO_ID, None, "builtin" if ok else "missing", str(folder) if ok else None,
                                   _dir_bytes(folder) if ok else None, predictors="bundled", in_catalogue=True,
                                   description=entry.description, entry=entry.to_dict())
            listing.bytes_on_disk = listing.size_bytes or 0
            listing.fit = _fit(_read_config(folder) if ok else None, entry, folder if ok else None, hardware, ctx)
            out.append(listing)
            continue
        folder = root / repo_folder_name(entry.repo)
        seen.add(folder.name)
        listing = ModelListing(entry.id, entry.repo, "not downloaded", None, entry.size_bytes,
                               predictors=entry.predictor.source, in_catalogue=True,
                               description=entry.description, entry=entry.to_dict())
        listing = _listing_for_folder(folder, listing)
        config = _read_config(folder) or entry.config
        listing.fit = _fit(config, entry, folder if folder.is_dir() else None, hardware, ctx)
        out.append(listing)
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and "--" in p.name):
            if folder.name in seen:
                continue
            repo = folder.name.replace("--", "/", 1)
            state = read_state(folder) or {}
            listing = ModelListing(repo, None if repo.startswith(LOCAL_ORG + "/") else repo, "ready", None, None,
                                   description=f"imported from {state['origin']}" if state.get("origin") else "")
            listing = _listing_for_folder(folder, listing)
            listing.fit = _fit(_read_config(folder), None, folder, hardware, ctx)
            out.append(listing)
            seen.add(folder.name)
    for item in extra:
        path = Path(item).expanduser()
        if path.is_dir():
            listing = ModelListing(str(path), None, "local", str(path), _dir_bytes(path), _dir_bytes(path),
                                   description="a folder used in place")
            listing.fit = _fit(_read_config(path), None, path, hardware, ctx)
            out.append(listing)
        elif is_repo_id(item) and repo_folder_name(item) not in seen and find_entry(item) is None:
            out.append(ModelListing(item, item, "not downloaded", None, None, description="added by hand"))
    return out


def model_folder(name: str, root: Path | None = None) -> Path:
    """The folder under the models folder for a catalogue id, repo id or local/<name>."""
    root = Path(root or models_dir())
    entry = find_entry(name)
    repo = entry.repo if entry and entry.repo else name
    if not is_repo_id(repo):
        raise UserError(f"{name!r} is not a catalogue id or an org/name repo id (see `thermocline models list`)")
    return root / repo_folder_name(repo)


def remove_model(name: str, root: Path | None = None) -> int:
    """Delete a downloaded (or partly downloaded, or imported) model; returns bytes freed."""
    if name.strip() == DEMO_ID:
        raise UserError("the demo model is part of Thermocline and cannot be removed")
    root = Path(root or models_dir())
    folder = model_folder(name.strip(), root)
    if not folder.is_dir():
        raise UserError(f"{name} is not in the models folder {root}; nothing to remove")
    if folder.resolve().parent != root.resolve():
        raise UserError(f"refusing to remove {folder}: it is not directly inside {root}")
    freed = _dir_bytes(folder)
    shutil.rmtree(folder)
    return freed


IMPORT_PREFIX = ".import-"  # no "--": a folder being built is never listed as a model


def _clear_stale_imports(root: Path) -> None:
    """Remove hidden import folders whose process is gone (killed mid-import): the next attempt heals."""
    for folder in root.glob(IMPORT_PREFIX + "*"):
        pid = folder.name[len(IMPORT_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not _process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # alive, someone else's
    return True


def _building_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _clear_stale_imports(root)
    return Path(tempfile.mkdtemp(prefix=f"{IMPORT_PREFIX}{os.getpid()}-", dir=root))


def _free_target(target: Path, name: str) -> None:
    """Refuse a name in use; a folder an interrupted import left (no "ready" state) is replaced."""
    if not os.path.lexists(target):
        return
    real_folder = target.is_dir() and not target.is_symlink()
    state = read_state(target) if real_folder else None
    if state is not None and state.get("status") == "ready":
        raise UserError(f"a model named {LOCAL_ORG}/{name} already exists; remove it first or pick another --name")
    if real_folder:
        shutil.rmtree(target)
    else:
        target.unlink()


def _source_folder(src: Path) -> Path:
    if src.is_file():
        raise UserError(f"{_shown(src)} is a file, not a folder: import a model folder (with config.json) "
                        "or a .gguf file")
    if not src.is_dir():
        raise UserError(f"{_shown(src)} does not exist")
    return src


def _shown(path: Path) -> str:
    text = str(path)
    return repr(text if len(text) <= 160 else text[:150] + "...")


def import_model(src: str | os.PathLike, name: str | None = None, *, root: Path | None = None,
                 predictors_dir: str | os.PathLike | None = None,
                 on_predictors: Callable[[Path, Path], None] | None = None,
                 convert_pickles: Callable[[Path], dict] | None = None) -> Path:
    """Add a local Hugging Face-layout folder to the models folder as `local/<name>`.

    The architecture is checked first. Only regular files inside the folder are taken
    (`import_files`: a link out of it, a FIFO or a device is refused, naming it); a file is
    hard-linked when it is its inode's one name and on the same filesystem, else copied, after
    the copies are checked against the free disk. A PowerInfer predictor folder (`model_N.pt`,
    with its config.json's `sparse_threshold`) can come along. PyTorch pickles
    (`pytorch_model*.bin`) become safetensors in the new folder (the user's folder is left as it
    is); a pickle that would run code is refused. The import is built in a hidden folder and
    renamed into place at the end: a failure (a refused pickle or predictor, a full disk, a kill)
    leaves nothing listed, and the same command can be run again.
    """
    src = _source_folder(Path(src).expanduser())
    files = SourceFiles(src)
    if not (src / "config.json").exists() and not (src / "config.json").is_symlink():
        raise UserError(f"{_shown(src)} is not a model folder: it has no config.json")
    config_file = files.check(src / "config.json")
    try:
        if config_file.size > MAX_CONFIG_BYTES:
            raise ValueError(f"it is {format_size(config_file.size)}, more than a config can be")
        config = json.loads(config_file.real.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise UserError(f"{_shown(src / 'config.json')} is not valid JSON: {str(exc)[:200]}") from None
    detect_architecture(config)
    weights = [p for p in src.iterdir() if p.suffix == ".safetensors" or
               (p.name.startswith("pytorch_model") and p.suffix == ".bin")]
    if not weights:
        raise UserError(f"{_shown(src)} has no weights (*.safetensors or pytorch_model*.bin)")
    taken = _source_files(src, files)
    name = (name or src.resolve().name).strip()
    if not is_repo_id(f"{LOCAL_ORG}/{name}"):
        raise UserError(f"cannot use {name[:100]!r} as a model name: use letters, digits, '-', '_' and '.'")
    predictor_files = []
    if predictors_dir is not None:
        pdir = _source_folder(Path(predictors_dir).expanduser())
        wanted = sorted(pdir.glob("model_*.pt"))
        if not wanted:
            raise UserError(f"{_shown(pdir)} has no PowerInfer predictor files (model_N.pt)")
        extra = pdir / "config.json"  # PowerInfer's sparse_threshold lives here
        pfiles = SourceFiles(pdir)
        predictor_files = [pfiles.check(p) for p in wanted + ([extra] if os.path.lexists(extra) else [])]
    root = Path(root or models_dir())
    target = root / repo_folder_name(f"{LOCAL_ORG}/{name}")
    _free_target(target, name)
    building = _building_folder(root)
    try:
        check_space([f for _, f in taken] + predictor_files, root)
        _import_into(src, building, taken, predictor_files, on_predictors, convert_pickles)
        try:
            os.rename(building, target)  # refuses (ENOTEMPTY/EEXIST) if another import won the race
        except OSError:
            raise UserError(f"a model named {LOCAL_ORG}/{name} appeared meanwhile; "
                            "remove it first or pick another --name") from None
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return target


def _source_files(src: Path, files: SourceFiles) -> list[tuple[Path, SourceFile]]:
    """(path in the new folder, checked file) for every file worth importing."""
    out = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or (path.is_dir() and not path.is_symlink()):
            continue
        if rel.parts[0] == SIDECAR and not (len(rel.parts) == 2 and rel.name in KEPT_SIDECAR_FILES):
            continue
        if path.is_dir():  # a link to a folder: never followed
            raise UserError(f"{_shown(path)} is a link to a folder; refusing to import it "
                            "(copy the files into the model folder instead)")
        out.append((rel, files.check(path)))
    return out


def _import_into(src: Path, target: Path, taken: list, predictor_files: list, on_predictors,
                 convert_pickles) -> None:
    files = {}
    for rel, f in taken:
        bring_in(f, target / rel)
        files[rel.as_posix()] = {"size": f.size, "hash": None, "verified": False}
    state = {"status": "ready", "source": "local", "origin": str(src.resolve()), "files": files,
             "size_bytes": sum(f["size"] for f in files.values()), "finished": time.time()}
    if has_pickle_weights(target):
        # Hard links: deleting a converted pickle here leaves the user's own file alone; on any
        # failure the caller removes the hidden folder (only links or copies of the user's files).
        _convert_pickles(target, state, convert_pickles, origin=str(src))
        state["size_bytes"] = sum(f["size"] for f in files.values())
    if predictor_files:
        dest = target / SIDECAR / PREDICTOR_SUBDIR
        for f in predictor_files:
            bring_in(f, dest / f.path.name)
        state["predictors"] = "downloaded"
        if on_predictors is not None:
            on_predictors(dest, target)
            state["predictors"] = "imported"
    write_state(target, state)


def _gguf_model_name(path: Path) -> str:
    """ReluLLaMA-7B.q4.powerinfer.gguf -> ReluLLaMA-7B.q4 (the name under local/)."""
    name = path.name[:-len(".gguf")] if path.name.lower().endswith(".gguf") else path.stem
    return name[:-len(".powerinfer")] if name.lower().endswith(".powerinfer") else name


def import_gguf_file(src: str | os.PathLike, name: str | None = None, *, root: Path | None = None,
                     convert: Callable[[Path, Path], dict]) -> tuple[Path, dict]:
    """Add a GGUF file to the models folder as `local/<name>`: `convert(src, folder)` (the
    engine's GGUF importer, passed in so this package stays free of the engine) writes the
    model folder inside a hidden one, renamed into place once its state is written: a kill
    mid-import leaves nothing listed. Returns (folder, convert's summary)."""
    src = Path(src).expanduser()
    if src.is_dir():
        raise UserError(f"{_shown(src)} is a folder, not a .gguf file")
    if not os.path.lexists(src):
        raise UserError(f"{_shown(src)} does not exist")
    checked = SourceFiles(src.parent).check(src) if not src.is_symlink() else _gguf_link(src)
    name = (name or _gguf_model_name(src)).strip()
    if not is_repo_id(f"{LOCAL_ORG}/{name}"):
        raise UserError(f"cannot use {name[:100]!r} as a model name: use letters, digits, '-', '_' and '.'")
    root = Path(root or models_dir())
    target = root / repo_folder_name(f"{LOCAL_ORG}/{name}")
    _free_target(target, name)
    building = _building_folder(root)
    try:
        check_space([checked], root)  # the weights come out about as large as the file
        model = building / "model"
        summary = convert(checked.real, model)
        files = {p.relative_to(model).as_posix(): {"size": p.stat().st_size, "hash": None, "verified": False}
                 for p in sorted(model.rglob("*")) if p.is_file()}
        state = {"status": "ready", "source": "gguf", "origin": str(src.resolve()), "files": files,
                 "size_bytes": sum(f["size"] for f in files.values()), "finished": time.time(),
                 "predictors": "imported" if summary.get("predictors") else None}
        write_state(model, state)
        try:
            os.rename(model, target)
        except OSError:
            raise UserError(f"a model named {LOCAL_ORG}/{name} appeared meanwhile; "
                            "remove it first or pick another --name") from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target, summary


def _gguf_link(src: Path) -> SourceFile:
    """A .gguf given as a link is read where it points (the user named it), if a regular file."""
    return SourceFiles(src.resolve().parent).check(src.resolve())
