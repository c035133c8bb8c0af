"""From a model folder to a `Transformer` with tensors where the placement wants them."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from engine.arch import arch_module
from engine.arch.common import Converter, LoadTarget
from engine.config import ModelConfig
from engine.errors import UserError
from engine.model.layers import Layer
from engine.model.transformer import Transformer
from engine.model.rope import RotaryTable
from engine.loading.weights import WeightSource
from engine.errors import ModelFormatError

Progress = Callable[[float, str], None]


def model_folder(model: str | Path) -> Path:
    """The folder `Engine.load` was given; names (`demo`, catalogue and repo ids) resolve in
    the callers (`models_registry.resolve.resolve_model`, `app.open_model`)."""
    path = Path(model).expanduser()
    if path.is_file():
        raise UserError(f"{str(model)[:160]!r} is a file, not a folder: a model is a folder with a config.json")
    if not path.is_dir():
        raise UserError(f"model folder {str(model)[:160]!r} does not exist "
                        "(names resolve with models_registry.resolve.resolve_model)")
    return path


def compute_dtype(device: torch.device, storage: torch.dtype) -> torch.dtype:
    """fp32 on the CPU (16-bit matmuls are far slower there, DESIGN.md); 16-bit on CUDA."""
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if storage == torch.bfloat16 else torch.float16


class _HeaderSource:
    """A WeightSource that answers shape-only (meta) tensors from the files' headers: a
    layer built through it costs nothing and is then given a prepared file's tensors."""

    def __init__(self, source: WeightSource):
        self.source = source

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        real = self.source.shape(name)
        if shape is not None and tuple(real) != tuple(shape):
            raise ModelFormatError(f"tensor {name} has shape {tuple(real)} but config.json implies {tuple(shape)}")
        return torch.empty(real, device="meta")


class _HeaderConverter(Converter):
    """`Converter` over `_HeaderSource`: every tensor meta, except the FFN when it is read."""

    def __init__(self, real: Converter):
        super().__init__(_HeaderSource(real.source), real.config)
        self.real = real

    @property
    def values(self) -> Converter:
        return self.real

    def get(self, name, shape, where):
        return self.source.get(name, shape).to(dtype=where.dtype)

    def stack_rows(self, parts, where):
        return torch.empty(sum(p.shape[0] for p in parts), parts[0].shape[1], dtype=where.dtype, device="meta")

    def ffn(self, *args, **kwargs):
        self.real.skip_ffn = self.skip_ffn
        return self.real.ffn(*args, **kwargs)


def load_transformer(model_dir: Path, config: ModelConfig, layer_devices: list[torch.device],
                     head_device: torch.device, ctx: int, progress: Progress | None = None,
                     ffn_builder: Callable[[int, object], object] | None = None,
                     on_layer: Callable[[int, Layer], None] | None = None,
                     read_ffn: Callable[[int], bool] | None = None, prepared=None,
                     from_prepared: Callable[[int], bool] | None = None,
                     globals_from_prepared: bool = False,
                     q4_layers: Callable[[int], bool] | None = None, q4_head: bool = False) -> Transformer:
    """Load every layer onto its device. With `ffn_builder`, FFN rows are staged on the CPU
    in fp32 and handed over layer by layer (the sparse engine splits them into tiers), so
    the whole dense FFN never sits in memory at once; `on_layer` may then convert the rest
    of the layer the same way (the sparse engine's int8 CPU tier). Where `read_ffn(i)` is
    False the checkpoint's FFN of layer i is not read: `ffn_builder` gets None (prepared rows).
    `prepared` (engine.loading.prepared.PreparedDense): the layers i it holds with `from_prepared(i)`
    (those on the CPU tier), and the globals with `globals_from_prepared`, are built from the
    checkpoint's headers and take its mapped tensors, so nothing else of them is read.
    `q4_layers(i)` / `q4_head` (an int4 CPU tier): weights the checkpoint stores as Q4_0 stay
    its 4-bit rows in layers i (attention matrices) and the head, and every layer's FFN
    hands `ffn_builder` its 4-bit rows as `q4_rows` (engine.arch.common.Converter)."""
    source = WeightSource(model_dir)
    storage = source.dtype()
    conv = Converter(source, config)
    headers = _HeaderConverter(conv) if prepared is not None else None
    arch = arch_module(config.arch)
    cpu = LoadTarget(torch.device("cpu"), compute_dtype(torch.device("cpu"), storage))
    head = LoadTarget(head_device, compute_dtype(head_device, storage))
    if headers is not None and globals_from_prepared and prepared.has_globals():
        embed, final_norm, lm_head = arch.load_globals(headers, cpu, head)
        embed, final_norm, lm_head = prepared.fill_globals(embed, final_norm, lm_head)
    else:
        conv.keep_q4 = q4_head
        embed, final_norm, lm_head = arch.load_globals(conv, cpu, head)
    conv.keep_q4_ffn = q4_layers is not None
    layers = []
    for i, device in enumerate(layer_devices):
        if progress:
            progress(i / config.num_layers, f"loading layer {i + 1} of {config.num_layers}")
        where = LoadTarget(device, compute_dtype(device, storage))
        mapped = headers is not None and from_prepared is not None and from_prepared(i) and prepared.has_layer(i)
        use = headers if mapped else conv
        use.skip_ffn = read_ffn is not None and not read_ffn(i)
        conv.keep_q4 = q4_layers is not None and q4_layers(i)
        layer = arch.load_layer(use, i, where, cpu if ffn_builder else None)
        if mapped:
            prepared.fill_layer(i, layer)
        if ffn_builder is not None:
            layer.ffn = ffn_builder(i, layer.ffn)
        if on_layer is not None:
            on_layer(i, layer)
        layers.append(layer)
    devices = set(layer_devices) | {head_device}
    rotary = {d: RotaryTable(config.rope, config.head_dim, ctx, compute_dtype(d, storage), d) for d in devices}
    if progress:
        progress(1.0, "layers read")  # not "loaded": what follows the layers still runs
    return Transformer(config, embed, layers, final_norm, lm_head, rotary)
