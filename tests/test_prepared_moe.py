"""The MoE prepared layout (issue #30): the first int8/int4 load of a mixture writes its
experts in that format (`prepared-<fmt>-moe.safetensors`) beside the dense prepared file;
later loads map both, read nothing from the checkpoint but its headers, convert nothing,
and compute the first load's numbers bit for bit. A cut or damaged file is rebuilt; a load
killed while writing leaves nothing that a later load takes for a prepared file."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import model_factory as mf
import smallthinker_factory as sf
import turbosparse_mixtral_factory as tf
from engine import Engine, SamplingParams
from engine.hotcold import moe_tiers
from engine.kernels.quantized import Int8Matrix, Q4Matrix
from engine.loading.prepared import DISABLE_ENV, dense_path
from engine.loading.prepared_moe import PreparedExperts, moe_path
from engine.loading.weights import WeightSource
from engine.model.expert_stack import ExpertStack

PROMPT = [3, 5, 9, 17, 33, 100, 7, 8, 250, 4, 42, 61, 90]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0)
BIG = 1 << 40
FAMILIES = {"smallthinker": lambda p: sf.smallthinker(p, seed=1, layers=3),
            "turbosparsemixtral": lambda p: tf.turbosparse_mixtral(p, seed=2)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One pristine tiny model per family (copied per test, so files written stay local)."""
    root = tmp_path_factory.mktemp("moe_prepared")
    return {name: make(root / name) for name, make in FAMILIES.items()}


def _copy(built, family: str, tmp_path: Path) -> Path:
    model = tmp_path / family
    shutil.copytree(built[family], model)
    return model


def _load(model: Path, fmt: str, **kw) -> Engine:
    engine = Engine.load(model, mode="sparse", vram_budget=0, ram_budget=BIG, cpu_weights=fmt, **kw)
    engine.eos_ids = set()
    return engine


def _numbers(engine: Engine) -> tuple[torch.Tensor, list[int]]:
    """Prefill logits (the batched path) and greedy tokens (the one-token decode path)."""
    logits = engine.score(PROMPT, "sparse")
    engine.reset()
    return logits, engine.generate(PROMPT, GREEDY).token_ids


def _reference(model: Path, fmt: str, monkeypatch) -> tuple[torch.Tensor, list[int]]:
    """The numbers of a load that neither reads nor writes prepared files."""
    with monkeypatch.context() as m:
        m.setenv(DISABLE_ENV, "1")
        engine = _load(model, fmt)
        assert engine.sparse.prepared_experts is None and not moe_path(model, fmt).exists()
        return _numbers(engine)


def _mapped(engine: Engine) -> bool:
    """Every layer's cold experts, their predictors, the routers, attention and head are
    views of the two prepared files."""
    experts, dense = engine.sparse.prepared_experts, engine.sparse.prepared_dense
    if experts is None or dense is None:
        return False
    model = engine.model
    for layer in model.layers:
        cold = layer.ffn.cold
        if cold.stack is None or len(cold) != engine.config.num_experts:
            return False
        rows = [t for r in cold.rows.values() for t in (r.gate, r.up, r.down_t)]
        if layer.ffn.predictors is not None:
            rows += [m.q for m in (*layer.ffn.predictors.fc1, *layer.ffn.predictors.fc2)]
        if not all(experts.holds(t) for t in rows):
            return False
        if not all(dense.holds(t) for t in (layer.router.q, layer.qkv.q, layer.out.q, layer.attn_norm.weight)):
            return False
    return dense.holds(model.lm_head.q) and dense.holds(model.embed)


def _no_conversion(m) -> list[str]:
    """Patch every way a load reads the checkpoint's values or converts a tensor into the
    CPU format; returns the list the calls are recorded in (they also raise)."""
    calls: list[str] = []

    def refuse(what):
        def call(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"the second load called {what}")
        return call

    m.setattr(WeightSource, "get", refuse("WeightSource.get"))
    m.setattr(ExpertStack, "quantize", classmethod(refuse("ExpertStack.quantize")))
    m.setattr(Int8Matrix, "quantize", classmethod(refuse("Int8Matrix.quantize")))
    m.setattr(Q4Matrix, "quantize", classmethod(refuse("Q4Matrix.quantize")))
    m.setattr(moe_tiers, "cold_rows_from_dense", refuse("cold_rows_from_dense"))
    return calls


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_second_load_maps_converts_nothing_and_computes_the_same(built, tmp_path, monkeypatch, family, fmt):
    model = _copy(built, family, tmp_path)
    ref_logits, ref_ids = _reference(model, fmt, monkeypatch)
    steps = []
    first = _load(model, fmt, progress=lambda f, text: steps.append(text))
    assert any("experts, first load only" in s for s in steps)
    assert moe_path(model, fmt).is_file() and dense_path(model, fmt).is_file()
    # the first load ends on the written file's views (its own quantized stacks freed)
    assert all(first.sparse.prepared_experts.holds(layer.ffn.cold.stack.up) for layer in first.model.layers)
    with monkeypatch.context() as m:
        calls = _no_conversion(m)
        second = _load(model, fmt)
    assert calls == [] and _mapped(second)
    if family == "turbosparsemixtral":
        assert all(layer.ffn.predictors is not None for layer in second.model.layers)
    for engine in (first, second):
        logits, ids = _numbers(engine)
        assert torch.equal(logits, ref_logits) and ids == ref_ids
        # what the placement planned is what the engine holds (views counted once, by their bytes)
        assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


def _junk_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"not json, not anything at all..."
    path.write_bytes(bytes(data))


def _lying_shape(path: Path) -> None:
    def swap(header):  # layer 0's up rows claim [n, E, ...]: the same bytes, not this model's shape
        name = "layers.0.experts.up"
        header[name]["shape"] = [header[name]["shape"][1], header[name]["shape"][0], *header[name]["shape"][2:]]
        return header

    mf.rewrite_safetensors_header(path, path, swap)


@pytest.mark.parametrize("damage", [_truncate, _junk_header, _lying_shape, lambda p: p.write_bytes(b"")],
                         ids=["cut", "junk-header", "lying-shape", "empty"])
def test_a_cut_or_damaged_experts_file_is_rebuilt(built, tmp_path, monkeypatch, damage):
    model = _copy(built, "smallthinker", tmp_path)
    ref_logits, ref_ids = _reference(model, "int8", monkeypatch)
    _load(model, "int8")
    path = moe_path(model, "int8")
    # damaged in a copy renamed over it: the engine loaded above may still map the file (its
    # kernel warm-up thread), and a mapped file cut in place faults its reader (SIGBUS)
    copy = path.with_name("damaged")
    shutil.copyfile(path, copy)
    damage(copy)
    os.replace(copy, path)
    before = path.stat().st_mtime_ns
    rebuilt = _load(model, "int8")
    assert path.stat().st_mtime_ns != before
    assert PreparedExperts.open_if_current(model, "int8", rebuilt.config, None) is not None
    again = _load(model, "int8")
    assert _mapped(again)
    for engine in (rebuilt, again):
        logits, ids = _numbers(engine)
        assert torch.equal(logits, ref_logits) and ids == ref_ids


def test_a_load_killed_while_writing_leaves_nothing_to_heal(built, tmp_path, monkeypatch):
    """kill -9 in the middle of the experts' write: no prepared experts file appears (only
    the dead writer's partial, which the next writer removes), and the next load prepares
    the model from scratch and computes the same numbers."""
    model = _copy(built, "smallthinker", tmp_path)
    ref_logits, ref_ids = _reference(model, "int4", monkeypatch)
    script = textwrap.dedent(f"""
        import os, signal
        from engine import Engine

        def progress(fraction, text):
            if text.startswith("preparing layer 2 "):  # layer 1 written, layer 2 not
                os.kill(os.getpid(), signal.SIGKILL)

        Engine.load({str(model)!r}, mode="sparse", vram_budget=0, ram_budget={BIG}, cpu_weights="int4",
                    progress=progress)
        raise SystemExit("the load was not killed")
    """)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    path = moe_path(model, "int4")
    partials = list(path.parent.glob(f"{path.stem}.*.partial"))
    assert not path.exists() and len(partials) == 1 and partials[0].stat().st_size > 0
    engine = _load(model, "int4")
    assert not partials[0].exists() and path.is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, dense_path(model, "int4").name])
    again = _load(model, "int4")
    assert _mapped(again)
    for e in (engine, again):
        logits, ids = _numbers(e)
        assert torch.equal(logits, ref_logits) and ids == ref_ids


def test_layers_with_hot_experts_read_the_checkpoint_and_agree_with_the_file(built, tmp_path, monkeypatch,
                                                                            one_torch_thread):
    """With experts on the fast tier (the CPU standing in for it), those layers keep the
    checkpoint's precision there and their cold rows are copies of the file's; layers whose
    experts are all cold map them (here with their attention on the fast tier); the numbers
    are those of a load without prepared files."""
    model = _copy(built, "smallthinker", tmp_path)
    _load(model, "int8")  # prepares
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="int8")
    assert _mapped(probe)
    plan = probe.sparse.solve(BIG, BIG)
    vram = plan.tier_bytes["fast_dense"] + plan.tier_bytes["fast_kv"] + 3 * probe.sparse.problem.neuron_fast \
        * probe.sparse.problem.expert_size
    kw = dict(mode="hybrid", vram_budget=vram, ram_budget=BIG, cpu_weights="int8")
    with monkeypatch.context() as m:
        m.setenv(DISABLE_ENV, "1")
        plain = Engine.load(model, **kw)
    hybrid = Engine.load(model, **kw)
    hot_layers = [i for i, ids in enumerate(hybrid.sparse.plan.hot_ids) if len(ids)]
    assert hot_layers and len(hot_layers) < hybrid.config.num_layers
    experts = hybrid.sparse.prepared_experts
    for i, layer in enumerate(hybrid.model.layers):
        cold = layer.ffn.cold
        assert (cold.stack is None) == (i in hot_layers)
        for e, rows in cold.rows.items():
            assert experts.holds(rows.up) == (i not in hot_layers)
            mapped = probe.model.layers[i].ffn.cold.rows[e]
            assert torch.equal(rows.up, mapped.up[cold.neuron_ids[e]])
            assert torch.equal(rows.down_t, mapped.down_t[cold.neuron_ids[e]])
    assert torch.equal(hybrid.score(PROMPT, "hybrid"), plain.score(PROMPT, "hybrid"))
    assert hybrid.memory()["tiers"] == hybrid.sparse.plan.tier_bytes
