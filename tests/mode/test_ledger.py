"""Note [The ledger]: what a mode changes in torch is what the ledger says it changed.

A scan of every attribute of torch's modules and of the classes they define,
compared by identity before, inside and after a logical-CUDA world (the
mode that changes the most), equals the ledger's inventory inside and is
empty outside -- also after the step raises and when the mode was entered
and left in another thread.
"""

import sys
import threading

import pytest
import torch
import torch.distributed as dist

import metadispatch as md
from metadispatch.mode import ledger

# torch's own dispatch modes set these on entry, process-wide; MetaMode sets
# them as torch does (Note [What a mode entry changes in torch] in _compat/dispatch.py).
_TORCHS_OWN = {
    ("torch.utils._python_dispatch", n)
    for n in (
        "_is_in_torch_dispatch_mode",
        "_is_in_non_infra_torch_dispatch_mode",
        "_is_in_any_mode_without_ignore_compile_internals",
    )
} | {
    # counters torch moves itself when a hook is registered or a group made
    ("torch.utils.hooks.RemovableHandle", "next_id"),
    ("torch.distributed.distributed_c10d", "_group_count"),
}


def _scan() -> dict:
    found = {}
    for name, module in list(sys.modules.items()):
        # torch, and safetensors' torch loaders, which the ledger patches once imported
        if module is None or not (name == "torch" or name.startswith("torch.") or name == "safetensors.torch"):
            continue
        for key, value in list(vars(module).items()):
            found[(name, key)] = value
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                for attr, v in list(vars(value).items()):
                    found[(f"{name}.{value.__qualname__}", attr)] = v
    return found


def _changed(before: dict, now: dict) -> set:
    keys = before.keys() | now.keys()
    return {k for k in keys if before.get(k, _GONE) is not now.get(k, _GONE)} - _TORCHS_OWN


_GONE = object()


def _named(owner, name: str):
    if isinstance(owner, type):
        return (f"{owner.__module__}.{owner.__qualname__}", name)
    return (owner.__name__, name)


def _step(x):
    model = torch.nn.Linear(8, 8).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(x.cuda()).sum().backward()
    dist.all_reduce(model.weight.grad)
    opt.step()
    torch.manual_seed(0)
    return torch.cuda.get_device_name()


def test_ledger_inventory_is_what_a_logical_world_changes():
    _step_outside_warms_imports()
    before = _scan()
    inside: dict = {}

    def step(x):
        out = _step(x)
        inside["changed"] = _changed(before, _scan())
        inside["inventory"] = {_named(owner, name) for owner, name, _, _ in ledger.inventory()}
        return out

    md.tracer(device="cuda", world_size=2)(step, torch.ones(4, 8))
    assert inside["changed"] and inside["changed"] == inside["inventory"]
    assert not _changed(before, _scan()) and not ledger.inventory() and not ledger.users()


def test_ledger_nothing_stays_changed_after_the_step_raises():
    _step_outside_warms_imports()
    before = _scan()

    def step(x):
        _step(x)
        raise KeyError("the step's own error")

    with pytest.raises(KeyError):
        md.tracer(device="cuda", world_size=2)(step, torch.ones(4, 8))
    assert not _changed(before, _scan()) and not ledger.inventory() and not ledger.users()


def test_ledger_a_mode_in_another_thread_changes_nothing_after_it():
    _step_outside_warms_imports()
    before = _scan()
    errors = []

    def run():
        try:
            md.tracer(device="cuda", world_size=2)(_step, torch.ones(4, 8))
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not errors
    assert not _changed(before, _scan()) and not ledger.inventory() and not ledger.users()


def _step_outside_warms_imports():
    # Imports a first trace makes (distributed, DTensor, optimizers) add
    # modules and names: made once before the scans compare.
    md.tracer(device="cuda", world_size=2)(_step, torch.ones(4, 8))
