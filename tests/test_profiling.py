"""Profiling: activation counts and stored pairs against a direct count in `transformers`."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

import model_factory
from app.cli import main as cli_main
from engine import Engine
from engine.hotcold.activation_stats import ActivationStats
from engine.errors import UserError
from engine.calibration.profiling import (
    ProfileSettings, corpus_windows, load_pairs, profile, profile_dir, read_profile_state,
)

WINDOW = 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(words // 12):
        lines.append(" ".join(rng.choice(model_factory.WORDS) for _ in range(12)))
    return "\n".join(lines) + "\n"


@pytest.fixture()
def model(tmp_path) -> Path:
    return model_factory.llama_relu(tmp_path / "llama", seed=3)


@pytest.fixture()
def corpus(tmp_path) -> Path:
    path = tmp_path / "calib.txt"
    path.write_text(random_text(0, 600), encoding="utf-8")
    return path


def reference_firing(model_dir: Path, windows: list[list[int]]):
    """Per layer: firing counts, FFN inputs before the norm, and fired masks, from transformers."""
    ref = model_factory.load_reference(model_dir)
    layers = ref.model.layers
    counts = [torch.zeros(ref.config.intermediate_size, dtype=torch.float64) for _ in layers]
    inputs = [[] for _ in layers]
    fired = [[] for _ in layers]

    def hooks(i, layer):
        def pre_norm(_module, args):
            inputs[i].append(args[0][0].detach().clone())

        def mlp(module, args, _out):
            x = args[0][0]
            act = torch.relu(module.gate_proj(x)) * module.up_proj(x)
            counts[i] += (act != 0).sum(0).double()
            fired[i].append(act != 0)

        return (layer.post_attention_layernorm.register_forward_pre_hook(pre_norm),
                layer.mlp.register_forward_hook(mlp))

    handles = [h for i, layer in enumerate(layers) for h in hooks(i, layer)]
    with torch.no_grad():
        for ids in windows:
            ref(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return counts, [torch.cat(x) for x in inputs], [torch.cat(f) for f in fired]


def test_counts_and_pairs_equal_a_direct_count(model, corpus):
    engine = Engine.load(model, ctx=WINDOW)
    settings = ProfileSettings(max_tokens=400, window=WINDOW, shard_bytes=4096, checkpoint_every=3)
    result = profile(engine, [corpus], settings)
    windows = corpus_windows(engine.tokenizer, corpus.read_text(), WINDOW, 400)
    assert result.tokens == sum(map(len, windows)) == 400

    ref_counts, ref_inputs, ref_fired = reference_firing(model, windows)
    stats = ActivationStats.load(model)
    assert stats.tokens == 400
    for layer, ref in enumerate(ref_counts):
        ours = stats.counts[layer]
        assert ours.dtype == torch.float64 and ours.shape == ref.shape
        # Exact up to neurons whose gate sits within rounding of 0 in one of the two paths.
        assert float((ours - ref).abs().sum()) <= 0.001 * float(ref.sum())
        x, labels = load_pairs(model, layer)
        assert x.shape == ref_inputs[layer].shape
        torch.testing.assert_close(x, ref_inputs[layer], rtol=2e-3, atol=2e-3)  # stored as fp16
        assert (labels != ref_fired[layer]).float().mean() < 0.001
        assert len(list((profile_dir(model) / f"layer_{layer:03d}").glob("shard_*"))) > 1
    expected = [1 - float(c.sum()) / (400 * engine.config.n_ff) for c in ref_counts]
    assert result.sparsity == pytest.approx(expected, abs=1e-3)


def test_pairs_stay_under_the_size_cap(model, corpus):
    engine = Engine.load(model, ctx=WINDOW)
    cap = 20_000
    result = profile(engine, [corpus], ProfileSettings(max_tokens=400, window=WINDOW, max_pairs_bytes=cap,
                                                       shard_bytes=4096))
    assert 0 < result.pair_bytes <= cap
    on_disk = sum(p.stat().st_size for p in profile_dir(model).rglob("shard_*.safetensors"))
    assert on_disk <= cap + 2_000 * len(result.pair_rows)  # safetensors headers
    stats = ActivationStats.load(model)
    assert stats.tokens == 400  # counting goes on after the pairs are full


class Interrupt(Exception):
    pass


def test_an_interrupted_profile_resumes_to_the_same_result(model, corpus, tmp_path):
    settings = ProfileSettings(max_tokens=400, window=WINDOW, shard_bytes=4096, checkpoint_every=2)
    engine = Engine.load(model, ctx=WINDOW)

    def stop_after_five(fraction, _text, calls=[0]):
        calls[0] += 1
        if calls[0] == 5:
            raise Interrupt

    with pytest.raises(Interrupt):
        profile(engine, [corpus], settings, progress=stop_after_five)
    state = read_profile_state(model)
    assert state["windows_done"] == 4 and not state["complete"]  # the last checkpoint

    result = profile(engine, [corpus], settings)
    assert result.resumed_from_tokens == 4 * WINDOW  # last checkpoint: 4 windows
    resumed = ActivationStats.load(model)
    x_resumed, y_resumed = load_pairs(model, 1)

    fresh = model_factory.llama_relu(tmp_path / "fresh", seed=3)
    profile(Engine.load(fresh, ctx=WINDOW), [corpus], settings)
    straight = ActivationStats.load(fresh)
    for a, b in zip(resumed.counts, straight.counts):
        assert torch.equal(a, b)
    x_fresh, y_fresh = load_pairs(fresh, 1)
    assert torch.equal(x_resumed, x_fresh) and torch.equal(y_resumed, y_fresh)


def test_other_text_starts_a_new_profile(model, corpus, tmp_path):
    engine = Engine.load(model, ctx=WINDOW)
    settings = ProfileSettings(max_tokens=200, window=WINDOW)
    profile(engine, [corpus], settings)
    other = tmp_path / "other.txt"
    other.write_text(random_text(1, 600), encoding="utf-8")
    result = profile(engine, [other], settings)
    assert result.resumed_from_tokens == 0 and ActivationStats.load(model).tokens == 200


def test_corpus_windows_pack_paragraphs_up_to_the_budget(model):
    tok = Engine.load(model, ctx=WINDOW).tokenizer
    text = random_text(2, 400)
    windows = corpus_windows(tok, text, 32, 150)
    assert sum(map(len, windows)) == 150
    assert all(len(w) == 32 for w in windows[:-1]) and len(windows[-1]) <= 32
    flat = [i for w in windows for i in w]
    expected = [i for line in text.split("\n") if line.strip() for i in tok.encode(line)][:150]
    assert flat == expected


def test_bad_input_is_a_user_error(model, tmp_path):
    engine = Engine.load(model, ctx=WINDOW)
    fits = ProfileSettings(window=WINDOW)
    with pytest.raises(UserError, match="does not exist"):
        profile(engine, [tmp_path / "missing.txt"], fits)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(UserError, match="empty"):
        profile(engine, [empty], fits)
    with pytest.raises(UserError, match="context"):
        profile(engine, [empty], ProfileSettings(window=WINDOW * 2))


def test_cli_profile_reports_json_and_errors(model, corpus, capsys):
    code = cli_main(["profile", "--model", str(model), "--corpus", str(corpus), "--max-tokens", "100",
                     "--window", str(WINDOW), "--max-pairs-bytes", "1MiB", "--json"])
    assert code == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 100 and len(report["sparsity"]) == 2
    assert np.isclose(report["mean_sparsity"], np.mean(report["sparsity"]))

    code = cli_main(["profile", "--model", str(model), "--corpus", "/nonexistent/text.txt"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: corpus file")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["profile", "--model", str(model), "--corpus", str(corpus), "--max-pairs-bytes", "12XB"])
    assert exit_info.value.code == 2
    assert "cannot read size '12XB'" in capsys.readouterr().err
