"""CATS: the opt-in sparse mode of a SiLU (SwiGLU) model, end to end on a tiny Llama.

`profile --target-sparsity` calibrates per-layer thresholds on |SiLU(gate)| (each layer's
quantile on the calibration text), profiles the thresholded model, `train-predictors`
learns its firing, the sparse modes load the thresholds, and `eval` reports dense (the
model itself), oracle (exactly the thresholded model) and sparse (the predictors' choice).
The thresholded FFN is checked against a torch computation from the definition.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

import model_factory
from app.cli import main as cli_main
from engine import Engine
from engine.config import CATS_RECORD, read_cats
from engine.errors import UserError
from engine.calibration.evaluation import EvalSettings, evaluate
from engine.calibration.predictor_training import TrainSettings, train_predictors
from engine.calibration.profiling import ProfileSettings, profile

WINDOW = 64
TARGET = 0.5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def text(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(model_factory.WORDS) for _ in range(16)) for _ in range(lines))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("cats")
    model = model_factory.llama_relu(root / "swiglu", seed=11, act="silu")
    (root / "calib.txt").write_text(text(0, 200), encoding="utf-8")
    (root / "heldout.txt").write_text(text(1, 40), encoding="utf-8")
    result = profile(Engine.load(model, ctx=WINDOW), [root / "calib.txt"],
                     ProfileSettings(max_tokens=1200, window=WINDOW, target_sparsity=TARGET))
    return model, root, result


def test_profile_calibrates_each_layers_threshold_to_the_target(calibrated):
    model, _, result = calibrated
    cats = read_cats(model, 2)
    assert cats["target_sparsity"] == TARGET and all(t > 0 for t in cats["thresholds"])
    # the profile proper counted the thresholded model's firing: about the target on that text
    assert all(abs(s - TARGET) < 0.03 for s in result.sparsity), result.sparsity


def test_dense_mode_stays_the_model_and_the_sparse_modes_take_the_thresholds(calibrated):
    model, root, _ = calibrated
    with pytest.raises(UserError, match="predictors"):  # no predictors yet: the sparse modes need them
        Engine.load(model, mode="sparse", ctx=WINDOW)
    dense = Engine.load(model, ctx=WINDOW)
    assert all(layer.ffn.threshold == 0.0 for layer in dense.model.layers)
    train_predictors(model, TrainSettings(target_recall=0.95, rank=64, epochs=10, lr=1e-2))
    engine = Engine.load(model, mode="oracle", ctx=WINDOW, cpu_weights="fp32")
    thresholds = read_cats(model, 2)["thresholds"]
    assert [layer.ffn.threshold for layer in engine.model.layers] == list(thresholds)

    # oracle = the thresholded SwiGLU, computed here from its definition on the dense model's weights
    ids = dense.tokenizer.encode(text(5, 3))[:WINDOW]
    seen = {}
    engine.model.ffn_observer = lambda layer, pred_input, act: seen.setdefault(layer, (pred_input, act))
    engine.score(ids, "oracle")
    engine.model.ffn_observer = None
    h, act = seen[0]  # layer 0's FFN input before its norm, and its activations
    ffn0 = dense.model.layers[0].ffn
    x = dense.model.layers[0].mlp_norm(h)
    gate, up = F.linear(x, ffn0.gate).double(), F.linear(x, ffn0.up).double()
    s = F.silu(gate)
    expected = torch.where(s.abs() < thresholds[0], torch.zeros_like(s), s) * up
    torch.testing.assert_close(act.double(), expected, rtol=1e-4, atol=1e-5)
    assert 0.4 < float((expected == 0).double().mean()) < 0.6


def test_eval_reports_dense_oracle_and_sparse_against_the_model(calibrated, capsys):
    model, root, _ = calibrated
    if not (model / "thermocline" / "predictors.safetensors").is_file():
        train_predictors(model, TrainSettings(target_recall=0.95, rank=64, epochs=10, lr=1e-2))
    engine = Engine.load(model, mode="sparse", ctx=WINDOW, cpu_weights="fp32")
    report = evaluate(engine, [root / "heldout.txt"], EvalSettings(max_tokens=300, window=WINDOW))
    assert report["cats"] is True
    plain = Engine.load(model, ctx=WINDOW)  # dense: the model without thresholds
    nll = n = 0
    from engine.calibration.profiling import corpus_windows, read_corpus

    for ids in corpus_windows(plain.tokenizer, read_corpus([root / "heldout.txt"]), WINDOW, 300):
        nll += float(F.cross_entropy(plain.score(ids)[:-1], torch.tensor(ids[1:]), reduction="sum"))
        n += len(ids) - 1
    assert report["ppl_dense"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    # the thresholds change the model (little: a random tiny model's output is near uniform)
    assert abs(report["ppl_oracle"] / report["ppl_dense"] - 1) > 1e-5, report
    assert 0.4 < report["sparsity"] < 0.6 and report["recall"] > 0.8
    # the command line: the same figures as JSON
    assert cli_main(["eval", "--model", str(model), "--corpus", str(root / "heldout.txt"), "--max-tokens", "300",
                     "--window", str(WINDOW), "--cpu-weights", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cats"] is True and out["ppl_dense"] == pytest.approx(report["ppl_dense"], rel=1e-6)


def test_refusals(calibrated, tmp_path):
    model, root, _ = calibrated
    with pytest.raises(UserError, match="target-sparsity"):  # a SiLU model profiled without a target
        profile(Engine.load(model, ctx=WINDOW), [root / "calib.txt"], ProfileSettings(max_tokens=200, window=WINDOW))
    relu = model_factory.llama_relu(tmp_path / "relu", seed=2)
    with pytest.raises(UserError, match="own zeros"):
        profile(Engine.load(relu, ctx=WINDOW), [root / "calib.txt"],
                ProfileSettings(max_tokens=200, window=WINDOW, target_sparsity=0.5))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / CATS_RECORD).parent.mkdir(parents=True)
    (tmp_path / "broken" / CATS_RECORD).write_text('{"thresholds": [1.0], "target_sparsity": 0.5}')
    with pytest.raises(Exception, match="1 thresholds for 2 layers"):
        read_cats(tmp_path / "broken", 2)
