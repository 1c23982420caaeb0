"""Values fixed into a trace are checked at replay (issue 28, item 2).

Note [Values fixed into a trace] in execution/matching.py: a number a call
returned when traced (``.item()`` of a counter buffer) and a module's plain
tensor attribute the trace holds the value of are compared with what replay
is given; a difference makes replay not ``ok``, and each test shows that
eager then computes something else indeed.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import metadispatch as md


def _bn_step(m, x):
    m(x).sum().backward()


def _traced_batchnorm():
    torch.manual_seed(0)
    m, x = nn.BatchNorm1d(4, momentum=None), torch.randn(8, 4)
    return m, x, md.trace(_bn_step, m, x)


def test_fixed_values_counter_buffer_changed_makes_replay_not_ok_where_eager_differs():
    m, x, t = _traced_batchnorm()
    _bn_step(m, torch.randn(8, 4) * 3)  # one more real step: num_batches_tracked is 2
    m.zero_grad(set_to_none=True)
    eager = copy.deepcopy(m)
    r = md.replay(t, (m, x))
    _bn_step(eager, x)
    assert not torch.equal(r.buffers["running_mean"], eager.running_mean)  # the divergence replay must not hide
    assert not r.ok
    (bad,) = r.mismatches
    assert bad.op == "aten._local_scalar_dense.default" and bad.fields == ("value",)
    assert (bad.expected["value"], bad.actual["value"]) == (1, 2)
    assert "value 1 when traced, 2 now" in str(r)


def test_fixed_values_unchanged_counter_replays_ok_and_equals_eager():
    m, x, t = _traced_batchnorm()
    eager = copy.deepcopy(m)
    r = md.replay(t, (m, x))
    _bn_step(eager, x)
    assert r.ok, r
    assert torch.equal(r.buffers["running_mean"], eager.running_mean)
    assert torch.equal(r.buffers["num_batches_tracked"], eager.num_batches_tracked)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = torch.tensor([2.0, 1.0, 3.0])  # a plain attribute: neither parameter nor buffer

    def forward(self, x):
        return self.lin(x) * self.scale


def _call(m, x):
    return m(x)


def test_fixed_values_module_attribute_changed_makes_replay_not_ok(tmp_path):
    torch.manual_seed(0)
    m, x = _Scaled(), torch.randn(2, 3)
    t = md.trace(_call, m, x)
    path = tmp_path / "t.json"
    t.save(path)
    loaded = md.Trace.load(path)
    m.scale.mul_(10)
    for trace in (t, loaded):
        r = md.replay(trace, (m, x))
        assert not torch.equal(r.output, m(x))
        assert not r.ok
        (changed,) = r.made_up
        assert changed.name == "const scale" and "[20.0, 10.0, 30.0]" in changed.why


def test_fixed_values_module_attribute_unchanged_replays_ok_and_equals_eager():
    torch.manual_seed(0)
    m, x = _Scaled(), torch.randn(2, 3)
    t = md.trace(_call, m, x)
    r = md.replay(t, (m, x))
    assert r.ok, r
    assert torch.equal(r.output, m(x))


def test_fixed_values_large_module_attribute_is_bound_from_the_module_given():
    torch.manual_seed(0)
    m, x = _Scaled(), torch.randn(2, 3)
    m.lin, m.scale = nn.Linear(3, 5000), torch.randn(5000)  # above the constant limit: the trace keeps no value
    t = md.trace(_call, m, x)
    r = md.replay(t, (m, x))
    assert r.ok, r
    assert torch.equal(r.output, m(x))
