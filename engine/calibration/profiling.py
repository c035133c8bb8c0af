"""Profiling a model on calibration text: activation counts and predictor training pairs.

The model runs densely over windows of the calibration text with an FFN observer attached.
Per layer we count how often each neuron fires (the placement solver's statistics, written
as `ActivationStats`) and keep (predictor input, fired neurons) pairs for
`predictor_training`. Pairs are streamed to safetensors shards under
`<model>/thermocline/profile/layer_NNN/` as soon as a layer's buffer reaches
`shard_bytes`, and the total stays under `max_pairs_bytes` (split evenly over the layers),
so a 7B model profiles in a desktop's RAM. Inputs are stored as fp16, labels as bits.

Every `checkpoint_every` windows the buffers are flushed and the counts and position are
saved (`state.json`, `counts.safetensors`), so an interrupted run resumes where it stopped
instead of starting over. A run with different settings or text starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.errors import UserError
from engine.loading.sidecar import sidecar_dir
from engine.hotcold.activation_stats import ActivationStats

Progress = Callable[[float, str], None]

PROFILE_DIR = "profile"
STATE_FILE = "state.json"
COUNTS_FILE = "counts.safetensors"
FORMAT_VERSION = 1


def profile_dir(model_dir: Path) -> Path:
    return sidecar_dir(model_dir) / PROFILE_DIR


def layer_dir(root: Path, layer: int) -> Path:
    return root / f"layer_{layer:03d}"


@dataclass
class ProfileSettings:
    max_tokens: int = 200_000
    max_pairs_bytes: int = 2 * 1024**3
    window: int = 512
    shard_bytes: int = 8 * 1024**2
    checkpoint_every: int = 16  # windows between saved checkpoints
    # CATS (a SiLU model): the share of |SiLU(gate)| values each layer's threshold puts below
    # it, calibrated on the first `calibration_tokens` of the text before the profile proper
    target_sparsity: float | None = None
    calibration_tokens: int = 16_384


@dataclass
class ProfileResult:
    tokens: int
    windows: int
    pair_rows: list[int]
    pair_bytes: int
    sparsity: list[float]  # per layer, fraction of (token, neuron) activations that are 0
    resumed_from_tokens: int = 0
    folder: Path = field(default_factory=Path)

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens, "windows": self.windows, "pair_rows": self.pair_rows,
            "pair_bytes": self.pair_bytes, "sparsity": self.sparsity,
            "mean_sparsity": float(np.mean(self.sparsity)) if self.sparsity else 0.0,
            "resumed_from_tokens": self.resumed_from_tokens, "folder": str(self.folder),
        }


def read_corpus(paths: list[str | Path]) -> str:
    if not paths:
        raise UserError("no calibration text given: pass --corpus FILE (plain UTF-8 text)")
    parts = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            raise UserError(f"corpus file {path} does not exist")
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"corpus file {path} is not UTF-8 text") from None
    text = "\n".join(parts)
    if not text.strip():
        raise UserError("the corpus is empty")
    return text


def corpus_windows(tokenizer, text: str, window: int, max_tokens: int) -> list[list[int]]:
    """Token windows of at most `window` ids covering up to `max_tokens` tokens.

    Paragraphs are encoded one by one (each starts with BOS where the tokenizer adds one) and
    packed into windows, so no window depends on text far away and a long corpus is
    tokenized only as far as it is needed.
    """
    if window < 2:
        raise UserError(f"window {window} is too short (at least 2 tokens)")
    windows: list[list[int]] = []
    current: list[int] = []
    total = 0
    for para in text.split("\n"):
        if not para.strip():
            continue
        ids = tokenizer.encode(para)
        while ids:
            room = min(window - len(current), max_tokens - total)
            current.extend(ids[:room])
            total += len(ids[:room])
            ids = ids[room:]
            if len(current) == window:
                windows.append(current)
                current = []
            if total >= max_tokens:
                break
        if total >= max_tokens:
            break
    if len(current) >= 2:
        windows.append(current)
    if not windows:
        raise UserError("the corpus is too short to profile (fewer than 2 tokens)")
    return windows


def _fingerprint(model_dir: Path, text: str, settings: ProfileSettings) -> str:
    h = hashlib.sha256()
    h.update((Path(model_dir) / "config.json").read_bytes())
    h.update(text.encode("utf-8"))
    h.update(json.dumps([FORMAT_VERSION, settings.max_tokens, settings.max_pairs_bytes,
                         settings.window]).encode())
    if settings.target_sparsity is not None:  # (absent for the ReLU family: their saved profiles still resume)
        h.update(json.dumps(["cats", settings.target_sparsity, settings.calibration_tokens]).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------ CATS
_SAMPLES_PER_WINDOW = 32_768  # |SiLU(gate)| values kept per layer and window for the quantile


class _GateSampler:
    """The FFN observer of a CATS calibration: a random sample of each layer's |SiLU(gate)|."""

    def __init__(self, layers: int, seed: int = 0):
        self.samples: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.gen = torch.Generator().manual_seed(seed)

    def gate_values(self, layer: int, gate_pre: torch.Tensor) -> None:
        values = torch.nn.functional.silu(gate_pre.float()).abs().reshape(-1).cpu()
        if values.numel() > _SAMPLES_PER_WINDOW:
            values = values[torch.randint(values.numel(), (_SAMPLES_PER_WINDOW,), generator=self.gen)]
        self.samples[layer].append(values)

    def __call__(self, layer: int, pred_input: torch.Tensor, act: torch.Tensor) -> None:
        pass

    def thresholds(self, target: float) -> list[float]:
        return [float(torch.quantile(torch.cat(s), target)) if s else 0.0 for s in self.samples]


def calibrate_cats(engine, windows: list[list[int]], target: float, max_tokens: int) -> list[float]:
    """Per-layer thresholds t with P(|SiLU(gate)| < t) = target on the windows' first
    `max_tokens` tokens, scored densely (CATS, Lee et al. 2024: the threshold is the layer's
    quantile of the gate's activation magnitudes on calibration text)."""
    sampler = _GateSampler(engine.config.num_layers)
    previous, engine.model.ffn_observer = engine.model.ffn_observer, sampler
    try:
        done = 0
        for ids in windows:
            if done >= max_tokens:
                break
            engine.score(ids, "dense")
            done += len(ids)
    finally:
        engine.model.ffn_observer = previous
    return sampler.thresholds(target)


def write_cats(model_dir: Path, thresholds: list[float], target: float, tokens: int) -> Path:
    from engine.config import CATS_RECORD

    path = Path(model_dir) / CATS_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"target_sparsity": target, "calibration_tokens": tokens,
                               "thresholds": thresholds}), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _set_thresholds(engine, thresholds: list[float]) -> list[float]:
    """Each layer's FFN threshold set (the dense-loaded engine profiles the thresholded model); the old ones."""
    old = []
    for layer, t in zip(engine.model.layers, thresholds):
        old.append(layer.ffn.threshold)
        layer.ffn.threshold = t
        layer.fused = None  # the fused decode's arguments hold the threshold
    return old


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


class PairWriter:
    """Buffers one layer's pairs and writes them as shards, within a byte cap."""

    def __init__(self, folder: Path, d: int, n_ff: int, cap_bytes: int, shard_bytes: int,
                 rows: int = 0, shards: int = 0):
        self.folder, self.d, self.n_ff = folder, d, n_ff
        self.row_bytes = 2 * d + math.ceil(n_ff / 8)
        self.cap_rows = cap_bytes // self.row_bytes
        self.shard_rows = max(1, shard_bytes // self.row_bytes)
        self.rows, self.shards = rows, shards  # already on disk
        self._x: list[np.ndarray] = []
        self._bits: list[np.ndarray] = []
        self._buffered = 0

    @property
    def full(self) -> bool:
        return self.rows + self._buffered >= self.cap_rows

    def add(self, x: torch.Tensor, fired: torch.Tensor) -> None:
        room = self.cap_rows - self.rows - self._buffered
        if room <= 0:
            return
        x, fired = x[:room], fired[:room]
        self._x.append(x.detach().to("cpu", torch.float16).numpy())
        self._bits.append(np.packbits(fired.to("cpu").numpy(), axis=1, bitorder="little"))
        self._buffered += x.shape[0]
        if self._buffered >= self.shard_rows:
            self.flush()

    def flush(self) -> None:
        if not self._buffered:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        x = torch.from_numpy(np.concatenate(self._x))
        bits = torch.from_numpy(np.concatenate(self._bits))
        _write_atomic(self.folder / f"shard_{self.shards:05d}.safetensors",
                      {"x": x, "fired_bits": bits}, {"n_ff": str(self.n_ff)})
        self.rows += self._buffered
        self.shards += 1
        self._x, self._bits, self._buffered = [], [], 0


def load_pairs(model_dir: Path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All stored pairs of one layer: inputs [N, d] fp32 and labels [N, n_ff] bool."""
    folder = layer_dir(profile_dir(model_dir), layer)
    shards = sorted(folder.glob("shard_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    if not shards:
        raise UserError(f"no profiling data for layer {layer} in {folder}: run "
                        "`thermocline profile --model M --corpus FILE` first")
    xs, labels = [], []
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            n_ff = int(f.metadata()["n_ff"])
            xs.append(f.get_tensor("x").float())
            bits = f.get_tensor("fired_bits").numpy()
        labels.append(torch.from_numpy(
            np.unpackbits(bits, axis=1, count=n_ff, bitorder="little").astype(bool)))
    return torch.cat(xs), torch.cat(labels)


class _Collector:
    """The FFN observer: counts firings and hands pairs to the layer writers."""

    def __init__(self, counts: list[torch.Tensor], writers: list[PairWriter],
                 expert_neurons: list[torch.Tensor] | None = None):
        self.counts, self.writers = counts, writers
        self.neuron_counts = expert_neurons  # a mixture: [experts, n] per layer (engine/model/moe.py calls below)

    def expert_neurons(self, layer: int, expert: int, fired: torch.Tensor) -> None:
        """A mixture's expert ran on the tokens that chose it: `fired` [n] counts, per neuron,
        those tokens where it fired."""
        self.neuron_counts[layer][expert] += fired.to("cpu", torch.float64)

    def __call__(self, layer: int, pred_input: torch.Tensor, act: torch.Tensor) -> None:
        fired = act != 0
        self.counts[layer] += fired.sum(0).to("cpu", torch.float64)
        writer = self.writers[layer]
        if not writer.full:
            writer.add(pred_input.float(), fired)


def profile(engine, corpus: list[str | Path], settings: ProfileSettings | None = None,
            progress: Progress | None = None, restart: bool = False) -> ProfileResult:
    """Profile a dense-loaded engine over the calibration text; see the module docstring."""
    settings = settings or ProfileSettings()
    if settings.max_tokens < 2:
        raise UserError("--max-tokens must be at least 2")
    if settings.window > engine.ctx:
        raise UserError(f"window {settings.window} is longer than the context {engine.ctx}")
    cfg = engine.config
    model_dir = Path(engine.model_dir)
    cats = settings.target_sparsity
    if cats is not None and cfg.activation != "silu":
        raise UserError(f"--target-sparsity calibrates CATS thresholds for SiLU (SwiGLU) models; {model_dir.name}'s "
                        f"{cfg.activation} activations have their own zeros: profile it without it")
    if cats is not None and not 0.0 < cats < 1.0:
        raise UserError(f"--target-sparsity must be between 0 and 1 (e.g. 0.5), not {cats}")
    if cats is None and cfg.activation == "silu":
        raise UserError(f"{model_dir.name}'s SiLU activations are never zero: pass --target-sparsity (e.g. 0.5) to "
                        "calibrate CATS thresholds, the opt-in sparse mode of a SwiGLU model")
    text = read_corpus(corpus)
    windows = corpus_windows(engine.tokenizer, text, settings.window, settings.max_tokens)
    if cats is not None:
        thresholds = calibrate_cats(engine, windows, cats, settings.calibration_tokens)
        write_cats(model_dir, thresholds, cats, min(settings.calibration_tokens, sum(map(len, windows))))
        restore = _set_thresholds(engine, thresholds)
        try:
            return _profile(engine, model_dir, text, windows, settings, progress, restart)
        finally:
            _set_thresholds(engine, restore)
    return _profile(engine, model_dir, text, windows, settings, progress, restart)


def _profile(engine, model_dir: Path, text: str, windows: list[list[int]], settings: ProfileSettings,
             progress: Progress | None, restart: bool) -> ProfileResult:
    cfg = engine.config
    root = profile_dir(model_dir)
    fingerprint = _fingerprint(model_dir, text, settings)
    state = _load_state(root, fingerprint) if not restart else None
    if state is not None and cfg.is_moe and not _has_expert_neurons(root):
        state = None  # an earlier profile counted experts only: start again
    if state is None:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        state = {"version": FORMAT_VERSION, "fingerprint": fingerprint, "windows_done": 0,
                 "tokens": 0, "rows": [0] * cfg.num_layers, "shards": [0] * cfg.num_layers,
                 "complete": False}
        counts = [torch.zeros(cfg.n_ff, dtype=torch.float64) for _ in range(cfg.num_layers)]
        neurons = [torch.zeros(cfg.num_experts, cfg.intermediate_size, dtype=torch.float64)
                   for _ in range(cfg.num_layers)] if cfg.is_moe else None
    else:
        saved = load_file(str(root / COUNTS_FILE))
        counts = [saved[f"layers.{i}.counts"] for i in range(cfg.num_layers)]
        neurons = [saved[f"layers.{i}.expert_neurons"] for i in range(cfg.num_layers)] if cfg.is_moe else None
        _drop_unsaved_shards(root, state["shards"])
    resumed_from = state["tokens"]
    per_layer_cap = settings.max_pairs_bytes // cfg.num_layers
    writers = [PairWriter(layer_dir(root, i), cfg.hidden_size, cfg.n_ff, per_layer_cap,
                          settings.shard_bytes, state["rows"][i], state["shards"][i])
               for i in range(cfg.num_layers)]
    total_tokens = sum(len(w) for w in windows)
    collector = _Collector(counts, writers, neurons)
    started, start_tokens = time.monotonic(), state["tokens"]
    previous = engine.model.ffn_observer
    engine.model.ffn_observer = collector
    try:
        for index in range(state["windows_done"], len(windows)):
            engine.score(windows[index], "dense")
            state["windows_done"] = index + 1
            state["tokens"] += len(windows[index])
            if state["windows_done"] % settings.checkpoint_every == 0:
                _checkpoint(root, state, counts, writers, neurons)
            if progress:
                progress(state["tokens"] / total_tokens,
                         _progress_text(state["tokens"], total_tokens, start_tokens, started))
    finally:
        engine.model.ffn_observer = previous
    state["complete"] = True
    _checkpoint(root, state, counts, writers, neurons)
    ActivationStats(counts=counts, tokens=state["tokens"], expert_neurons=neurons).save(model_dir)
    sparsity = [1.0 - float(c.sum()) / (state["tokens"] * cfg.n_ff) for c in counts]
    return ProfileResult(tokens=state["tokens"], windows=len(windows), pair_rows=state["rows"],
                         pair_bytes=sum(w.rows * w.row_bytes for w in writers), sparsity=sparsity,
                         resumed_from_tokens=resumed_from, folder=root)


def _progress_text(done: int, total: int, start_done: int, started: float) -> str:
    elapsed = time.monotonic() - started
    rate = (done - start_done) / elapsed if elapsed > 0 else 0.0
    eta = (total - done) / rate if rate > 0 else float("nan")
    return f"{done}/{total} tokens, {rate:.0f} tok/s, ETA {_fmt_seconds(eta)}"


def _fmt_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _has_expert_neurons(root: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(root / COUNTS_FILE), "pt") as f:
            return "layers.0.expert_neurons" in f.keys()
    except Exception:  # noqa: BLE001 - an unreadable counts file: profile again
        return False


def _load_state(root: Path, fingerprint: str) -> dict | None:
    try:
        state = json.loads((root / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if state.get("fingerprint") != fingerprint or not (root / COUNTS_FILE).is_file():
        return None  # other text or settings: the old profile does not apply
    return state


def _drop_unsaved_shards(root: Path, kept: list[int]) -> None:
    """Shards written after the last checkpoint hold windows that will be run again."""
    for layer, count in enumerate(kept):
        for shard in layer_dir(root, layer).glob("shard_*.safetensors"):
            if int(shard.stem.split("_")[1]) >= count:
                shard.unlink()


def _checkpoint(root: Path, state: dict, counts: list[torch.Tensor], writers: list[PairWriter],
                neurons: list[torch.Tensor] | None = None) -> None:
    for i, w in enumerate(writers):
        w.flush()
        state["rows"][i], state["shards"][i] = w.rows, w.shards
    tensors = {f"layers.{i}.counts": c for i, c in enumerate(counts)}
    tensors.update({f"layers.{i}.expert_neurons": c for i, c in enumerate(neurons or [])})
    _write_atomic(root / COUNTS_FILE, tensors, {"tokens": str(state["tokens"])})
    tmp = root / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state), encoding="utf-8")
    os.replace(tmp, root / STATE_FILE)


def read_profile_state(model_dir: Path) -> dict | None:
    try:
        return json.loads((profile_dir(model_dir) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
