"""md.trace leaves the user's modules and optimizers exactly as they were,
and an optimizer built before the trace still steps (on the stand-ins)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import metadispatch as md


def _trained(opt_cls, **opt_kwargs):
    """A model and optimizer after one real step: real grads and state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = opt_cls(model.parameters(), **opt_kwargs)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _step(opt):
    def step(model, x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    return step


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {}),
    "adamw-foreach": (torch.optim.AdamW, {"foreach": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not str(func).startswith("profiler."):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_standins_optimizer_built_before_the_trace_steps_on_stand_ins(name):
    opt_cls, kwargs = OPTIMIZERS[name]
    model, opt = _trained(opt_cls, **kwargs)
    t = md.trace(_step(opt), model, torch.ones(2, 4))
    # Reference: the aten ops of the same step run for real on copies.
    real_model, real_opt = copy.deepcopy((model, opt))
    real_opt.zero_grad()
    real_model(torch.ones(2, 4)).sum().backward()
    with _Ops() as log:
        real_opt.step()
    assert [c.op for c in t if c.phase == "optimizer"] == log.ops


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_standins_optimizer_and_model_are_untouched(name):
    opt_cls, kwargs = OPTIMIZERS[name]
    model, opt = _trained(opt_cls, **kwargs)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_values = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    groups = [list(g["params"]) for g in opt.param_groups]
    md.trace(_step(opt), model, torch.ones(2, 4))
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]) and p.grad is grads[n] and torch.equal(p.grad, grad_values[n])
    assert [list(g["params"]) for g in opt.param_groups] == groups
    after = opt.state_dict()
    for k, entry in state["state"].items():
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(after["state"][k][key]), torch.as_tensor(v)), (k, key)


def test_standins_optimizer_state_is_named_and_replays():
    model, opt = _trained(torch.optim.AdamW)
    t = md.trace(_step(opt), model, torch.ones(2, 4))
    names = sorted(leaf.name for leaf in t.leaves.values() if leaf.name.startswith("optimizer"))
    assert "optimizer state 0.weight.exp_avg" in names and "optimizer state 2.bias.step" in names
    r = md.replay(t, (model, torch.ones(2, 4)))
    assert r.ok, r.mismatches


def test_standins_optimizer_restored_and_hook_removed_on_exception():
    from torch.optim import optimizer as optim_module

    model, opt = _trained(torch.optim.AdamW)
    state = opt.state
    groups = [g["params"] for g in opt.param_groups]
    hooks = dict(optim_module._global_optimizer_pre_hooks)

    def failing(model, x):
        _step(opt)(model, x)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        md.trace(failing, model, torch.ones(2, 4))
    assert opt.state is state
    assert all(g["params"] is before for g, before in zip(opt.param_groups, groups))
    assert all(type(p) is torch.nn.Parameter and p.grad is not None for p in model.parameters())
    assert dict(optim_module._global_optimizer_pre_hooks) == hooks


def test_grads_name_each_parameter_once_when_a_block_runs_on_its_own():
    # torch.utils.checkpoint calls the block at the top of the module stack:
    # its parameters were named a second time by their names in the block.
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU())])
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(checkpoint(self.blocks[0], x, use_reentrant=False))

    net = Net()
    x = torch.randn(2, 4)
    trace = md.trace(lambda x: net(x).sum().backward(), x)
    net(x).sum().backward()
    assert sorted(trace.grads) == sorted(n for n, _ in net.named_parameters())
    for name, p in net.named_parameters():
        assert (trace.grads[name].shape, trace.grads[name].dtype) == (tuple(p.grad.shape), p.grad.dtype)


def test_restore_after_exception_puts_back_attributes_keys_and_hooks():
    """The restore's fast path (all identical) must not hide a change: an
    attribute re-keyed by an equal new string, a hook added, a module reached
    only through a closure, and an exception mid-step."""
    inner = torch.nn.Linear(3, 3)
    outer = torch.nn.Sequential(torch.nn.Linear(3, 3))
    keep = outer.__dict__.copy()
    weight = inner.weight

    def hidden():
        return inner  # reached only through this closure

    class Boom(Exception):
        pass

    def step(x):
        m = hidden()
        m.register_forward_hook(lambda *a: None)
        del m.__dict__["training"]
        m.__dict__["".join(["train", "ing"])] = False  # an equal key, a new str object
        m.extra = torch.ones(1)
        outer.flag = 1
        outer(m(x))
        raise Boom

    with pytest.raises(Boom):
        md.trace(step, torch.ones(2, 3))
    assert inner.training is True and not inner._forward_hooks and "extra" not in inner.__dict__
    assert inner.weight is weight and inner.weight.grad is None
    assert outer.__dict__ == keep and list(outer.__dict__) == list(keep)
