"""A module the step makes is held weakly (Note [A module the step makes] in standins/standins.py): a module made,
called and dropped inside the step frees its tensors where eager frees them, and one the step keeps still has its
gradients in the trace."""

import torch

import metadispatch as md


def _made_and_dropped(x):
    with torch.no_grad():
        m = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.ReLU())  # 4 MB of weight
        y = m(x)
        del m
        z = torch.ones(2000, 1000)  # 8 MB, allocated after the module is gone
        return y.sum() + z.sum()


def test_a_module_made_and_dropped_in_the_step_is_freed_as_in_eager():
    x = torch.ones(8, 1000)
    with md.LiveStorages(count_untracked=False) as live:
        _made_and_dropped(x)
    traced = md.memory(md.trace(_made_and_dropped, x)).peak
    assert traced - x.numel() * 4 == live.peak  # the trace also counts its argument; it held the weight: +4 MB


def test_a_module_the_step_keeps_has_its_gradients_in_the_trace():
    kept: list = []

    def step(x):
        head = torch.nn.Linear(16, 4)
        head(x).sum().backward()
        kept.append(head)

    trace = md.trace(step, torch.ones(2, 16))
    assert set(trace.grads) == {"weight", "bias"}
    assert trace.grads["weight"].shape == (4, 16)
    assert kept and isinstance(kept[0].weight, md.MetaTensor)  # what the user kept stays theirs, as under eager


def test_a_module_the_step_drops_has_no_gradients_in_the_trace():
    def step(x):
        head = torch.nn.Linear(16, 4)
        head(x).sum().backward()

    assert md.trace(step, torch.ones(2, 16)).grads == {}
