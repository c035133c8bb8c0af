"""Predictors read out of a PowerInfer GGUF: from a local file, and from the Hub by range
requests that fetch the header and the predictor tensors only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import ModelFormatError, UserError
from engine.kernels.quantized import Int8Matrix, Q4Matrix
from engine.loading.gguf_predictors import import_gguf_predictors, read_gguf_predictors
from engine.loading.predictors import PredictorSet
from gguf_factory import powerinfer_gguf
from hub_server import HubRepo, local_hub, registry_env  # noqa: F401
from model_factory import llama_relu
from models_registry import gguf_fetch
from models_registry.hub import fetch_plan
from models_registry.progress import DownloadControl, ProgressMeter


def _same(predictors: PredictorSet, expected: dict[str, np.ndarray]) -> None:
    for i in range(len(predictors)):
        assert torch.equal(predictors.fc1[i], torch.from_numpy(expected[f"layers.{i}.fc1.weight"].astype(np.float32)))
        assert torch.equal(predictors.fc2[i], torch.from_numpy(expected[f"layers.{i}.fc2.weight"]))


def test_predictors_of_a_pwri_file_are_read_in_torch_layout(tmp_path):
    path = tmp_path / "model.powerinfer.gguf"
    expected = powerinfer_gguf(path, layers=3, d=16, n_ff=40, rank=6, threshold=0.25, tokens=50)
    assert path.read_bytes()[:4] == b"PWRI"
    predictors = read_gguf_predictors(path)
    assert len(predictors) == 3 and predictors.ranks == [6, 6, 6]
    assert predictors.thresholds == [0.25] * 3
    _same(predictors, expected)
    # at the file's precision: fc1 is F16 there, fc2 F32
    assert {w.dtype for w in predictors.fc1} == {torch.float16} and {w.dtype for w in predictors.fc2} == {torch.float32}
    assert path.read_bytes()[:4] == b"PWRI"  # the user's file is left as it was
    assert not [p for p in tmp_path.iterdir() if p != path]


def test_a_gguf_without_predictors_is_refused(tmp_path):
    import gguf

    path = tmp_path / "plain.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match="no blk.N.fc1/fc2"):
        read_gguf_predictors(path)


def test_import_checks_the_shapes_against_the_model(tmp_path):
    model = llama_relu(tmp_path / "m", hidden=64, ff=160, layers=2)
    good = tmp_path / "good.gguf"
    expected = powerinfer_gguf(good, layers=2, d=64, n_ff=160, tokens=50)
    import_gguf_predictors(good, model)
    _same(PredictorSet.load(model, 2, 64, 160), expected)
    bad = tmp_path / "bad.gguf"
    powerinfer_gguf(bad, layers=2, d=64, n_ff=100, tokens=50)
    with pytest.raises(ModelFormatError, match="do not fit"):
        import_gguf_predictors(bad, model)


def test_range_requests_fetch_the_header_and_the_predictors_only(local_hub, tmp_path, monkeypatch):
    src = tmp_path / "MiniCPM-S-1B-sft.gguf"
    expected = powerinfer_gguf(src, layers=4, d=64, n_ff=160, rank=8, tokens=6000, vocab=2000)
    data = src.read_bytes()
    local_hub.add_repo(HubRepo("openbmb/MiniCPM-S-1B-sft-gguf", {src.name: data, "README.md": b"# gguf\n"}))
    monkeypatch.setattr(gguf_fetch, "FIRST_HEADER_BYTES", 4096)  # the header is longer: it must grow
    plan = fetch_plan("openbmb/MiniCPM-S-1B-sft-gguf", None, ("*.gguf",), endpoint=local_hub.url, token=None)
    remote = gguf_fetch.choose_gguf(plan)
    dest = tmp_path / "work" / remote.name
    info = gguf_fetch.fetch_gguf_predictors(local_hub.url, plan, remote, dest, headers={},
                                            meter=ProgressMeter(plan.repo, remote.size), control=DownloadControl())
    gets = local_hub.requests("GET", "/cdn/") + local_hub.requests("GET", "/resolve/")
    assert gets and all(r["range"] for r in gets)
    sent = sum(r.get("sent", 0) for r in gets)
    predictor_bytes = sum(a.nbytes for a in expected.values())
    assert info["ranged"] and info["magic"] == "PWRI" and info["tensors"] == 8
    assert sent == info["bytes_fetched"] < len(data) / 2 and sent >= predictor_bytes
    assert dest.stat().st_blocks * 512 < len(data)  # a sparse file: the rest takes no disk
    _same(read_gguf_predictors(dest), expected)


def test_a_server_without_ranges_gets_the_whole_file_checked(local_hub, tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    expected = powerinfer_gguf(src, layers=2, d=16, n_ff=40, tokens=100)
    local_hub.add_repo(HubRepo("someone/gguf", {src.name: src.read_bytes()}))
    real = gguf_fetch._get_range
    monkeypatch.setattr(gguf_fetch, "_get_range", lambda *a, **k: None if a[3] == 0 else real(*a, **k))
    plan = fetch_plan("someone/gguf", None, ("*.gguf",), endpoint=local_hub.url, token=None)
    dest = tmp_path / "work" / "m.gguf"
    info = gguf_fetch.fetch_gguf_predictors(local_hub.url, plan, gguf_fetch.choose_gguf(plan), dest, headers={},
                                            meter=ProgressMeter(plan.repo, 1), control=DownloadControl())
    assert not info["ranged"] and info["bytes_fetched"] == src.stat().st_size
    _same(read_gguf_predictors(dest), expected)


def test_the_fp16_gguf_is_chosen():
    from models_registry.hub import RemoteFile, RepoPlan

    files = tuple(RemoteFile(n, 1, "0" * 64, None) for n in
                  ("MiniCPM-S-1B-sft.Q4_0.powerinfer.gguf", "MiniCPM-S-1B-sft.fp16.powerinfer.gguf"))
    assert gguf_fetch.choose_gguf(RepoPlan("r", "c", files)).name == "MiniCPM-S-1B-sft.fp16.powerinfer.gguf"


def test_without_an_importer_the_engine_imports_in_a_child_process(local_hub, tmp_path):
    """What the window's downloads do: the registry (no torch) runs engine.gguf_predictors."""
    model = llama_relu(tmp_path / "m", hidden=64, ff=160, layers=2)
    src = tmp_path / "m.powerinfer.gguf"
    expected = powerinfer_gguf(src, layers=2, d=64, n_ff=160, tokens=100)
    local_hub.add_repo(HubRepo("someone/m-gguf", {src.name: src.read_bytes()}))
    plan = fetch_plan("someone/m-gguf", None, ("*.gguf",), endpoint=local_hub.url, token=None)
    info = gguf_fetch.import_gguf_predictors_from_hub(local_hub.url, plan, model, headers={}, importer=None)
    assert info["file"] == src.name and info["bytes_fetched"] > 0
    _same(PredictorSet.load(model, 2, 64, 160), expected)
    assert not (model / "thermocline" / gguf_fetch.GGUF_SUBDIR).exists()
    bad = tmp_path / "bad.gguf"
    powerinfer_gguf(bad, layers=3, d=64, n_ff=160, tokens=100)
    local_hub.add_repo(HubRepo("someone/bad-gguf", {bad.name: bad.read_bytes()}))
    plan = fetch_plan("someone/bad-gguf", None, ("*.gguf",), endpoint=local_hub.url, token=None)
    with pytest.raises(UserError, match="3 layers"):
        gguf_fetch.import_gguf_predictors_from_hub(local_hub.url, plan, model, headers={}, importer=None)


def _fp64_logits(fc1, fc2, x):
    from engine.kernels.quantized import Q4Matrix

    f1, f2 = (w.dequantize() if isinstance(w, Q4Matrix) else w.float() for w in (fc1, fc2))
    return torch.relu(x.double() @ f1.double().T) @ f2.double().T


@pytest.mark.parametrize("mix", ["f16-q4", "q4-f16", "bf16-f32"])
def test_predictor_matrices_of_mixed_stored_kinds_compute_their_logits(mix):
    """A file may store fc1 and fc2 at different kinds (PowerInfer's F16 fc1 with Q4_0 fc2);
    an unplaced set computes either order against the fp64 product of the stored values. The
    4-bit side computes with int8 activations: its bound is their rounding (measured 0.21 and
    0.61 max against logits of magnitude 63)."""
    from engine.kernels.quantized import Q4Matrix

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g), torch.randn(40, 32, generator=g)
    x = torch.randn(3, 64, generator=g)
    fc1, fc2 = {"f16-q4": (a.half(), Q4Matrix.quantize(b)), "q4-f16": (Q4Matrix.quantize(a), b.half()),
                "bf16-f32": (a.bfloat16(), b)}[mix]
    out = PredictorSet([fc1], [fc2], [0.0], source="test").logits(0, x)
    ref = _fp64_logits(fc1, fc2, x)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    bound = 1e-4 if mix == "bf16-f32" else 1.5
    assert (out.double() - ref).abs().max().item() < bound


def test_a_set_placed_on_the_int4_tier_saves_and_loads_back_its_values(tmp_path):
    """A file's own 4-bit predictors (PowerInfer's Q4_0 rows) keep their bytes on the int4 CPU
    tier, packed there (interleaved rows); `save` stores plain Q4_0 rows, so the set read back
    holds the same values (a packed layout read as rows would not). Float predictors become
    int8 rows on that tier (engine.cpu_formats.predictor_cpu_format)."""
    g = torch.Generator().manual_seed(1)
    fc1, fc2 = torch.randn(32, 64, generator=g), torch.randn(40, 32, generator=g)
    placed = PredictorSet([Q4Matrix.quantize(fc1)], [Q4Matrix.quantize(fc2)], [0.0], source="test")
    placed.to(0, torch.device("cpu"), torch.float32, quant="int4")
    assert placed.fc1[0].packed and placed.fc2[0].packed
    floats = PredictorSet([fc1], [fc2], [0.0], source="test")
    floats.to(0, torch.device("cpu"), torch.float32, quant="int4")
    assert isinstance(floats.fc1[0], Int8Matrix) and isinstance(floats.fc2[0], Int8Matrix)
    placed.save(tmp_path)
    back = PredictorSet.load(tmp_path, 1, 64, 40)
    for k in ("fc1", "fc2"):
        assert torch.equal(getattr(back, k)[0].dequantize(), getattr(placed, k)[0].dequantize()), k
