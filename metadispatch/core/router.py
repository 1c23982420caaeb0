"""The router: which stage answers an op.

Every way a call is answered, in the order they are tried.  Before the
dispatcher (torch-function level, mode/swap.py and the rooms it calls):

1. a composite that reads values or knows better than its C++ body
   (values/composites.py, gpu/gpu_composites.py, gpu/autocast.py) answers
   a torch function whole, or the real tensor is swapped in per thread
   (Note [Other threads see the real model] in standins/standins.py).

In ``dispatch`` (dispatch.py):

2. ``prim.device``: the logical device, in Python;
3. a profiler range (``record_function``): run as it is, recorded as a marker;
4. a wrapper subclass (DTensor) among the arguments: NotImplemented, so its
   own dispatch runs and its inner calls come back here;
5. the cache-hit path (hit.py), then the metadata cache (cache.py): outputs
   rebuilt from a recipe, no kernel run.

Here, for a call the cache did not answer:

6. a rule the user registered (``md.register_meta``);
7. a built-in rule (rules/);
8. torch's native meta kernel (or a custom op's fake impl);
9. a torch decomposition; else :class:`UnsupportedOpError`.  Ops whose
   output depends on tensor values raise :class:`DataDependentError`
   unless a rule answers them first.

Back in ``dispatch``, for a call 6-9 refused:

10. known values: inputs built from constants are run for real
    (values/known.py; the trace notes ``known value``);
11. under ``md.check``, the real kernel on made-up inputs (debug/check.py).

After any of these, value bounds may decide a comparison (values/bounds.py).
Rules and decompositions run with the mode re-entered but not recording, so
the ops they call are routed too and are not separate calls in the trace.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import DataDependentError, UnsupportedOpError
from ..tensor.describe import data_dependent_message, describe_inputs
from ..tensor.tensor import STATE, WIRING, MetaTensor, in_kernel, wrap
from ..values import known
from . import registry
from .call import Call

__all__ = ["route", "run_nested"]

_MISSING_META = ("'Meta' backend", "no fake impl or Meta kernel", "Meta kernel")
_NO_FAKE_IMPL = ("There was no fake impl registered",)


def route(call: Call):
    """Return (outputs, stage) for a call the cache did not answer (stages 5-9 above)."""
    func, f, args, kwargs, mode = call.func, call.f, call.args, call.kwargs, call.mode
    rule, stage = registry.rule_for(func)
    if rule is not None:
        if registry.wants_fallback(rule):

            def fallback(*a, **k):
                out, _ = _native_or_decomp(call.again(a, k))
                return _wrap_all(out, call.device)

            return run_nested(mode, rule, args, dict(kwargs, fallback=fallback)), stage
        return run_nested(mode, rule, args, kwargs), stage
    if f.data_dependent:
        hint = known.limit_hint(call.tensors, call.mode)  # the error path only: one pass over the trace
        raise DataDependentError(data_dependent_message(f.name, args, kwargs) + hint, op=f.name)
    return _native_or_decomp(call)


def _native_or_decomp(call: Call):
    func, f, args, kwargs = call.func, call.f, call.args, call.kwargs
    if f.has_meta_kernel or func not in _NO_NATIVE:
        try:
            with in_kernel():
                return func(*call.kargs, **call.kkwargs), "meta"
        except (NotImplementedError, RuntimeError) as e:
            # torch.library.custom_op registers a Meta kernel that raises a
            # RuntimeError when no fake impl was given: no kernel either.
            missing = _MISSING_META if isinstance(e, NotImplementedError) else _NO_FAKE_IMPL
            if not any(s in str(e) for s in missing):
                raise
            _NO_NATIVE.add(func)
    decomp = _compat.decomposition_table().get(func)
    if decomp is not None:
        return run_nested(call.mode, decomp, args, kwargs), "decomp"
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
