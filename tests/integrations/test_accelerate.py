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


class _Scaled(nn.Module):
    """Parameters, and a non-persistent buffer no checkpoint holds."""

    def __init__(self):
        super().__init__()
        self.net = _build()
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 16), persistent=False)

    def forward(self, x):
        return self.net(x * self.scale)


def _both(order: str, build=_Scaled):
    """A model built under MetaMode and init_empty_weights, entered in ``order``."""
    if order == "metamode_outside":
        with md.MetaMode(), accelerate.init_empty_weights():
            return build()
    with accelerate.init_empty_weights(), md.MetaMode():
        return build()


ORDERS = ["metamode_outside", "accelerate_outside"]


@pytest.mark.parametrize("order", ORDERS)
def test_init_empty_weights_with_metamode_builds_what_accelerate_builds(order):
    model = _both(order)
    with accelerate.init_empty_weights():
        eager = _Scaled()
    got = [
        (n, t.shape, t.dtype, t.device, t.requires_grad, isinstance(t, nn.Parameter))
        for n, t in model.state_dict(keep_vars=True).items()
    ]
    want = [
        (n, t.shape, t.dtype, t.device, t.requires_grad, isinstance(t, nn.Parameter))
        for n, t in eager.state_dict(keep_vars=True).items()
    ]
    assert got == want and all(isinstance(p, md.MetaTensor) for p in model.parameters())
    assert model.scale.device == eager.scale.device == torch.device("cpu")  # buffers are built, as accelerate does


@pytest.mark.parametrize("order", ORDERS)
def test_init_empty_weights_with_metamode_traces_like_eager(order):
    model = _both(order)
    x = torch.randn(8, 16)
    t = md.tracer()(_step(model), x)
    with accelerate.init_empty_weights():
        empty = _Scaled()
    for ref in (md.tracer()(_step(empty), x), md.tracer()(_step(_Scaled()), x)):
        assert _figures(t) == _figures(ref)
        assert md.memory(t).peak == md.memory(ref).peak
    assert all(p.grad is None for p in model.parameters())  # given back as it was


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("traced_first", [False, True])
def test_init_empty_weights_with_metamode_materializes_from_a_checkpoint(order, traced_first, tmp_path):
    torch.manual_seed(0)
    eager = _Scaled()
    path = tmp_path / "model.pt"
    torch.save(eager.state_dict(), path)
    model = _both(order)
    if traced_first:  # plan the step, then load
        md.tracer()(_step(model), torch.randn(8, 16))
    md.materialize(model, checkpoint=path)
    loaded = _Scaled()
    loaded.load_state_dict(torch.load(path, weights_only=True))
    for (n, a), (_, b) in zip(
        model.state_dict(keep_vars=True).items(), loaded.state_dict(keep_vars=True).items(), strict=True
    ):
        assert type(a) is type(b) and a.requires_grad == b.requires_grad and torch.equal(a, b), n
    assert torch.equal(model.scale, loaded.scale)  # replayed from the construction trace
    assert str(md.audit(model)) == "ok"
    x = torch.randn(8, 16)
    assert torch.equal(model(x), loaded(x))


def test_init_empty_weights_with_metamode_refuses_materialize_without_a_checkpoint():
    # accelerate moved the parameters to meta: eager has no values for them either
    model = _both("metamode_outside")
    with pytest.raises(md.MetaDispatchError, match="net.0.weight.*meta.*checkpoint=PATH"):
        md.materialize(model)
    assert all(isinstance(p, md.MetaTensor) for p in model.parameters())


def test_materialize_refuses_an_init_empty_weights_model():
    # accelerate throws the initialisers' values away: only a checkpoint can fill it
    with accelerate.init_empty_weights():
        model = _build()
    with pytest.raises(md.MetaDispatchError, match="lie on 'meta'.*checkpoint=PATH"):
        md.materialize(model)
