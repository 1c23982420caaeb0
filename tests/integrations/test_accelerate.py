"""accelerate: a model built under ``init_empty_weights`` traces as the same model built eagerly.

accelerate is installed in CI's torch 2.14.1 leg only; elsewhere these skip.
"""

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

import metadispatch as md  # noqa: E402


def _build():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def _step(model):
    def step(x):
        model(x).sum().backward()

    return step


def _figures(t):
    return [(c.op, [(o.shape, o.dtype) for o in c.outputs if hasattr(o, "shape")]) for c in t.calls]


def test_init_empty_weights_model_traces_like_an_eager_one():
    with accelerate.init_empty_weights():
        empty = _build()
    assert all(p.device.type == "meta" for p in empty.parameters())
    x = torch.randn(8, 16)
    t = md.tracer(device="cuda")(_step(empty), x)
    ref = md.tracer(device="cuda")(_step(_build()), x)
    assert _figures(t) == _figures(ref)
    assert md.memory(t).peak == md.memory(ref).peak
    # left as it was: on meta, no gradients
    assert all(p.device.type == "meta" and p.grad is None for p in empty.parameters())


def test_init_empty_weights_model_under_metamode_matches_eager_shapes():
    with accelerate.init_empty_weights():
        empty = _build()
    x = torch.randn(8, 16)
    eager = _build()
    out_real = eager(x)
    out_real.sum().backward()
    with md.MetaMode():
        out = empty(x)
        out.sum().backward()
        grads = [(p.grad.shape, p.grad.dtype) for p in empty.parameters()]
    assert (out.shape, out.dtype) == (out_real.shape, out_real.dtype)
    assert grads == [(p.grad.shape, p.grad.dtype) for p in eager.parameters()]
    assert all(p.grad is None for p in empty.parameters())


@pytest.mark.xfail(
    strict=True,
    raises=TypeError,
    reason="accelerate rebuilds each parameter as type(p)(p.to('meta'), **p.__dict__); "
    "a MetaTensor parameter's __dict__ (_is_param, _md) is no constructor's arguments",
)
def test_init_empty_weights_inside_metamode_builds():
    with md.MetaMode(), accelerate.init_empty_weights():
        model = _build()
    assert all(p.device.type == "meta" for p in model.parameters())


def test_materialize_refuses_an_init_empty_weights_model():
    # accelerate throws the initialisers' values away: only a checkpoint can fill it
    with accelerate.init_empty_weights():
        model = _build()
    with pytest.raises(md.MetaDispatchError, match="lie on plain 'meta'.*checkpoint=PATH"):
        md.materialize(model)
