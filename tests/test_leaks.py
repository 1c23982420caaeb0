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
