"""The dense mode's prepared layout (`--mode dense --cpu-weights int8|int4`): the first load
writes what it built into `prepared-<format>-dense-mode.safetensors`, later loads map it and
read no checkpoint tensor; a prepared model decodes exactly as an unprepared one; the file is
rebuilt when the checkpoint changes and when it is truncated or its header lies; `models
remove` takes it with the model."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import model_factory as mf
import real_config_models as rc
from app.cli import main
from engine import Engine, SamplingParams
from engine.loading.prepared import DISABLE_ENV, PreparedDenseMode, dense_mode_path
from engine.kernels.quantized import Int8Matrix, Q4Matrix
from engine.loading.weights import WeightSource
from engine.loading.dense_quant import QuantDenseFfn

PROMPT = [1] + [(7 * i + 3) % 290 + 5 for i in range(11)]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0)
FORMATS = {"int8": Int8Matrix, "int4": Q4Matrix}


def _managed(model: Path) -> Path:
    """A model folder with its sidecar, as a download or `models import` leaves it: a
    prepared file may be written there (a plain folder given by path is never written into)."""
    (model / "thermocline").mkdir(exist_ok=True)
    return model


def _load(model: Path, fmt: str, **kw) -> Engine:
    engine = Engine.load(model, mode="dense", cpu_weights=fmt, **kw)
    engine.eos_ids = set()  # random weights: a greedy run may hit an end id at once
    return engine


def _reference(model: Path, fmt: str, monkeypatch) -> tuple[list[int], torch.Tensor]:
    """Greedy ids and all-position logits of a load that neither reads nor writes a prepared file."""
    with monkeypatch.context() as m:
        m.setenv(DISABLE_ENV, "1")
        engine = _load(model, fmt)
        assert engine.dense_prepared is None
        return engine.generate(PROMPT, GREEDY).token_ids, engine.score(PROMPT)


def _mapped(engine: Engine) -> bool:
    """Every weight of the model is a view of the mapped prepared file (not memory of its own)."""
    file = engine.dense_prepared
    if file is None:
        return False
    m = engine.model
    parts = [m.embed, m.final_norm.weight] + ([] if m.lm_head is m.embed else [m.lm_head.q])
    for layer in m.layers:
        assert isinstance(layer.ffn, QuantDenseFfn)
        parts += [layer.qkv.q, layer.out.q, layer.ffn.gate_up.q, layer.ffn.down.q]
        for norm in (layer.attn_norm, layer.mlp_norm):  # Falcon: one LayerNorm, with a bias
            parts += [] if norm is None else [norm.weight] + ([] if norm.bias is None else [norm.bias])
        # 4-bit matrices stored packed (groups of 8 rows) and mapped as such: no conversion at load
        assert all(w.packed for w in (layer.qkv, layer.out, layer.ffn.gate_up, layer.ffn.down)
                   if isinstance(w, Q4Matrix))
    return all(file.holds(t) for t in parts)


def _decodes_as(engine: Engine, ids: list[int], logits: torch.Tensor) -> None:
    assert engine.generate(PROMPT, GREEDY).token_ids == ids
    assert torch.equal(engine.score(PROMPT), logits)


def _scramble_tensor_bytes(checkpoint: Path) -> None:
    """Overwrite every tensor's bytes with NaNs, keeping the header, the size and the
    modification time (the prepared file's key): a load that read a tensor would compute NaN."""
    st = checkpoint.stat()
    with open(checkpoint, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        f.write(b"\xff" * (st.st_size - 8 - n))
    os.utime(checkpoint, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", ["relullama", "bamboo"])
def test_prepared_dense_model_decodes_identically_maps_and_is_rebuilt_on_change(tmp_path, monkeypatch,
                                                                                 family, fmt):
    model = _managed(getattr(rc, family)(tmp_path / family)[0])
    path = dense_mode_path(model, fmt)
    ref_ids, ref_logits = _reference(model, fmt, monkeypatch)
    assert not path.exists()

    steps = []
    first = _load(model, fmt, progress=lambda f, text: steps.append((f, text)))
    assert _mapped(first) and path.is_file()  # computed, written, then mapped as later loads map it
    assert any("writing the prepared layout" in text for _, text in steps) and steps[-1][0] == 1.0
    assert not list(path.parent.glob("*.partial"))
    for layer in first.model.layers:
        assert isinstance(layer.qkv, FORMATS[fmt]) and isinstance(layer.ffn.down, FORMATS[fmt])
    _decodes_as(first, ref_ids, ref_logits)

    # the second load maps the file: with the checkpoint's tensors turned to NaN (its key
    # unchanged) and any tensor read an error, it still decodes as the reference
    original = {k: v.clone() for k, v in load_file(str(model / "model.safetensors")).items()}
    _scramble_tensor_bytes(model / "model.safetensors")
    with monkeypatch.context() as m:
        def no_read(self, name, shape=None):
            raise AssertionError(f"read {name} from the checkpoint")

        m.setattr(WeightSource, "get", no_read)
        second = _load(model, fmt)
    assert _mapped(second)
    _decodes_as(second, ref_ids, ref_logits)
    assert second.memory()["ram_bytes"] == first.memory()["ram_bytes"]

    # a changed checkpoint: the file is rebuilt from the new weights
    for name in original:
        if "up_proj" in name:
            original[name] = original[name] * -1.5
    save_file(original, str(model / "model.safetensors"), metadata={"format": "pt"})
    new_ids, new_logits = _reference(model, fmt, monkeypatch)
    assert not torch.equal(new_logits, ref_logits)
    steps.clear()
    rebuilt = _load(model, fmt, progress=lambda f, text: steps.append((f, text)))
    assert any("writing the prepared layout" in text for _, text in steps) and _mapped(rebuilt)
    _decodes_as(rebuilt, new_ids, new_logits)
    again = _load(model, fmt)
    assert _mapped(again)
    _decodes_as(again, new_ids, new_logits)


def _swap_qkv_shape(header: dict) -> None:
    entry = next(header[f"layers.0.qkv.{s}"] for s in ("q", "q4", "q4x8") if f"layers.0.qkv.{s}" in header)
    entry["shape"] = entry["shape"][::-1]  # the same bytes, another shape


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


def _junk_header(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 40) + b"{not json" + b" " * 31 + raw[48:])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("damage", [_truncate, _junk_header, _empty,
                                    lambda p: mf.rewrite_safetensors_header(p, p, _swap_qkv_shape)],
                         ids=["truncated", "junk-header", "empty", "lying-shape"])
def test_a_damaged_prepared_file_is_rebuilt_never_trusted(tmp_path, monkeypatch, fmt, damage):
    model = _managed(rc.relullama(tmp_path / "relullama")[0])
    ref_ids, ref_logits = _reference(model, fmt, monkeypatch)
    _load(model, fmt).wait_kernels()  # its warm-up reads the mapped file: done before the damage
    path = dense_mode_path(model, fmt)
    mtime = path.stat().st_mtime_ns
    damage(path)
    steps = []
    engine = _load(model, fmt, progress=lambda f, text: steps.append(text))
    assert any("writing the prepared layout" in text for text in steps)  # read from the checkpoint again
    _decodes_as(engine, ref_ids, ref_logits)
    assert path.stat().st_mtime_ns != mtime and PreparedDenseMode(path).complete(engine.config.num_layers)
    assert _mapped(again := _load(model, fmt))
    _decodes_as(again, ref_ids, ref_logits)


def test_tied_head_and_fp32_and_disabled_loads_write_nothing(tmp_path, monkeypatch):
    """MiniCPM's tied head is mapped as its own int8 rows beside the embeddings; the fp32 reference and
    THERMOCLINE_NO_PREPARED=1 neither read nor write a prepared file."""
    model = rc.minicpm(tmp_path / "minicpm")[0]
    ref_ids, ref_logits = _reference(model, "int8", monkeypatch)
    _load(model, "int8")  # a plain folder given by path: not written into
    assert not (model / "thermocline").exists()
    _managed(model)
    Engine.load(model, mode="dense", cpu_weights="fp32")
    Engine.load(model, mode="dense")  # the engine's default in dense: fp32
    assert not list(model.glob("thermocline/prepared-*"))
    _load(model, "int8")
    second = _load(model, "int8")
    assert _mapped(second) and isinstance(second.model.lm_head, Int8Matrix)
    _decodes_as(second, ref_ids, ref_logits)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert _load(model, "int8").dense_prepared is None


@pytest.mark.parametrize("new_arch", [False, True])
def test_falcon_layer_norms_prepare_as_they_load(tmp_path, monkeypatch, new_arch):
    """Falcon's LayerNorms (weight and bias; one per layer in the parallel layout)."""
    import model_factory as mf

    model = _managed(mf.falcon_relu(tmp_path / "falcon", new_arch=new_arch))
    ref_ids, ref_logits = _reference(model, "int8", monkeypatch)
    _load(model, "int8")
    second = _load(model, "int8")
    assert _mapped(second) and second.model.layers[0].attn_norm.bias is not None
    assert (second.model.layers[0].mlp_norm is None) == (not new_arch)
    _decodes_as(second, ref_ids, ref_logits)


def test_gguf_q4_0_checkpoint_prepares_as_it_loads(tmp_path, monkeypatch):
    """A GGUF's Q4_0 tensors (the checkpoint's quantized kinds): a prepared int4 dense load
    decodes exactly as an unprepared one."""
    import gguf_factory as gf
    import model_factory as mf
    from engine.loading.gguf_import import import_gguf

    hf = mf.llama_relu(tmp_path / "hf", dtype=torch.float16)
    quant = tmp_path / "quant"
    import_gguf(gf.write_gguf(hf, tmp_path / "tiny-q4.gguf", qtype="Q4_0", powerinfer=False), quant,
                activation="relu")
    _managed(quant)
    assert WeightSource(quant).quant_kind("model.layers.0.mlp.up_proj.weight") is not None
    ref_ids, ref_logits = _reference(quant, "int4", monkeypatch)
    _load(quant, "int4")
    second = _load(quant, "int4")
    assert _mapped(second)
    _decodes_as(second, ref_ids, ref_logits)


def test_models_remove_deletes_the_prepared_file_and_the_listing_counts_it(tmp_path, monkeypatch, capsys):
    from models_registry.manage import list_models

    root = tmp_path / "models"
    model = _managed(rc.relullama(root / "local--tiny")[0])
    monkeypatch.setenv("THERMOCLINE_MODELS_DIR", str(root))
    before = next(m for m in list_models(root) if m.path == str(model)).bytes_on_disk
    _load(model, "int8")
    prepared = dense_mode_path(model, "int8")
    size = prepared.stat().st_size
    listed = next(m for m in list_models(root) if m.path == str(model)).bytes_on_disk
    assert listed == before + size
    assert main(["models", "remove", "local/tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_freed"] == listed
    assert not prepared.exists() and not model.exists()


def test_a_failed_write_only_costs_the_mapping(tmp_path, monkeypatch):
    """Where the prepared file cannot be written (here a folder stands in its place) the load
    decodes as before, and leaves no half-written file behind."""
    model = _managed(rc.relullama(tmp_path / "relullama")[0])
    ref_ids, ref_logits = _reference(model, "int4", monkeypatch)
    dense_mode_path(model, "int4").mkdir()
    for _ in range(2):
        engine = _load(model, "int4")
        assert engine.dense_prepared is None
        _decodes_as(engine, ref_ids, ref_logits)
    assert np.isfinite(engine.score(PROMPT).numpy()).all()
    assert sorted(p.name for p in (model / "thermocline").iterdir()) == [dense_mode_path(model, "int4").name]


def test_a_killed_writers_partial_file_is_removed_a_running_ones_kept(tmp_path):
    import subprocess
    import sys

    from engine.loading.prepared import write_tensors

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    target = tmp_path / "prepared-int8-dense-mode.safetensors"
    abandoned = tmp_path / f"prepared-int8-dense-mode.{gone.pid}.partial"
    running = tmp_path / f"prepared-int8-dense-mode.{os.getppid()}.partial"
    other_file = tmp_path / f"prepared-int8.{gone.pid}.partial"
    for p in (abandoned, running, other_file):
        p.write_bytes(b"x" * 64)
    write_tensors(target, {"w": torch.ones(4)}, {"key": "k"})
    assert not abandoned.exists() and running.exists() and other_file.exists()
    assert torch.equal(load_file(str(target))["w"], torch.ones(4))
