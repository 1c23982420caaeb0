"""FakeTensorMode's common uses, each run under FakeTensorMode and MetaMode.

Every usage returns a small summary (shapes, devices, flags); both modes must
produce the one written next to it, so FakeTensorMode is the reference.
"""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import metadispatch as md

MODES = {
    "fake": lambda: FakeTensorMode(allow_non_fake_inputs=True),
    "meta": lambda: md.MetaMode(allow_non_fake_inputs=True),
}


def _shape(t):
    return tuple(t.shape)


def construct_module(mode):
    with mode:
        lin = nn.Linear(4, 3)
        y = lin(torch.empty(2, 4))
    return _shape(y), str(lin.weight.device), lin.weight.requires_grad


def run_outside_the_mode(mode):
    with mode:
        lin = nn.Linear(4, 3)
        x = torch.empty(2, 4)
    return _shape(lin(x))


def from_tensor(mode):
    real = torch.ones(2, 3)
    t = mode.from_tensor(real)
    with mode:
        y = t * 2
    return _shape(y), mode.from_tensor(real) is t, t is not real, real.sum().item()


def mix_real_and_meta(mode):
    real = torch.ones(3, 5)
    with mode:
        y = torch.empty(2, 3) @ real
    return _shape(y), str(y.device)


def functional_call(mode):
    with mode:
        lin = nn.Linear(4, 3)
        params = {k: torch.empty_like(v) for k, v in lin.named_parameters()}
        y = torch.func.functional_call(lin, params, (torch.empty(2, 4),))
    return _shape(y)


def func_transforms(mode):
    f = lambda x: x.sin().sum()  # noqa: E731
    with mode:
        x = torch.empty(3)
        return (
            _shape(torch.func.grad(f)(x)),
            _shape(torch.func.vmap(torch.sin)(torch.empty(5, 3))),
            _shape(torch.func.jacrev(torch.sin)(x)),
            _shape(torch.func.jacfwd(torch.sin)(x)),
            _shape(torch.func.hessian(f)(x)),
            _shape(torch.func.vjp(torch.sin, x)[1](x)[0]),
        )


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def nn_parametrize(mode):
    with mode:
        lin = nn.Linear(3, 3)
        parametrize.register_parametrization(lin, "weight", _Symmetric())
        y = lin(torch.empty(2, 3))
        y.sum().backward()
    return _shape(y), parametrize.is_parametrized(lin, "weight"), _shape(lin.parametrizations.weight.original.grad)


def autograd_grad(mode):
    with mode:
        x = torch.empty(3, requires_grad=True)
        y = (x.sin() * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
    return _shape(g), g.requires_grad, _shape(gg)


def checkpointed(mode, reentrant):
    with mode:
        lin = nn.Linear(3, 3)
        x = torch.empty(2, 3, requires_grad=True)
        y = checkpoint(lambda x: lin(x).relu(), x, use_reentrant=reentrant)
        y.sum().backward()
    return _shape(x.grad), _shape(lin.weight.grad), str(x.grad.device)


def inference_mode_and_no_grad(mode):
    with mode:
        x = torch.empty(3, requires_grad=True)
        with torch.inference_mode():
            a = x * 2
        with torch.no_grad():
            b = x * 2
        c = x * 2
    with torch.inference_mode(), mode:
        d = torch.empty(3) + 1
    return (a.requires_grad, a.is_inference(), b.requires_grad, b.is_inference(), c.requires_grad, d.is_inference())


def nested_device_contexts(mode):
    with mode, torch.device("cuda"):
        a = torch.empty(2)
        with torch.device("cpu"):
            b = torch.empty(2)
            with torch.device("cuda:1"):
                c = torch.empty(2)
        d = torch.empty(2) + 1
    return str(a.device), str(b.device), str(c.device), str(d.device)


USAGES = {
    "construct_module": (construct_module, ((2, 3), "cpu", True)),
    "run_outside_the_mode": (run_outside_the_mode, (2, 3)),
    "from_tensor": (from_tensor, ((2, 3), True, True, 6.0)),
    "mix_real_and_meta": (mix_real_and_meta, ((2, 5), "cpu")),
    "functional_call": (functional_call, (2, 3)),
    "func_transforms": (func_transforms, ((3,), (5, 3), (3, 3), (3, 3), (3, 3), (3,))),
    "nn_parametrize": (nn_parametrize, ((2, 3), True, (3, 3))),
    "autograd_grad": (autograd_grad, ((3,), True, (3,))),
    "checkpoint_reentrant": (lambda m: checkpointed(m, True), ((2, 3), (3, 3), "cpu")),
    "checkpoint_non_reentrant": (lambda m: checkpointed(m, False), ((2, 3), (3, 3), "cpu")),
    "inference_mode_and_no_grad": (inference_mode_and_no_grad, (False, True, False, False, True, True)),
    "nested_device_contexts": (nested_device_contexts, ("cuda:0", "cpu", "cuda:1", "cuda:0")),
}


@pytest.mark.parametrize("mode_name", MODES)
@pytest.mark.parametrize("usage", USAGES)
def test_fake_compat_usage_matches_fake_tensor_mode(usage, mode_name):
    fn, expected = USAGES[usage]
    assert fn(MODES[mode_name]()) == expected


@pytest.mark.parametrize("reentrant", [True, False])
def test_fake_compat_checkpoint_recompute_is_marked(reentrant):
    mode = md.MetaMode()
    checkpointed(mode, reentrant)
    recomputed = [c.op for c in mode.trace if c.note == "recompute"]
    assert {"aten.addmm.default", "aten.relu.default"} <= set(recomputed)
    assert all(c.phase == "backward" for c in mode.trace if c.note == "recompute")
    assert "<recompute>" in str(mode.trace)


# Autograd on "cuda" FakeTensors aborts the process on a host without CUDA
# (it asks for a CUDA device guard), so these two are MetaMode's alone.
@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph")
def test_fake_compat_create_graph_backward_keeps_logical_device():
    with md.MetaMode(device="cuda"):
        x = torch.empty(3, requires_grad=True)
        (x.sin() * x).sum().backward(create_graph=True)
    assert x.grad.device == torch.device("cuda", 0)


def test_fake_compat_hessian_keeps_logical_device():
    with md.MetaMode(), torch.device("cuda"):
        h = torch.func.hessian(lambda x: x.sin().sum())(torch.empty(3))
    assert h.device == torch.device("cuda", 0)


def test_fake_compat_explicit_to_meta_is_meta():
    with md.MetaMode(device="cuda"):
        y = torch.empty(3).to("meta")
    assert y.device == torch.device("meta")


@pytest.mark.parametrize(
    "options",
    [
        {"static_shapes": False},
        {"shape_env": object()},
        {"allow_non_fake_inputs": False},
        {"allow_fallback_kernels": True},
        {"propagate_real_tensors": True},
        {"export": True},
    ],
)
def test_fake_compat_unsupported_mode_option_raises(options):
    (name,) = options
    with pytest.raises(md.UnsupportedFeatureError, match=f"MetaMode\\({name}="):
        md.MetaMode(**options)


def test_fake_compat_unsupported_from_tensor_option_raises():
    mode = md.MetaMode()
    with pytest.raises(md.UnsupportedFeatureError, match="static shapes only"):
        mode.from_tensor(torch.ones(2), symbolic_context=object())
    assert mode.from_tensor(torch.ones(2), static_shapes=True, source=None).shape == (2,)


def test_fake_compat_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        md.MetaMode(colour="blue")
