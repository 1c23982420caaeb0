"""Real models run eagerly, bit for bit as before, after being traced on a logical cuda.

Issue 13: tensors a forward caches on plain attributes (torchvision's anchor
cache, rotary caches) must not stay MetaTensors; the next real forward must
give exactly what it gave before the trace, and the state must save.
"""

from __future__ import annotations

import io

import pytest
import torch

import metadispatch as md


def _eager_before_and_after(model, make_inputs, step, raises=None):
    torch.manual_seed(0)
    inputs = make_inputs()
    with torch.no_grad():
        expected = step(model, inputs)
    # after the eager run: a first forward fills lazy attributes (RoIPool's
    # scales), and the anchor generator assigns a new list at every forward
    before = md.testing.snapshot(model, rng=False)
    if raises is None:
        md.tracer(device="cuda")(step, model, inputs)
    else:  # the trace stops part way (the case: the model was left broken)
        with pytest.raises(raises):
            md.tracer(device="cuda")(step, model, inputs)
    after = md.testing.snapshot(model, rng=False)
    assert after.metas == [], after.metas
    assert after == before, before.diff(after)
    with torch.no_grad():
        got = step(model, inputs)
    torch.save(model.state_dict(), io.BytesIO())  # no MetaTensor left in the state
    return expected, got


@pytest.mark.slow  # ~10 s of CPU: a detection model's eager runs and trace
def test_untouched_torchvision_detection_model_runs_eagerly_after_a_cuda_trace():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3
    ).eval()

    def step(m, images):
        return m(images)

    expected, got = _eager_before_and_after(
        model, lambda: [torch.rand(3, 160, 200), torch.rand(3, 180, 150)], step, raises=md.DataDependentError
    )  # box filtering needs values: nonzero
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        assert e.keys() == g.keys()
        for k in e:
            assert type(g[k]) is torch.Tensor and torch.equal(e[k], g[k]), k


def test_untouched_transformers_rotary_model_runs_eagerly_after_a_cuda_trace():
    pytest.importorskip("transformers")
    from tests.replay_cases import VOCAB, llama

    torch.manual_seed(0)
    model = llama().eval()

    def step(m, ids):
        return m(input_ids=ids).logits

    expected, got = _eager_before_and_after(model, lambda: torch.randint(0, VOCAB, (2, 12)), step)
    assert type(got) is torch.Tensor and torch.equal(expected, got)
