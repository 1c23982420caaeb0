"""Legitimate models' saved traces still load and replay with the value checks in place.

Replay of a loaded trace checks the values and shapes of every call whose
kernel would follow them (trust/positions.py); a real model's embeddings,
pooling indices, losses' targets, packed weights of oneDNN's LSTM and norms'
statistics must pass.  Each configuration is traced, saved, loaded and
replayed from the file, and must give exactly what replaying the trace it
was recorded as gives: the same verdict, bit-equal outputs and gradients.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import metadispatch as md
from metadispatch.cli.llama import LlamaConfig, build
from tests.position_traces import bitwise
from tools import model_conformance as zoo

_CONFIGS = [
    "nn.lstm",
    "nn.gru",
    "nn.mha",
    "nn.transformer",
    "nn.conv3d",
    "nn.embedding_bag",
    "nn.convnet_channels_last",
    "hf.gpt2",
    "hf.bert",
    "tv.resnet18",
    "timm.resnet18",
]


def _same(trusted, loaded) -> bool:
    return (
        trusted.ok == loaded.ok
        and [m.index for m in trusted.mismatches] == [m.index for m in loaded.mismatches]
        and bitwise(trusted.output, loaded.output)
        and trusted.grads.keys() == loaded.grads.keys()
        and all(bitwise(trusted.grads[k], loaded.grads[k]) for k in trusted.grads)
    )


@pytest.mark.slow  # traces and replays a model twice
@pytest.mark.parametrize("name", _CONFIGS)
def test_positions_models_saved_trace_replays_as_the_trace_it_was(tmp_path, name):
    config = zoo.CONFIGS[name]
    if config.needs and importlib.util.find_spec(config.needs) is None:
        pytest.skip(f"{config.needs} is not installed")
    torch.manual_seed(0)
    model, inputs = config.build()
    trace = md.trace(zoo._step(config), model, *inputs)
    trace.save(tmp_path / "t.json.gz")
    loaded = md.Trace.load(tmp_path / "t.json.gz")
    assert _same(md.replay(trace, (model, *inputs)), md.replay(loaded, (model, *inputs)))


@pytest.mark.slow  # traces and replays a model twice
def test_positions_models_builtin_llama_saved_trace_replays_ok(tmp_path):
    torch.manual_seed(0)
    model, (ids, labels) = build(LlamaConfig.tiny(), batch=2, seq=16, dtype=torch.float32)
    trace = md.trace(lambda m, x, y: m(x, labels=y).backward(), model, ids, labels)
    trace.save(tmp_path / "llama.json.gz")
    loaded = md.Trace.load(tmp_path / "llama.json.gz")
    trusted, from_file = md.replay(trace, (model, ids, labels)), md.replay(loaded, (model, ids, labels))
    assert from_file.ok and _same(trusted, from_file)
    ops = {c.op for c in loaded.calls}
    assert {"aten.embedding.default", "aten.embedding_dense_backward.default", "aten.nll_loss_backward.default"} <= ops
