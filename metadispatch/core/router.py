"""The router: which stage answers an op.

In order: a rule the user registered -> a built-in rule -> torch's native
meta kernel -> a torch decomposition -> :class:`UnsupportedOpError`.  Ops whose output depends on tensor values
raise :class:`DataDependentError` unless a rule answers them first.

Rules and decompositions run with the mode re-entered but not recording, so
the ops they call are routed too and are not separate calls in the trace.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import DataDependentError, UnsupportedOpError
from ..tensor.describe import data_dependent_message, describe_inputs
from ..tensor.tensor import STATE, WIRING, MetaTensor, in_kernel, wrap
from . import registry

__all__ = ["route", "run_nested"]

_MISSING_META = ("'Meta' backend", "no fake impl or Meta kernel", "Meta kernel")
_NO_FAKE_IMPL = ("There was no fake impl registered",)


def route(func, f, args, kwargs, kargs, kkwargs, device, mode):
    """Return (outputs, stage).  ``kargs``/``kkwargs`` have device args on meta."""
    rule, stage = registry.rule_for(func)
    if rule is not None:
        if registry.wants_fallback(rule):

            def fallback(*a, **k):
                out, _ = _native_or_decomp(func, f, a, k, a, k, device, mode)
                return _wrap_all(out, device)

            return run_nested(mode, rule, args, dict(kwargs, fallback=fallback)), stage
        return run_nested(mode, rule, args, kwargs), stage
    if f.data_dependent:
        raise DataDependentError(data_dependent_message(f.name, args, kwargs), op=f.name)
    return _native_or_decomp(func, f, args, kwargs, kargs, kkwargs, device, mode)


def _native_or_decomp(func, f, args, kwargs, kargs, kkwargs, device, mode):
    if f.has_meta_kernel or func not in _NO_NATIVE:
        try:
            with in_kernel():
                return func(*kargs, **kkwargs), "meta"
        except (NotImplementedError, RuntimeError) as e:
            # torch.library.custom_op registers a Meta kernel that raises a
            # RuntimeError when no fake impl was given: no kernel either.
            missing = _MISSING_META if isinstance(e, NotImplementedError) else _NO_FAKE_IMPL
            if not any(s in str(e) for s in missing):
                raise
            _NO_NATIVE.add(func)
    decomp = _compat.decomposition_table().get(func)
    if decomp is not None:
        return run_nested(mode, decomp, args, kwargs), "decomp"
    raise UnsupportedOpError(
        _unsupported_message(func, f.name, args, kwargs), op=f.name, inputs=describe_inputs(args, kwargs)
    )


_NO_NATIVE: set = set()  # ops whose meta kernel turned out to be missing


def run_nested(mode, fn, args, kwargs):
    """Run ``fn`` with metadispatch active but not recording."""
    if mode is None:
        mode = WIRING.scratch_mode()  # Note [Wiring] in tensor.py
    # The nested calls move STATE.ambient (Note [Meta from options] in
    # dispatch.py); the next call must find it as a cache hit leaves it.
    ambient = STATE.ambient
    mode._depth += 1
    _compat.push_mode(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        _compat.pop_mode()
        mode._depth -= 1
        STATE.ambient = ambient


def _wrap_all(out, device):
    if isinstance(out, MetaTensor):
        return out
    if isinstance(out, torch.Tensor):
        return wrap(out, device)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_all(o, device) for o in out)
    return out


def _unsupported_message(func, name, args, kwargs) -> str:
    return (
        f"{name} has no meta rule, no meta kernel and no decomposition.\n"
        f"  inputs: {describe_inputs(args, kwargs)}\n"
        f"  Register a rule that returns outputs with the right metadata:\n\n"
        + "\n".join("    " + line for line in registry.rule_skeleton(func).splitlines())
    )
