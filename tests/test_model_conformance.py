"""A quick subset of tools/model_conformance.py: real model steps on a logical
CPU against the real CPU run -- op sequence, output and gradient metadata,
FLOPs against FlopCounterMode, peak memory against md.LiveStorages."""

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import model_conformance as conformance  # noqa: E402

QUICK = [
    "nn.mha",
    "nn.convnet_channels_last",
    "nn.autocast_convnet",
    "hf.gpt2",
    "tv.resnet18_channels_last",
    "timm.convnext_atto",
]


@pytest.mark.parametrize("name", QUICK)
def test_model_conformance_quick_subset(name):
    needs = conformance.CONFIGS[name].needs
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} not installed")
    row = conformance.check(name)
    expected = {c: "yes" for c in ("traces", "ops", "meta", "flops", "memory", "fake")}
    assert {c: row[c] for c in expected} == expected, row["notes"]


def test_model_conformance_reports_a_mismatch():
    # The LSTM's oneDNN workspace is not modelled: the tool must say so.
    row = conformance.check("nn.lstm")
    assert row["ops"] == "yes" and row["meta"] == "no" and row["memory"].startswith("no")
