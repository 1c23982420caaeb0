"""The cache-hit path (core/hit.py) answers exactly as the full path does.

Each model is traced twice from an empty cache with the hit path off (every
call through the full path), then twice with it on; the second trace of each
pair is mostly hits.  The traces must be equal call for call (every
``TensorMeta``, stage and note), the cache must hold the same keys (the two
paths build one key: Note [The cache-hit path]), and the hit path must have
answered many calls -- else it is dead code and the test says so.
"""

import pytest
import torch

import metadispatch as md
from metadispatch.core import cache, hit
from metadispatch.core import dispatch as engine
from metadispatch.values.bounds import bounds_of
from tests.models import MODELS, train_step


def _traces(make, fast: bool, monkeypatch):
    engine._FAST.clear()
    taken = [0]
    if fast:

        def counted(*a):
            out = real(*a)
            taken[0] += out is not hit.MISS
            return out

        real = hit.answer_hit
        monkeypatch.setattr(hit, "answer_hit", counted)
    else:
        monkeypatch.setattr(hit, "eligible", lambda f, cross: 0)
    cache.clear()
    torch.manual_seed(0)
    with md.MetaMode():
        model, inputs = make()
    first = md.trace(train_step, model, *inputs)
    second = md.trace(train_step, model, *inputs)
    keys = set(cache._SHARED)
    monkeypatch.undo()
    engine._FAST.clear()
    return first, second, keys, taken[0]


def _calls(trace):
    return [(c.op, c.args, c.kwargs, c.outputs, c.module, c.phase, c.rule, c.note) for c in trace.calls]


@pytest.mark.parametrize("name", ["mlp", "convnet", "llama", "hf_gpt2"])
def test_hit_path_traces_equal_the_full_path(name, monkeypatch):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    slow = _traces(MODELS[name], False, monkeypatch)
    fast = _traces(MODELS[name], True, monkeypatch)
    for a, b in zip(slow[:2], fast[:2]):
        assert str(a) == str(b)
        assert _calls(a) == _calls(b)
        assert a.leaves.keys() == b.leaves.keys() and a.deaths == b.deaths
    assert slow[2] == fast[2], "the hit path built keys the full path does not (or the reverse)"
    # In models with repeated blocks most calls are hits (a parameter's
    # first read too: the hit path numbers the new leaf).
    assert fast[3] > len(fast[1].calls) // 3, f"the hit path answered only {fast[3]} of {len(fast[1].calls)} calls"


def test_hit_path_keeps_bounds_rules(monkeypatch):
    # sigmoid's output is within [0, 1] whatever its input: a rule the hit
    # path must still run (eligible() == 2).
    x = torch.randn(4)

    def step(x):
        return torch.sigmoid(x * 2)

    engine._FAST.clear()
    md.trace(step, x)  # fills the cache
    out = md.trace(step, x).output
    b = bounds_of(out)
    assert b is not None and (b.lo, b.hi) == (0.0, 1.0)
    assert engine._FAST[torch.ops.aten.sigmoid.default][1] == 2


def test_hit_path_carries_bounds_through_a_cached_answer(monkeypatch):
    # rand's output has bounds [0, 1]; x + 1 on it must carry them to [1, 2]
    # on the second trace too, where add's answer is in the cache and the
    # call takes the hit path (counted: a miss would prove nothing).
    def step():
        return torch.rand(4) + 1

    hits: list = []

    def counted(func, *a):
        out = real(func, *a)
        if out is not hit.MISS:
            hits.append(func)
        return out

    real = hit.answer_hit
    monkeypatch.setattr(hit, "answer_hit", counted)
    engine._FAST.clear()
    cache.clear()
    for n in range(2):
        b = bounds_of(md.trace(step).output)
        assert b is not None and (b.lo, b.hi) == (1.0, 2.0)
        assert hits.count(torch.ops.aten.add.Tensor) == n  # the first trace fills the cache
    assert engine._FAST[torch.ops.aten.add.Tensor][1] == 1  # no bounds of its own: no rule run on a hit
