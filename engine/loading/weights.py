"""Reading checkpoint tensors from safetensors files, memory-mapped.

Single files and shards (`model.safetensors.index.json`) are both served by
`WeightSource.get(name)`, which returns a tensor backed by the mapped file: nothing is
copied until the engine converts it into its own layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.loading.confine import check_relative_name
from engine.errors import ModelFormatError


class WeightSource:
    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelFormatError(f"cannot read {index}: {exc!r}") from None
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index.name}: weight_map is not an object of tensor -> file")
            # The index is downloaded text: a shard name must be a file inside this folder.
            # (Links the user made on disk, e.g. a Hugging Face cache snapshot, are theirs.)
            for filename in set(weight_map.values()):
                check_relative_name(filename, f"{index.name} in {self.model_dir}")
            self._where = dict(weight_map)
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                bins = list(self.model_dir.glob("*.bin")) + list(self.model_dir.glob("*.pt"))
                hint = " (PyTorch pickles are never loaded: convert to safetensors)" if bins else ""
                raise ModelFormatError(f"{self.model_dir} has no *.safetensors weights{hint}")
            for f in files:
                for name in self._open(f.name).keys():
                    self._where[name] = f.name

    def _open(self, filename: str):
        handle = self._files.get(filename)
        if handle is None:
            path = self.model_dir / filename
            if not path.is_file():
                raise ModelFormatError(f"weight shard {filename} is missing from {self.model_dir}")
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise ModelFormatError(
                    f"{path.name} is corrupt or truncated ({exc}); download it again"
                ) from None
            self._files[filename] = handle
        return handle

    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._where:
            raise ModelFormatError(f"tensor {name} is missing from the checkpoint in {self.model_dir}")
        try:
            tensor = self._open(self._where[name]).get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelFormatError(f"cannot read tensor {name} ({exc}); the file may be truncated") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ModelFormatError(
                f"tensor {name} has shape {tuple(tensor.shape)} but config.json implies {tuple(shape)}"
            )
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the file's header (nothing read)."""
        if name not in self._where:
            raise ModelFormatError(f"tensor {name} is missing from the checkpoint in {self.model_dir}")
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

    def dtype(self) -> torch.dtype:
        """Storage dtype of the checkpoint (of its first floating tensor), from the headers:
        reading the tensor itself would copy it (the first name is often the 250 MB head)."""
        for name in sorted(self._where):
            try:
                dtype = _HEADER_DTYPES.get(self._open(self._where[name]).get_slice(name).get_dtype())
            except (SafetensorError, OSError, ValueError, RuntimeError, AttributeError):
                dtype = None
                t = self.get(name)
                if t.is_floating_point():
                    return t.dtype
            if dtype is not None:
                return dtype
        return torch.float32


# safetensors' dtype names of the floating types a checkpoint may store
_HEADER_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
