"""A trace keeps no real tensor alive: dropping the model frees its weights."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import metadispatch as md


def _weights_freed_after(run) -> list:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(x)]
    kept = run(model, x)  # what the user keeps: the trace, its output, the mode
    del model, x
    gc.collect()
    alive = [r for r in refs if r() is not None]
    del kept
    return alive


def test_leaks_trace_output_graph_keeps_no_real_weight():
    alive = _weights_freed_after(lambda m, x: md.trace(lambda x: m(x).sum(), x))
    assert alive == []


def test_leaks_trace_with_backward_keeps_no_real_weight():
    def run(m, x):
        return md.trace(lambda x: m(x).pow(2).mean().backward(), x)

    assert _weights_freed_after(run) == []


def test_leaks_mode_and_its_outputs_keep_no_real_weight():
    def run(m, x):
        with md.MetaMode() as mode:
            out = m(x).sum()
        return mode, out

    assert _weights_freed_after(run) == []


def test_leaks_free_parameter_gets_no_meta_grad_and_is_freed():
    w = torch.randn(4, 4, requires_grad=True)
    ref = weakref.ref(w)
    # The lambda's cell is emptied by the del below, which ruff reads as undefined.
    t = md.trace(lambda x: (x @ w).sum().backward(), torch.ones(2, 4))  # noqa: F821
    assert w.grad is None
    del w
    gc.collect()
    assert ref() is None and t.output is None


def test_leaks_dropping_a_trace_frees_it_and_its_meta_tensors():
    """Note [Dropping a trace frees it]: trace.output's autograd graph holds
    tensors that refer to the recorder; the recorder must not hold the trace."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters())

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    gc.collect()
    metas = _meta_tensors()
    forward = md.trace(lambda x: model(x).sum(), torch.randn(4, 8))  # output with a graph
    trained = md.tracer(device="cuda")(step, torch.randn(4, 8))
    refs = [weakref.ref(forward), weakref.ref(forward.output), weakref.ref(trained)]
    del forward, trained
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert _meta_tensors() <= metas


def _meta_tensors() -> int:
    return sum(type(o) is md.MetaTensor for o in gc.get_objects())  # type(): no __class__ lookups
