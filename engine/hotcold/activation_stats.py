"""How often each FFN neuron fired over a calibration text: what the placement solver ranks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from engine.errors import ModelFormatError
from engine.loading.sidecar import group_by_layer, sidecar_dir

FILENAME = "activation_stats.safetensors"


@dataclass
class ActivationStats:
    counts: list[torch.Tensor]  # float64 [n_ff] per layer: times each neuron fired (a mixture: each expert chosen)
    tokens: int
    # A mixture of experts: float64 [experts, expert neurons] per layer, times each neuron of
    # each expert fired (counted on the tokens that chose the expert). None for dense FFNs.
    expert_neurons: list[torch.Tensor] | None = None

    def frequencies(self) -> list[torch.Tensor]:
        return [c.double() / max(self.tokens, 1) for c in self.counts]

    def sparsity(self) -> list[float]:
        """Share of neurons that did not fire, per layer, averaged over tokens."""
        return [1.0 - float(f.mean()) for f in self.frequencies()]

    def save(self, model_dir: Path) -> Path:
        folder = sidecar_dir(model_dir)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"layers.{i}.counts": c.double().cpu().contiguous() for i, c in enumerate(self.counts)}
        for i, c in enumerate(self.expert_neurons or []):
            tensors[f"layers.{i}.expert_neurons"] = c.double().cpu().contiguous()
        path = folder / FILENAME
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"tokens": str(int(self.tokens))})
        tmp.replace(path)
        return path

    @classmethod
    def exists(cls, model_dir: Path) -> bool:
        return (sidecar_dir(model_dir) / FILENAME).is_file()

    @classmethod
    def load(cls, model_dir: Path) -> "ActivationStats":
        path = sidecar_dir(model_dir) / FILENAME
        if not path.is_file():
            raise ModelFormatError(f"{Path(model_dir).name} has no activation statistics; run `thermocline profile`")
        try:
            with safe_open(str(path), framework="pt") as handle:
                tokens = int((handle.metadata() or {}).get("tokens", "0"))
            layers = group_by_layer(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFormatError(f"statistics file {path} is corrupt ({exc}); profile again") from None
        if list(layers) != list(range(len(layers))):
            raise ModelFormatError(f"statistics in {path} skip layers: {list(layers)}")
        neurons = None
        if layers and all("expert_neurons" in layers[i] for i in layers):
            neurons = [layers[i]["expert_neurons"].double() for i in layers]
        return cls([layers[i]["counts"].double() for i in layers], tokens, neurons)
