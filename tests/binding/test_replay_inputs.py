"""Inputs md.replay cannot bind to a trace's leaves are refused, naming them
(binding/inputs.py): the other half of "replay proves or refuses"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metadispatch as md
from metadispatch.errors import ReplayInputError


def _traced_linear():
    model = nn.Sequential(nn.Linear(4, 3))
    x = torch.randn(2, 4)
    return model, x, md.trace(lambda m, x: m(x).sum(), model, x)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda m, x: (m, x.numpy()), r"args\[1\].*numpy.ndarray"),
        (lambda m, x: (m, x.tolist()), r"args\[1\].*got list"),
        (lambda m, x: (m,), r"args\[1\].*not given"),
        (lambda m, x: (m, x, torch.ones(1)), r"args\[2\] was not an argument"),
        (lambda m, x: (nn.Linear(4, 3), x), r"param 0\.weight.*no parameter of that name.*weight, bias"),
        (lambda m, x: (m, md.to_meta(x)), r"arg args\[1\] is a MetaTensor"),
        (lambda m, x: (md.to_meta(m), x), r"param 0\.weight is a MetaTensor"),
    ],
)
def test_replay_refuses_inputs_it_cannot_bind(bad, match):
    model, x, trace = _traced_linear()
    with pytest.raises(ReplayInputError, match=match):
        md.replay(trace, bad(model, x))


def test_replay_refuses_a_module_without_the_traced_grad():
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    trace = md.trace(lambda m, x: m(x).sum().backward(), model, x)
    with pytest.raises(ReplayInputError, match=r"param (weight|bias) had a \.grad"):
        md.replay(trace, (nn.Linear(4, 3), x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_replay_refuses_an_unavailable_device():
    model, x, trace = _traced_linear()
    with pytest.raises(ReplayInputError, match="cuda.*not available"):
        md.replay(trace, (model, x), device="cuda")


def test_replay_refuses_meta_device_and_non_traces():
    model, x, trace = _traced_linear()
    with pytest.raises(ReplayInputError, match="meta"):
        md.replay(trace, (model, x), device="meta")
    with pytest.raises(ReplayInputError, match="expected a Trace"):
        md.replay(42)


class _OwnNames(nn.Module):
    """Names its parameters itself: replay must ask it, not walk it."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield "own." + name, p


def _modules_to_name():
    shared = nn.Linear(2, 2)
    holes = nn.Linear(2, 2)
    holes.bias = None  # a parameter slot holding None is skipped
    holes.register_buffer("gone", None)
    return [
        nn.Sequential(shared, nn.Sequential(shared, nn.BatchNorm1d(2)), holes),  # a shared submodule, twice
        nn.Sequential(nn.Linear(1, 1), _OwnNames()),  # an override below the root
        _OwnNames(),
    ]


@pytest.mark.parametrize("module", _modules_to_name())
def test_replay_names_a_modules_tensors_as_torch_does(module):
    # given_tensors walks the module tree once instead of asking torch twice;
    # the names, tensors and order are torch's own.
    from metadispatch.binding.inputs import given_tensors

    expected = [("param", n, p) for n, p in module.named_parameters(remove_duplicate=False)]
    expected += [("buffer", n, b) for n, b in module.named_buffers(remove_duplicate=False)]
    expected_keys = list(dict.fromkeys((k, n) for k, n, _ in expected))
    given = given_tensors((), None, module)
    assert list(given) == expected_keys
    assert all(given[(k, n)] is next(t for k2, n2, t in expected if (k2, n2) == (k, n)) for k, n in given)
