"""The fast way to call a recorded op: torch's Python binding, where it is proven the same.

Note [Calling ops through their Python bindings]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An ``OpOverload`` names exactly one overload, and calling it (``_op``) is
the boxed path: the arguments are parsed against the schema onto a stack of
IValues and the kernel is called boxed -- 2-3 us more per call than eager
pays, which calls ``torch.mm`` or ``Tensor.add_``, torch's generated Python
bindings that call the unboxed kernel.  On a small model that is a quarter
of the step.  A binding, though, serves every overload of its name and picks
one by the Python types of what it is given, so it is used only where it is
*proven* to dispatch what the trace recorded: for each op and pattern of
argument types (a tensor's dtype and whether it is 0-dim, a value's type, a
list's length and element types: all a binding's parser looks at), both the
overload and the binding are called once on ``meta`` tensors under a dispatch
mode that stops each at the dispatcher, and the binding is kept only if it
reached the recorded overload itself (not a decomposition of it) with the
same arguments as the overload's own call, and warned of nothing (a
deprecated signature would warn on every replay).  Anything else -- no
binding of that name, a parse error, another overload -- keeps the overload.
The answer depends on torch alone, so it is cached per process.  Names are
those of the op's schema, looked up on torch's own binding tables, never a
name from a trace file.
"""

from __future__ import annotations

import warnings

import torch

from .. import _compat
from ..ir.records import TensorMeta
from ..ir.rng import is_generator
from ..spec.schema import schema_of

__all__ = ["binding"]

_PROVEN: dict = {}  # (op, argument pattern) -> binding, or None


def binding(func, args: tuple, kwargs: dict):
    """The Python binding that calls ``func`` on arguments shaped like these, or None."""
    try:
        key = (func, _pattern(args), tuple((k, _pattern(v)) for k, v in kwargs.items()))
    except TypeError:  # an unhashable constant: no pattern to cache by
        return None
    if key not in _PROVEN:
        if _compat.dispatch_mode_stack():  # a mode would see the probes: no answer, and none cached
            return None
        _PROVEN[key] = _prove(func, args, kwargs)
    return _PROVEN[key]


def _pattern(v):
    """What a binding's argument parser can tell apart in ``v``."""
    if isinstance(v, TensorMeta):
        return ("tensor", v.dtype, len(v.shape) == 0)
    if type(v) in (tuple, list):
        return (type(v), tuple(_pattern(x) for x in v))
    if isinstance(v, dict):
        return tuple((k, _pattern(x)) for k, x in v.items())
    if is_generator(v):
        return "generator"
    return type(v)


class _Reached(Exception):
    """Raised by :class:`_Stop` with what reached the dispatcher."""


class _Stop(_compat.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise _Reached(func, args, kwargs or {})


def _prove(func, args: tuple, kwargs: dict):
    ns, _, name = schema_of(func).name.partition("::")
    if ns != "aten":
        return None
    candidates = [getattr(table, name, None) for table in _compat.python_bindings]
    candidates = [c for c in candidates if c is not None]
    if not candidates:
        return None
    try:
        probe_args = [_probe(a) for a in args]
        probe_kwargs = {k: _probe(v) for k, v in kwargs.items()}
    except Exception:  # a record meta cannot stand for
        return None
    expected = _reach(_compat.op_callable(func), probe_args, probe_kwargs)
    if expected is None or expected[0] is not func:
        return None
    for candidate in candidates:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            got = _reach(candidate, probe_args, probe_kwargs)
        if got is not None and not warned and got[0] is func and _same(got[1:], expected[1:]):
            return candidate
    return None


def _probe(v):
    """A stand-in for ``v`` as the program passes it (program.py's ``_arg``)."""
    if isinstance(v, TensorMeta):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if type(v) is tuple and any(isinstance(x, TensorMeta) for x in v):
        return [_probe(x) for x in v]
    if isinstance(v, torch.device):
        return torch.device("meta")
    if is_generator(v):
        return torch.Generator()
    return v


def _reach(fn, args: list, kwargs: dict):
    """(op, args, kwargs) that ``fn`` hands the dispatcher, or None if it fails first."""
    try:
        with _Stop():
            fn(*args, **kwargs)
    except _Reached as e:
        return e.args
    except Exception:
        return None
    return None


def _same(a, b) -> bool:
    """The same arguments: the very tensors, or equal values of the same types."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if a is b:
            return True
        # A number passed for a Tensor parameter is wrapped anew by each path.
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dim() == b.dim() == 0
            and a.dtype == b.dtype
            and a.device == b.device
            and not a.is_meta
            and a.item() == b.item()
        )
    if type(a) is not type(b):
        return False
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b
