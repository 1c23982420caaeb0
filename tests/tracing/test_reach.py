"""tracing/reach.py: the walk of what a user's function can reach, which
``md.trace`` saves and gives back and ``md.testing.snapshot`` compares."""

import functools

import torch
from torch import nn

from metadispatch.tracing.reach import find, walk

_GLOBAL_MODEL = nn.Linear(2, 2)


def test_reach_walk_finds_closures_globals_defaults_and_partials():
    model, opt_model = nn.Linear(3, 3), nn.Linear(4, 4)
    opt = torch.optim.SGD(opt_model.parameters(), lr=0.1)
    seen_default = torch.zeros(5)

    def step(x, scale=seen_default):
        return _GLOBAL_MODEL(model(x)[:, :2]) * scale[0], opt, opt_model

    paths = {path: obj for path, obj, first in walk({"fn": functools.partial(step, torch.ones(1, 3))}) if first is None}
    assert paths["fn.func.<closure model>"] is model
    assert paths["fn.func.<global _GLOBAL_MODEL>"] is _GLOBAL_MODEL
    assert paths["fn.func.__defaults__[0]"] is seen_default
    assert paths["fn.func.<closure opt>"] is opt
    # the optimizer's parameters are the module's, reached once and named by the first path
    reached = [(path, first) for path, obj, first in walk({"fn": step}) if obj is opt_model.weight]
    assert [first for _, first in reached].count(None) == 1 and len(reached) > 1
    assert all(first == reached[0][0] for _, first in reached[1:])
    # torch's own modules and functions are not the user's state: never walked into
    assert not any(path.startswith("fn.func.<global torch") for path in paths)


def test_reach_find_offers_each_object_once_and_no_atoms():
    shared = torch.ones(2)
    state = {"a": shared, "b": [shared, 3, "x"], "c": (shared,)}
    offered = []
    found = find({"state": state}, lambda o: offered.append(o) or isinstance(o, torch.Tensor))
    assert found == [shared]
    assert not any(isinstance(o, (int, str)) for o in offered)
    assert len([o for o in offered if o is shared]) == 1


_UNRELATED: list = []  # held by this module's globals, never named by the step below


def test_walk_visits_nothing_the_step_does_not_reach():
    """Per-trace fixed work follows what the step reaches, not what the process holds."""
    from metadispatch.tracing import reach

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(x).sum().backward()
        opt.step()

    def visited():
        return [id(o) for _, o, _ in reach.walk({"fn": step, "args": (torch.ones(2, 4),)}, named=False, empty=True)]

    before = visited()
    _UNRELATED.append([torch.randn(2) for _ in range(1000)])
    _UNRELATED.append(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)]))
    try:
        after = visited()
        unrelated = {id(o) for o in _UNRELATED[0]} | {id(m) for m in _UNRELATED[1].modules()}
        assert len(after) == len(before) and not unrelated & set(after)
        assert id(model) in after and id(opt) in after  # it does walk what the step reaches
    finally:
        _UNRELATED.clear()
