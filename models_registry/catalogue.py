"""The catalogue of supported sparse models, read from `catalogue.json` (data, not code).

Each entry names the Hugging Face repo, the files a model needs, its shape and licence, the
sparsity its authors measured, and where its activation predictors come from (a PowerInfer
predictor repo, or trained locally with `thermocline train-predictors`). Figures we could
not check against a public source are listed in the entry's `unverified` field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from engine.errors import UserError

CATALOGUE_FILE = Path(__file__).with_name("catalogue.json")

# What every model download fetches when the catalogue (or the user) does not say otherwise.
DEFAULT_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    # Older repos ship only PyTorch pickles; fetched only when no safetensors exist (hub.select_files).
    # Such weights must be read with torch.load(weights_only=True), never a plain unpickle.
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
BASE_MODEL_NOTE = "base model: continues text, not an assistant"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "q4_0": 18 / 32}  # q4_0: ggml blocks of 32 in 18 bytes
DEFAULT_PREDICTOR_FILES = ("model_*.pt", "config.json")


@dataclass(frozen=True)
class Predictor:
    """Where a model's activation predictors come from."""

    # "powerinfer" (a repo of model_N.pt) | "gguf" (blk.N.fc1/fc2 of PowerInfer's GGUF, read by
    # range requests) | "checkpoint" (carried in the weights: TurboSparse) | "train" (trained
    # locally) | "bundled" | "router" (experts chosen by the model's router: no predictors)
    source: str
    repo: str | None = None
    revision: str | None = None
    files: tuple[str, ...] = DEFAULT_PREDICTOR_FILES


@dataclass(frozen=True)
class CatalogueEntry:
    id: str
    repo: str | None  # None for the embedded demo model
    revision: str | None  # None: resolved at download time and pinned in the state file
    files: tuple[str, ...]
    size_bytes: int | None  # download size of `files` (weights in the repo's dtype)
    architecture: str  # model_type: llama | mistral | falcon | bamboo
    activation: str  # relu | fatrelu | drelu | relu2
    context_length: int
    params: str
    license: str
    sparsity: float | None  # fraction of FFN activations that are zero, per the authors
    sparsity_source: str
    predictor: Predictor
    description: str
    unverified: tuple[str, ...] = field(default_factory=tuple)
    config: dict | None = None  # the config.json fields that size the model (fit before download)
    dtype: str = "float16"  # of the published weights
    chat: bool = False  # instruction-tuned; False: a base model that continues text
    chat_format: str | None = None  # built-in template when tokenizer_config.json has none
    recommended: bool = False  # the first download we suggest on every machine
    weights_format: str = "safetensors"

    @property
    def gguf_weights(self) -> bool:
        """The weights are one GGUF file of the repo, imported after the download (gguf_weights.py)."""
        return self.weights_format.startswith("gguf")

    @property
    def kind_note(self) -> str:
        """What the model is for, in words a user reads next to it."""
        return "chat model" if self.chat else BASE_MODEL_NOTE
    mirrors: tuple[str, ...] = ()  # other repo ids publishing the same files (found by find_entry too)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "repo": self.repo,
            "revision": self.revision,
            "files": list(self.files),
            "size_bytes": self.size_bytes,
            "architecture": self.architecture,
            "activation": self.activation,
            "context_length": self.context_length,
            "params": self.params,
            "license": self.license,
            "sparsity": self.sparsity,
            "sparsity_source": self.sparsity_source,
            "predictor": {
                "source": self.predictor.source,
                "repo": self.predictor.repo,
                "revision": self.predictor.revision,
                "files": list(self.predictor.files),
            },
            "description": self.description,
            "unverified": list(self.unverified),
            "config": dict(self.config) if self.config else None,
            "dtype": self.dtype,
            "chat": self.chat,
            "chat_format": self.chat_format,
            "recommended": self.recommended,
            "weights_format": self.weights_format,
            "kind_note": self.kind_note,
            "mirrors": list(self.mirrors),
        }


def _parse_entry(raw: dict) -> CatalogueEntry:
    pred = raw.get("predictor") or {"source": "train"}
    return CatalogueEntry(
        id=raw["id"],
        repo=raw.get("repo"),
        revision=raw.get("revision"),
        files=tuple(raw.get("files") or DEFAULT_MODEL_FILES),
        size_bytes=raw.get("size_bytes"),
        architecture=raw["architecture"],
        activation=raw["activation"],
        context_length=int(raw["context_length"]),
        params=raw.get("params", ""),
        license=raw.get("license", "unknown"),
        sparsity=raw.get("sparsity"),
        sparsity_source=raw.get("sparsity_source", ""),
        predictor=Predictor(
            source=pred["source"],
            repo=pred.get("repo"),
            revision=pred.get("revision"),
            files=tuple(pred.get("files") or DEFAULT_PREDICTOR_FILES),
        ),
        description=raw.get("description", ""),
        unverified=tuple(raw.get("unverified", ())),
        config=raw.get("config"),
        dtype=raw.get("dtype", "float16"),
        chat=bool(raw.get("chat", False)),
        chat_format=raw.get("chat_format"),
        recommended=bool(raw.get("recommended", False)),
        weights_format=raw.get("weights_format", "safetensors"),
        mirrors=tuple(raw.get("mirrors", ())),
    )


@lru_cache(maxsize=4)
def _load(path: Path) -> tuple[CatalogueEntry, ...]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return tuple(_parse_entry(item) for item in data["models"])


def load_catalogue(path: Path | None = None) -> tuple[CatalogueEntry, ...]:
    """All catalogue entries, in the order of the data file."""
    return _load(Path(path) if path else CATALOGUE_FILE)


def find_entry(name: str, path: Path | None = None) -> CatalogueEntry | None:
    """The entry whose id or repo id is `name` (case-insensitive), or None."""
    key = name.strip().lower()
    for entry in load_catalogue(path):
        if entry.id.lower() == key or (entry.repo and entry.repo.lower() == key) \
                or any(m.lower() == key for m in entry.mirrors):
            return entry
    return None


def recommended_entry() -> CatalogueEntry | None:
    """The model suggested as the first download (small, a chat model, runs everywhere)."""
    return next((e for e in load_catalogue() if e.recommended), None)


def get_entry(name: str) -> CatalogueEntry:
    entry = find_entry(name)
    if entry is None:
        ids = ", ".join(e.id for e in load_catalogue())
        raise UserError(f"{name!r} is not in the catalogue; known ids: {ids}")
    return entry
