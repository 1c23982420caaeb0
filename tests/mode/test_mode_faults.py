"""Mode entry and exit leave nothing installed, whatever line an interrupt hits.

A ``sys.settrace`` hook raises KeyboardInterrupt at the k-th line run inside
``MetaMode.__enter__``/``__exit__`` (and the metadispatch functions they
call), for every k; afterwards torch's mode slot and stacks, its mode flags,
the lift flag, the gc threshold and freeze count, the functions a mode patches
(RNG state functions, ``has_torch_function``, ``trunc_normal_``, ``torch.save``, lazy parameters' constructors), grad mode,
the global module and optimizer hooks must be as before.
"""

from __future__ import annotations

import functools
import gc
import os
import sys

import pytest
import torch
import torch._dynamo.eval_frame as eval_frame  # imported, so that mode entry sets the stance

import metadispatch as md
from metadispatch import _compat
from metadispatch.core import rngstate
from metadispatch.mode import entry as mode_entry
from metadispatch.mode import ledger, unseen
from metadispatch.tensor.tensor import STATE

_PACKAGE = os.path.dirname(md.__file__)
_ENTRY_EXIT = {md.MetaMode.__enter__.__code__, md.MetaMode.__exit__.__code__}


def _global_state() -> dict:
    return {
        "slot": _compat.get_infra_mode(_compat.mode_key),
        "dispatch stack": len(_compat.dispatch_mode_stack()),
        "function stack": _compat.function_mode_stack(),
        "mode flags": _compat.dispatch_mode_flags(),
        "lift": _compat.only_lift_cpu_tensors(),
        "torch function": _compat.torch_function_enabled(),
        "gc threshold": gc.get_threshold(),
        "gc frozen": gc.get_freeze_count(),
        "gc enabled": gc.isenabled(),
        "grad mode": torch.is_grad_enabled(),
        "meta tls": _compat.meta_in_tls_dispatch_include(),
        "ambient device": STATE.ambient,
        "patched": [getattr(owner, name) for owner, name, _, _ in rngstate.PATCHES],
        "ledger": (ledger.inventory(), ledger.users()),
        "has_torch_function": torch.overrides.has_torch_function,
        # Note [Functions no mode sees] in mode/unseen.py
        "torch.save": (torch.save, torch.serialization.save),
        "lazy": [cls.__dict__["__new__"] for cls in unseen._LAZY],
        "trunc_normal body": _compat.trunc_normal_body(),
        "hooks": [len(h) for h in _compat.module_global_hooks()],
        "active": list(mode_entry.ACTIVE.entries),
        "dynamo stance": eval_frame._stance,  # Note [Compiled code runs eagerly under a mode]
    }


class _Inject:
    """Raise KeyboardInterrupt at the ``at``-th line run inside mode entry or exit."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.lines = 0
        self.fired = False

    def __call__(self, frame, event, arg):
        # decided once a frame, at its call: a line event per frame of the
        # traced body would make each try of a trace take 30x as long
        if self.fired or not frame.f_code.co_filename.startswith(_PACKAGE) or not _inside_entry_or_exit(frame):
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.lines += 1
            if self.lines > self.at:
                self.fired = True
                raise KeyboardInterrupt(f"injected at {frame.f_code.co_name}:{frame.f_lineno}")
        return self._line


def _traced(method, inject):
    @functools.wraps(method)
    def traced(*args):
        sys.settrace(inject)
        try:
            return method(*args)
        finally:
            sys.settrace(None)

    return traced


def _inside_entry_or_exit(frame) -> bool:
    while frame is not None:
        if frame.f_code in _ENTRY_EXIT:
            return True
        frame = frame.f_back
    return False


def _body_mode():
    with md.MetaMode():
        torch.ones(2) + 1


def _body_trace():
    model = torch.nn.Linear(3, 2)
    md.trace(lambda x: model(x).sum().backward(), torch.ones(4, 3))


def _body_nested():
    with md.MetaMode():
        with md.MetaMode():
            torch.ones(2)


@pytest.mark.slow
@pytest.mark.parametrize("body", [_body_mode, _body_trace, _body_nested])
def test_mode_faults_interrupt_at_every_line_leaves_nothing_installed(body, monkeypatch):
    before = _global_state()
    at, fired = 0, True
    while fired:
        inject = _Inject(at)
        # traced only while entry or exit runs: tracing the whole body makes
        # each try of a trace with backward ten times as long
        for name in ("__enter__", "__exit__"):
            monkeypatch.setattr(md.MetaMode, name, _traced(getattr(md.MetaMode, name), inject))
        try:
            body()
        except KeyboardInterrupt:
            pass
        finally:
            monkeypatch.undo()
        fired = inject.fired
        assert _global_state() == before, f"interrupt at line {at} of entry/exit"
        at += 1
    assert at > 20  # the injection did reach the lines of entry and exit
    assert torch.ones(1).device.type == "cpu" and not isinstance(torch.ones(1), md.MetaTensor)


def test_mode_faults_modes_left_out_of_order_leave_nothing_installed():
    # The ambient device is the last op's (a MetaTensor used outside a mode in
    # an earlier test moves it); each mode restores what it saw on entry, so
    # out of order the later mode restores what the first one set: start where
    # a mode would.
    STATE.ambient = torch.device("cpu")
    before = _global_state()

    def gen():
        with md.MetaMode():
            yield

    a, b = gen(), gen()
    next(a)
    next(b)
    assert isinstance(torch.ones(1), md.MetaTensor)
    a.close()  # a first, although b was entered later
    assert isinstance(torch.ones(1), md.MetaTensor)  # b is still active
    b.close()
    assert _global_state() == before
    assert type(torch.ones(1)) is torch.Tensor


def test_mode_faults_torch_modes_left_out_of_order_also_leave_nothing():
    """The behaviour we match: torch's own modes tolerate the same order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def gen():
        with TorchDispatchMode():
            yield

    depth = len(_compat.dispatch_mode_stack())
    a, b = gen(), gen()
    next(a)
    next(b)
    a.close()
    b.close()
    assert len(_compat.dispatch_mode_stack()) == depth


_SWAP = {"materialize", "_swap_all", "_swap", "_meta_grad"}


class _InjectIn(_Inject):
    """Raise KeyboardInterrupt at the ``at``-th line run in ``codes``' functions of ``filename``."""

    def __init__(self, at: int, filename: str, names: set) -> None:
        super().__init__(at)
        self.filename, self.names = filename, names

    def __call__(self, frame, event, arg):
        code = frame.f_code
        return self._line if code.co_filename == self.filename and code.co_name in self.names else None


@pytest.mark.slow
def test_mode_faults_materialize_interrupted_at_any_line_is_all_or_nothing():
    """Note [Materialise all or nothing]: whatever line of ``md.materialize``
    an interrupt hits, the module holds only MetaTensors, as before, or only
    its real values -- never a mix -- and nothing global changed."""
    from metadispatch.execution import materialize as materialize_module

    before_state = _global_state()
    at, fired, outcomes = 0, True, set()
    while fired:
        torch.manual_seed(0)
        with md.MetaMode():
            module = torch.nn.Linear(2, 2)
            module.cache = [torch.ones(2), {"t": torch.zeros(1)}]
        before = md.testing.snapshot(module)
        inject = _InjectIn(at, materialize_module.__file__, _SWAP)
        sys.settrace(inject)
        try:
            md.materialize(module)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        fired = inject.fired
        after = md.testing.snapshot(module)
        if after == before:
            outcomes.add("unchanged")
        else:
            assert after.metas == [], f"interrupt at line {at}: a mix, MetaTensors left at {after.metas}"
            outcomes.add("materialised")
        assert _global_state() == before_state, f"interrupt at line {at}"
        at += 1
    assert outcomes == {"unchanged", "materialised"} and at > 100
