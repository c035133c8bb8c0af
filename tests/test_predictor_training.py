"""Predictor training: thresholds, ranks, learning on a tiny model, resuming, CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

import model_factory
from app.cli import main as cli_main
from engine import Engine
from engine.errors import UserError
from engine.calibration.predictor_training import (
    TrainSettings, auto_rank, choose_threshold, firing_skew, prediction_metrics, train_predictors,
)
from engine.loading.predictors import PredictorSet
from engine.calibration.profiling import ProfileSettings, load_pairs, profile

WINDOW = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_threshold_is_the_sparsest_that_keeps_the_target_recall():
    gen = torch.Generator().manual_seed(0)
    labels = torch.rand(400, 50, generator=gen) < 0.2
    logits = torch.randn(400, 50, generator=gen) + 1.5 * labels
    for target in (0.5, 0.9, 0.95, 1.0):
        t = choose_threshold(logits, labels, target)
        assert prediction_metrics(logits, labels, t)["recall"] >= target
        # any higher threshold (the next larger logit) loses recall below the target
        higher = logits[logits > t].min()
        assert prediction_metrics(logits, labels, float(higher))["recall"] < target


def test_metrics_on_a_known_case():
    labels = torch.tensor([[True, False, False, True]])
    logits = torch.tensor([[2.0, 1.0, -1.0, -2.0]])
    m = prediction_metrics(logits, labels, 0.5)
    assert m == pytest.approx({"recall": 0.5, "precision": 0.5, "actual_sparsity": 0.5,
                               "predicted_sparsity": 0.5})


def test_rank_shrinks_with_sparsity_and_skew():
    dense, sparse = auto_rank(4096, 11008, 0.6, 0.2), auto_rank(4096, 11008, 0.95, 0.2)
    assert sparse < dense <= 1024
    assert auto_rank(4096, 11008, 0.9, 0.8) < auto_rank(4096, 11008, 0.9, 0.1)
    assert all(auto_rank(4096, 11008, s, k) % 16 == 0 for s in (0.5, 0.9, 0.99) for k in (0, 0.5, 1))
    assert all(128 <= auto_rank(4096, 11008, s, k) for s in (0.5, 0.9, 0.999) for k in (0, 1))
    assert auto_rank(256, 1024, 0.95, 0.5) == 128  # the floor
    assert auto_rank(32, 64, 0.99, 1.0) == 32  # never above min(d, n_ff)


def test_skew_of_uniform_and_concentrated_firing():
    assert firing_skew(torch.ones(100, dtype=torch.float64)) == pytest.approx(0.0)
    hot = torch.zeros(100, dtype=torch.float64)
    hot[:10] = 50
    assert firing_skew(hot) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("pred")
    model = model_factory.llama_relu(root / "llama", seed=5)
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(model_factory.WORDS) for _ in range(16)) for _ in range(300))
    (root / "calib.txt").write_text(text, encoding="utf-8")
    profile(Engine.load(model, ctx=WINDOW), [root / "calib.txt"],
            ProfileSettings(max_tokens=1500, window=WINDOW))
    return model


def test_training_reaches_the_recall_target_and_predicts_real_sparsity(profiled):
    # The FFN input decides firing through a linear map, so a rank of 2d can represent it.
    settings = TrainSettings(target_recall=0.9, rank=128, epochs=15, lr=1e-2, seed=0)
    reports = train_predictors(profiled, settings, restart=True)
    assert len(reports) == 2
    for r in reports:
        assert r.recall >= 0.9
        assert r.precision >= 0.8  # learned, not "everything fires"
        assert r.predicted_sparsity >= r.actual_sparsity - 0.1
    # The saved predictors reproduce the figures on the stored pairs.
    preds = PredictorSet.load(profiled)
    assert preds.source == "thermocline" and len(preds.fc1) == 2
    for layer, r in enumerate(reports):
        assert preds.fc1[layer].shape == (128, 64) and preds.fc2[layer].shape == (160, 128)
        assert preds.thresholds[layer] == pytest.approx(r.threshold)
        x, labels = load_pairs(profiled, layer)
        m = prediction_metrics(preds.logits(layer, x), labels, preds.thresholds[layer])
        assert m["recall"] >= 0.85  # all rows, of which 90 % were trained on


def test_finished_layers_are_not_trained_again(profiled, monkeypatch):
    settings = TrainSettings(target_recall=0.9, rank=32, epochs=2, seed=1)
    first = train_predictors(profiled, settings, restart=True)

    def refuse(*_args, **_kwargs):
        raise AssertionError("a finished layer was trained again")

    monkeypatch.setattr("engine.calibration.predictor_training.train_layer", refuse)
    again = train_predictors(profiled, settings)
    assert [r.to_dict() for r in again] == [r.to_dict() for r in first]
    with pytest.raises(AssertionError, match="trained again"):
        train_predictors(profiled, TrainSettings(target_recall=0.8, rank=32, epochs=2, seed=1))


def test_auto_rank_is_used_per_layer(profiled):
    reports = train_predictors(profiled, TrainSettings(epochs=1), restart=True)
    assert all(r.rank == 64 for r in reports)  # d = 64 bounds the rank


def test_without_a_profile_is_a_user_error(tmp_path, capsys):
    model = model_factory.llama_relu(tmp_path / "bare", seed=6)
    with pytest.raises(UserError, match="profile"):
        train_predictors(model)
    assert cli_main(["train-predictors", "--model", str(model)]) == 2
    assert "thermocline profile" in capsys.readouterr().err
    assert cli_main(["train-predictors", "--model", str(model), "--rank", "zero"]) == 2


def test_cli_reports_per_layer_json(profiled, capsys):
    code = cli_main(["train-predictors", "--model", str(profiled), "--target-recall", "0.9",
                     "--rank", "32", "--epochs", "3", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    layers = report["layers"]
    assert [entry["layer"] for entry in layers] == [0, 1]
    for entry in layers:
        assert entry["recall"] >= 0.9 and entry["rank"] == 32
        assert {"precision", "actual_sparsity", "predicted_sparsity", "threshold"} <= set(entry)
