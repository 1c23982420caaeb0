"""A trace keeps no real tensor alive: dropping the model frees its weights."""

from __future__ import annotations

import gc
import weakref

import pytest
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


# -- every result type (issue 27 item 5): nothing of the user's kept alive ----


def _step(m, x):
    m(x).pow(2).mean().backward()


def _replayed(m, x):
    t = md.trace(_step, m, x)
    return md.replay(t, (m, x))


def _checked_stopping(m, x):
    def step(m, x):
        m(x).sum().backward()
        raise ValueError("the step stops here")

    report = md.check(step, m, x)
    assert isinstance(report.error, ValueError) and report.stop.source is not None
    return report


RESULTS = {
    "Trace": lambda m, x: md.trace(_step, m, x),
    "Trace on logical cuda": lambda m, x: md.tracer(device="cuda")(_step, m, x),
    "Report": lambda m, x: md.check(_step, m, x),
    "Report that stopped": _checked_stopping,
    "Replay": _replayed,
    "Replay, timed": lambda m, x: md.replay(md.trace(_step, m, x), (m, x), timing=True),
    "Fit": lambda m, x: md.fits(md.tracer(device="cuda")(_step, m, x), gpu="h100"),
    "Flops": lambda m, x: md.flops(md.trace(_step, m, x)),
    "Memory": lambda m, x: md.memory(md.trace(_step, m, x)),
    "Runtime": lambda m, x: md.runtime(md.tracer(device="cuda")(_step, m, x), gpu="h100"),
    "replay plan": lambda m, x: _planned(m, x),
    "materialized module": lambda m, x: _materialized(),
}


def _planned(m, x):
    # the generated replay program, cached on the trace (execution/program.py)
    t = md.trace(_step, m, x)
    md.replay(t, (m, x))
    md.replay(t, (m, x))  # the second replay runs the cached program
    return t


def _materialized():
    with md.MetaMode():
        meta = nn.Linear(8, 2)
    return md.materialize(meta)


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_leaks_no_result_type_keeps_the_users_tensors_alive(name):
    assert _weights_freed_after(RESULTS[name]) == []


def test_leaks_a_stopped_checks_report_holds_text_and_line_not_frames():
    report = _weights_freed_after_kept(_checked_stopping)
    error = report.error
    assert error.__traceback__ is None and str(error) == "the step stops here"
    assert "Stopped: ValueError: the step stops here" in str(report) and "test_leaks.py" in str(report)


def _weights_freed_after_kept(run):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(x)]
    kept = run(model, x)
    del model, x
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    return kept


def test_leaks_a_stopped_checks_report_drops_a_tensor_key_and_chained_frames():
    # The "optimizer step in backward" slip: a KeyError whose key is a tensor,
    # raised while handling another error.
    def run(m, x):
        def step(m, x):
            table = {}
            try:
                m(x).sum().backward()
                raise RuntimeError("first")
            except RuntimeError:
                return table[next(m.parameters())]

        return md.check(step, m, x)

    report = _weights_freed_after_kept(run)
    assert isinstance(report.error, KeyError) and all(isinstance(a, str) for a in report.error.args)
    assert report.error.__context__.__traceback__ is None
