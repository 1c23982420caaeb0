"""Reference kernels (torch._refs, _prims, _decomp) called without dynamo's wrappers.

Part of ``metadispatch._compat`` (its docstring says why private torch APIs live here alone).
"""

from __future__ import annotations

import functools
import sys
import types

import torch

# Note [Reference kernels without dynamo in the command line]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch 2.13 answers many ops on meta tensors with Python reference kernels
# (``torch._refs.div``, ``exp``, ``cat``, ...) and wraps them, and
# ``Optimizer.zero_grad``, in ``torch._disable_dynamo``, whose first call
# imports ``torch._dynamo`` (~0.85 s of CPU, a quarter of ``metadispatch
# trace``) only to build a wrapper that matters while dynamo is tracing.
# The wrapper caches its answer in the function's ``__dynamo_disable``
# attribute; the command line, which owns its process,
# fills that cache with the function itself.  The functions are found by
# walking, from the modules that define them, every function's
# ``__wrapped__`` and closure (a reference's outer ``functools.wraps`` points
# ``__wrapped__`` at the prim, not at the wrapper).  One that the walk misses
# just imports dynamo as before.  The library never does this: it would
# change torch for the rest of the user's process.
#
# An optimizer's ``step`` imports dynamo itself (``_use_grad_for_differentiable``
# in torch/optim/optimizer.py) to call ``torch._dynamo.graph_break()``, whose
# body is empty: it matters only to dynamo compiling the step.  Imported by
# the command line's default step (AdamW, cli/steps.py), that was 0.9-1.2 s
# of ``metadispatch trace``'s ~3.2 s.  So the command line's process also
# steps torch's optimizers through the same wrapper without the two graph
# breaks (:func:`steps_without_graph_breaks`): it sets grad mode from
# ``defaults["differentiable"]`` and restores it, as torch's does, and the
# ``Optimizer.step`` hooks and profiler range torch puts around it are
# untouched.  Only where torch's wrapper is the one read here (the names its
# code uses, checked): another torch's wrapper is left as it is.
_REFERENCE_MODULES = ("torch._refs", "torch._prims", "torch._decomp", "torch._meta_registrations", "torch.optim")


def skip_dynamo_in_reference_kernels() -> int:
    """For the command line's process only; returns how many wrappers were filled."""
    if "torch._dynamo" in sys.modules:
        return 0
    filled = 0
    for f in functions_behind_dynamo_wrappers():
        if not hasattr(f, "__dynamo_disable"):
            setattr(f, "__dynamo_disable", f)  # noqa: B010 (no name mangling wanted)
            filled += 1
    return filled


def functions_behind_dynamo_wrappers() -> list:
    """What ``torch._disable_dynamo`` wraps in torch's reference kernels and optimizers."""
    from torch._compile import _disable_dynamo
    from torch._decomp import global_decomposition_table

    code = _disable_dynamo(lambda: None).__code__
    cell = code.co_freevars.index("fn")
    seen: set = set()
    found = []
    stack: list = [
        v
        for m in list(sys.modules.values())
        if getattr(m, "__name__", "").startswith(_REFERENCE_MODULES)
        for v in vars(m).values()
    ]
    stack += [f for v in list(stack) if isinstance(v, type) for f in vars(v).values()]
    stack += [f for table in global_decomposition_table.values() for f in table.values()]
    while stack:
        f = stack.pop()
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            continue
        seen.add(id(f))
        if f.__code__ is code and f.__closure__:
            found.append(f.__closure__[cell].cell_contents)
        stack += [getattr(f, "__wrapped__", None)] + [c.cell_contents for c in f.__closure__ or () if _filled_cell(c)]
    return found


def _filled_cell(c) -> bool:
    try:
        c.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


# What torch 2.13's and 2.14's ``_use_grad`` refers to: anything else is a wrapper this module has not read.
_USE_GRAD_NAMES = (
    "torch._dynamo",
    "cast",
    "Optimizer",
    "is_grad_enabled",
    "set_grad_enabled",
    "defaults",
    "_dynamo",
    "graph_break",
)


def steps_without_graph_breaks() -> int:
    """For the command line's process only: torch's optimizers step without
    importing dynamo (Note [Reference kernels without dynamo in the command
    line]); returns how many ``step`` functions were rewrapped."""
    if "torch._dynamo" in sys.modules:
        return 0
    from torch.optim import optimizer

    code = optimizer._use_grad_for_differentiable(lambda *a, **k: None).__code__
    if code.co_names != _USE_GRAD_NAMES or code.co_freevars != ("func",):
        return 0
    done = 0
    for m in list(sys.modules.values()):
        if not getattr(m, "__name__", "").startswith("torch.optim"):
            continue
        for cls in list(vars(m).values()):
            step = cls.__dict__.get("step") if isinstance(cls, type) and issubclass(cls, optimizer.Optimizer) else None
            # (an optimizer made before has its class's step hooked: another code, left alone)
            if isinstance(step, types.FunctionType) and step.__code__ is code and step.__closure__:
                cls.step = _use_grad(step.__closure__[0].cell_contents)
                done += 1
    return done


def _use_grad(func):
    """torch's ``_use_grad_for_differentiable`` wrapper less its ``torch._dynamo.graph_break()`` calls."""

    def _use_grad(*args, **kwargs):
        self = args[0]
        prev_grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            ret = func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev_grad)
        return ret

    functools.update_wrapper(_use_grad, func)
    return _use_grad
