"""bench.vs_llamacpp builds its model a layer at a time (32 layers of 7B shapes are 12.9 GB of
fp16, more than a shared host holds beside its other work): the streamed HF shards and f16 GGUF
hold exactly the tensors `make_weights` draws all at once."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from bench.vs_llamacpp import SHAPES, _gguf_order, build, make_weights
from engine.loading.predictors import PredictorSet
from engine.loading.weights import WeightSource


def test_streamed_build_holds_make_weights_tensors(tmp_path):
    shape, layers = SHAPES["smoke"], 3
    files = build(tmp_path, shape, layers, 8, 0.1, 0, quantize=False)
    tensors, fc1s, fc2s = make_weights(shape, layers, 8, 0.1, 0)

    source = WeightSource(files["hf"])
    assert source.names() == set(tensors)
    assert len(list(files["hf"].glob("*.safetensors"))) == layers + 1  # the globals, then one shard a layer
    for name, t in tensors.items():
        assert torch.equal(source.get(name), t), name

    reader = gguf.GGUFReader(str(files["f16"]))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert list(stored) == [gg for gg, _ in _gguf_order(layers)]
    for gg, hf in _gguf_order(layers):
        want = tensors[hf].numpy()
        got = stored[gg]
        assert got.dtype == (np.float32 if want.ndim == 1 else np.float16), gg
        assert np.array_equal(got.reshape(want.shape), want.astype(got.dtype)), gg

    predictors = PredictorSet.load(files["hf"])
    for i in range(layers):
        assert torch.equal(predictors.fc1[i].float(), fc1s[i]) and torch.equal(predictors.fc2[i].float(), fc2s[i])
