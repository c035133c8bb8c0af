"""The prepared layout: the first load with a CPU format writes the layer rows into the
sidecar, later loads map them; a prepared model decodes exactly as an unprepared one, and
the file is rebuilt when the checkpoint changes."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, SamplingParams
from engine.loading.predictors import PredictorSet
from engine.loading.prepared import DISABLE_ENV, prepared_path
from engine.loading.weights import WeightSource

from test_sparse import PROMPT, RAM, random_predictors

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
# the shared tiny models may hold prepared rows from other tests' loads: copy without them
FRESH = shutil.ignore_patterns("prepared-*")


def _load(model, fmt, **kw):
    engine = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights=fmt, **kw)
    engine.eos_ids = set()
    return engine


def _dense_mapped(engine) -> bool:
    """The attention matrices, norms, embeddings, head and predictors are views of the
    prepared dense file."""
    dense = engine.sparse.prepared_dense
    if dense is None:
        return False
    model, pred = engine.model, engine.sparse.predictors
    tensors = [model.embed, model.final_norm.weight, model.lm_head.q]
    for i, layer in enumerate(model.layers):
        tensors += [layer.attn_norm.weight, layer.mlp_norm.weight, layer.qkv.q, layer.out.q]
        tensors += [pred.fc1[i].q, pred.fc2[i].q] if pred is not None else []
    # 4-bit matrices stored packed (groups of 8 rows) and mapped as such: no conversion at load
    mats = [model.lm_head] + [m for layer in model.layers for m in (layer.qkv, layer.out)]
    assert all(getattr(m, "packed", True) for m in mats + (list(pred.fc1) + list(pred.fc2) if pred else []))
    return all(dense.holds(t) for t in tensors)


def _mapped(engine) -> bool:
    """Every layer's cold rows are views of the prepared file (not memory of their own)."""
    mapped = engine.sparse.prepared_rows
    return mapped is not None and all(mapped.holds(t) for layer in engine.model.layers
                                      for t in (layer.ffn.cold.rows.up, layer.ffn.cold.rows.down_t))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_prepared_model_decodes_identically_and_is_rebuilt_on_change(tmp_path, llama_dir, monkeypatch, fmt):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model, ignore=FRESH)
    random_predictors(Engine.load(model).config, threshold=-0.5).save(model)
    path = prepared_path(model, fmt)
    monkeypatch.setenv(DISABLE_ENV, "1")
    plain = _load(model, fmt)
    assert plain.sparse.prepared_path is None and not path.exists()
    ref_ids, ref_logits = plain.generate(PROMPT, GREEDY).token_ids, plain.score(PROMPT, "sparse")
    monkeypatch.delenv(DISABLE_ENV)

    steps = []
    first = _load(model, fmt, progress=lambda f, text: steps.append(text))
    assert first.sparse.prepared_path == path and path.is_file()
    assert any("preparing layer" in s for s in steps)
    assert _mapped(first) and _dense_mapped(first)  # computed its rows, wrote them, then mapped them
    # the second load reads only the checkpoint's headers: everything comes from the map
    with monkeypatch.context() as m:
        def no_read(self, name, shape=None):
            raise AssertionError(f"read {name} from the checkpoint")

        m.setattr(WeightSource, "get", no_read)
        m.setattr(PredictorSet, "load", no_read)
        second = _load(model, fmt)
    assert second.sparse.prepared_path == path and _mapped(second) and _dense_mapped(second)
    for engine in (first, second):
        assert engine.generate(PROMPT, GREEDY).token_ids == ref_ids
        assert torch.equal(engine.score(PROMPT, "sparse"), ref_logits)
        assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes

    # a changed checkpoint: the prepared rows are rebuilt from the new weights
    weights = load_file(str(model / "model.safetensors"))
    for name in weights:
        if "up_proj" in name:
            weights[name] = weights[name] * -1.5
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    before = path.stat().st_mtime_ns
    monkeypatch.setenv(DISABLE_ENV, "1")
    changed = _load(model, fmt)
    new_ids = changed.generate(PROMPT, GREEDY).token_ids
    monkeypatch.delenv(DISABLE_ENV)
    steps.clear()
    rebuilt = _load(model, fmt, progress=lambda f, text: steps.append(text))
    assert path.stat().st_mtime_ns != before and any("preparing layer" in s for s in steps)
    assert rebuilt.generate(PROMPT, GREEDY).token_ids == new_ids
    assert _mapped(_load(model, fmt))

    # new predictors: the dense part is rebuilt with them (and decodes as without the file)
    random_predictors(changed.config, threshold=-0.3, seed=5).save(model)
    monkeypatch.setenv(DISABLE_ENV, "1")
    want = _load(model, fmt).generate(PROMPT, GREEDY).token_ids
    monkeypatch.delenv(DISABLE_ENV)
    assert not _dense_mapped(_load(model, fmt))
    again = _load(model, fmt)
    assert _dense_mapped(again) and again.generate(PROMPT, GREEDY).token_ids == want


def test_layers_with_hot_neurons_read_the_checkpoint(tmp_path, llama_dir):
    """Prepared rows serve layers whose neurons all sit on the CPU; the others keep the
    checkpoint's precision on the fast tier, and their cold rows equal the prepared ones."""
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model, ignore=FRESH)
    Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int4")  # prepares
    from test_sparse import vram_for

    probe = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int4")
    assert _mapped(probe)
    # neurons by number without statistics: a quarter of them fills half of layer 0
    hybrid = Engine.load(model, mode="oracle", vram_budget=vram_for(probe, 0.25), ram_budget=RAM, cpu_weights="int4")
    first, second = hybrid.model.layers
    assert 0 < len(first.ffn.hot) < 160 and len(second.ffn.hot) == 0
    mapped = hybrid.sparse.prepared_rows
    assert not mapped.holds(first.ffn.cold.rows.up) and mapped.holds(second.ffn.cold.rows.up)
    for a, b in zip(hybrid.model.layers, probe.model.layers):
        assert torch.equal(a.ffn.cold.rows.up, b.ffn.cold.rows.up[a.ffn.cold.ids])
        assert torch.equal(a.ffn.cold.rows.down_t, b.ffn.cold.rows.down_t[a.ffn.cold.ids])
    # the hot rows hold the checkpoint's fp32 values: closer to the fp32 model than all-int4
    dense = Engine.load(model).score(PROMPT)
    assert (hybrid.score(PROMPT, "oracle") - dense).abs().max() < (probe.score(PROMPT, "oracle") - dense).abs().max()


def test_fast_tier_layers_and_head_read_the_checkpoint(tmp_path, llama_dir, monkeypatch):
    """A prepared file made by an all-CPU load never stands in for what the fast tier holds
    (the CPU standing in for a GPU here): those weights keep the checkpoint's precision."""
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model, ignore=FRESH)
    Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int4")  # prepares
    cpu_only = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int4")
    assert _dense_mapped(cpu_only)
    fast = Engine.load(model, mode="oracle", vram_budget=1 << 30, ram_budget=RAM, cpu_weights="int4")
    monkeypatch.setenv(DISABLE_ENV, "1")
    plain = Engine.load(model, mode="oracle", vram_budget=1 << 30, ram_budget=RAM, cpu_weights="int4")
    assert all(fast.sparse.plan.layer_on_fast) and fast.sparse.plan.head_on_fast
    for a, b in zip(fast.model.layers, plain.model.layers):
        assert isinstance(a.qkv, torch.Tensor) and torch.equal(a.qkv, b.qkv) and torch.equal(a.out, b.out)
    assert torch.equal(fast.model.lm_head, plain.model.lm_head)
    assert torch.equal(fast.score(PROMPT, "oracle"), plain.score(PROMPT, "oracle"))


@pytest.mark.parametrize("file_huge,recached", [(False, False), (False, True), (True, None)])
def test_matrices_read_whole_by_every_token_come_in_huge_pages(tmp_path, monkeypatch, file_huge, recached):
    """`resident` gives a stored matrix in huge pages: where the file is mapped in 2 MB pages,
    or its pages could be read again so (recache_huge, tried on the first matrix of two huge
    pages or more, then on the next ones unchecked), the view of the map; else a copy in host
    memory (anonymous huge pages). The same bytes either way; small tensors stay mapped views."""
    from engine.kernels import host_memory
    from engine.loading.prepared import PreparedDense, write_tensors
    from engine.kernels.quantized import Int8Matrix, Q4Matrix
    from test_host_memory import _anon_huge_kb, _thp_mode

    probes, recaches = [], []
    monkeypatch.setattr(host_memory, "file_pages_huge", lambda a: probes.append(a.nbytes) or file_huge)
    monkeypatch.setattr(host_memory, "recache_huge",
                        lambda a, path, check=True: recaches.append((a.nbytes, check)) or bool(recached))
    gen = torch.Generator().manual_seed(3)
    q8 = torch.randint(-127, 128, (3072, 2048), dtype=torch.int8, generator=gen)  # 6 MB
    scale = torch.rand(3072, generator=gen)
    q4 = torch.randint(0, 256, (4096, 18 * 40), dtype=torch.uint8, generator=gen)  # 1280 cols, 2.9 MB
    small = torch.randn(64, 16, generator=gen)
    path = write_tensors(tmp_path / "d.safetensors", {"b.q4": q4, "a.q": q8, "a.scale": scale, "c": small},
                         {"key": "k", "format": "int8"})
    dense = PreparedDense(path)
    a = dense.matrix("a", (3072, 2048), resident=True)
    b = dense.matrix("b", (4096, 1280), resident=True)
    c = dense.matrix("c", (64, 16), resident=True)
    assert isinstance(a, Int8Matrix) and isinstance(b, Q4Matrix)
    assert torch.equal(a.q, q8) and torch.equal(a.scale, scale) and torch.equal(b.q, q4) and torch.equal(c, small)
    assert dense.holds(c) and dense.holds(dense.matrix("a", (3072, 2048)).q)  # without `resident`: the map
    if not host_memory.thp_available():
        assert dense.holds(a.q) and dense.holds(b.q) and probes == []
        return
    assert probes == [q8.numel()]  # decided once, on the file's largest matrix
    mapped = file_huge or recached
    assert recaches == ([] if file_huge else [(q8.numel(), True), (q4.numel(), False)] if recached
                        else [(q8.numel(), True)])
    copied = [] if mapped else [a.q, b.q]
    assert dense.holds(a.q) == dense.holds(b.q) == mapped
    assert torch.equal(a.q, q8) and torch.equal(b.q, q4)
    for t in copied:
        assert t.data_ptr() % host_memory.HUGE_PAGE == 0
        if _thp_mode() in ("always", "madvise"):
            assert _anon_huge_kb(t.data_ptr()) >= 2048


def test_the_rows_writer_names_its_partial_file_by_pid_and_removes_a_killed_writers(tmp_path):
    import os
    import subprocess
    import sys

    from engine.loading.prepared import PreparedWriter, prepared_path

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    target = prepared_path(tmp_path, "int8")
    target.parent.mkdir(parents=True)
    abandoned = target.with_suffix(f".{gone.pid}.partial")
    abandoned.write_bytes(b"x" * 64)
    writer = PreparedWriter(tmp_path, "int8", "k", 8, 16, True, 1)
    assert not abandoned.exists()
    assert writer.tmp.name == f"{target.stem}.{os.getpid()}.partial" and writer.tmp.exists()
    writer.abort()
    assert not writer.tmp.exists() and not target.exists()


def test_a_writer_stopped_short_keeps_no_partial_and_a_misshapen_tensor_is_refused(tmp_path):
    """Both prepared writers share one streamed writer: a file missing tensors is removed at
    `finish` (the dense writer used to leave its model-sized partial until the process
    ended), and a tensor of another shape than its header entry is refused before it is
    written."""
    import pytest
    import torch

    from engine.loading.prepared import PreparedWriter, prepared_path
    from engine.loading.safetensors_out import StreamedSafetensors

    writer = PreparedWriter(tmp_path, "int8", "k", 8, 16, True, 1)
    with pytest.raises(RuntimeError, match="incomplete"):
        writer.finish()
    assert not writer.tmp.exists() and not prepared_path(tmp_path, "int8").exists()

    out = StreamedSafetensors(tmp_path / "x.safetensors", [("a", "I8", (2, 3))], {"key": "k"})
    with pytest.raises(RuntimeError, match="declared"):
        out.write("a", torch.zeros(3, 2, dtype=torch.int8))
    out.write("a", torch.zeros(2, 3, dtype=torch.int8))
    assert out.finish().stat().st_size > 6 and not out.tmp.exists()


def test_a_just_written_file_is_read_again_in_huge_pages_and_later_opens_map_it(tmp_path, monkeypatch):
    """The real kernel's answer: a file just written (small folios) gives its resident
    matrices either as views read again in 2 MB pages or as copies, the same bytes; where it
    gave views, a later open of the file finds them huge and maps them with nothing read again."""
    from engine.kernels import host_memory
    from engine.loading.prepared import PreparedDense, write_tensors

    gen = torch.Generator().manual_seed(5)
    q8 = torch.randint(-127, 128, (4096, 3072), dtype=torch.int8, generator=gen)  # 12 MB
    whole = write_tensors(tmp_path / "d.safetensors", {"a.q": q8, "a.scale": torch.rand(4096, generator=gen)},
                          {"key": "k", "format": "int8"}).read_bytes()
    path = tmp_path / "small-writes.safetensors"
    with open(path, "wb") as f:  # 4 KB writes, as a copy makes: the page cache holds small folios
        for lo in range(0, len(whole), 4096):
            f.write(whole[lo:lo + 4096])
    first = PreparedDense(path)
    a = first.matrix("a", (4096, 3072), resident=True)
    assert torch.equal(a.q, q8)
    if not (host_memory.thp_available() and first.holds(a.q)):
        return  # copied: the file system or kernel keeps small folios here
    recaches = []
    real = host_memory.recache_huge
    monkeypatch.setattr(host_memory, "recache_huge", lambda *args, **kw: recaches.append(1) or real(*args, **kw))
    later = PreparedDense(path)
    b = later.matrix("a", (4096, 3072), resident=True)
    assert later.holds(b.q) and torch.equal(b.q, q8) and recaches == []
