"""What a user's function can reach: modules, optimizers, tensors, generators.

``md.trace(step)`` must leave everything ``step`` can touch as it was, and
``md.testing.snapshot`` must compare all of it; both walk the same graph,
from any roots (arguments, a function, a module), depth first:

* a function: its closure cells, its defaults, and the globals its code
  (and the code of functions nested in it) names; a bound method: its
  ``__self__`` and function; a ``functools.partial``: its function and
  arguments;
* a module, optimizer, scheduler, grad scaler or other user object: its ``__dict__``
  (for a module that holds ``_parameters``, ``_buffers``, ``_modules`` and the
  plain attributes forward may have cached tensors on);
* lists, tuples, dicts (keys and values), sets;
* a tensor: its ``.grad``, hook tables and attributes.

Not walked: Python modules, classes, and objects defined by torch or the
standard library other than modules, optimizers, schedulers, grad scalers and tensors --
their state is not the user's.  Each object is visited once, under the first
path that reaches it.
"""

from __future__ import annotations

import functools
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import _compat

__all__ = ["walk", "find", "is_container", "holds_state", "is_machinery"]

_ATOMS = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)
_SKIP = (types.ModuleType, type, types.BuiltinFunctionType, types.CodeType)
_OWN = ("torch.optim", "torch.nn")  # torch objects that hold user state


def walk(
    roots: dict[str, Any], max_depth: int = 64, named: bool = True, empty: bool = False
) -> Iterator[tuple[str, Any, str | None]]:
    """Yield ``(path, object, first_path)`` for everything reachable from ``roots``.

    ``first_path`` is None the first time an object is reached, else the
    path it was first reached by (an identity: "the same object as").  With
    ``named=False`` paths are not spelled out (every path is ``""``; ``first``
    is ``""`` for an object seen before) and atoms and empty containers are
    not visited (empty containers are with ``empty=True``, but for those in
    an object's attributes, which are saved with it): :func:`find` runs
    at every ``md.trace`` (a GPT-2's modules hold ~1,800 empty hook dicts)
    and the paths were most of its cost.
    """
    seen: dict[int, str] = {}
    stack = [(name, obj, 0) for name, obj in reversed(list(roots.items()))]
    while stack:
        path, obj, depth = stack.pop()
        if _is_atom(obj) or isinstance(obj, _SKIP):
            yield path, obj, None
            continue
        first = seen.get(id(obj))
        if first is not None:
            yield path, obj, first
            continue
        seen[id(obj)] = path
        yield path, obj, None
        if depth < max_depth:
            children = list(_children(obj))
            if named:
                stack.extend((fmt.format(path, key), c, depth + 1) for fmt, key, c in reversed(children))
            else:  # atoms and empty containers hold nothing to find
                # (an object's own empty tables are its state: not asked for)
                keep_empty = empty and not _walks_dict(obj)
                stack.extend(("", c, depth + 1) for _, _, c in reversed(children) if not _inert(c, keep_empty))


def _inert(obj, empty: bool) -> bool:
    t = type(obj)
    return not empty and t in _EMPTY_WHEN_FALSE and not obj or _is_atom(obj)


def _is_atom(obj) -> bool:
    """``isinstance(obj, _ATOMS)``, asking ``obj.__class__`` once rather than
    once per kind: isinstance reads it for every kind an object's type is not,
    and a transformers config answers it in Python, twice over, from each of
    the modules that hold it (most of the walk's time on a LLaMA)."""
    t = type(obj)
    return issubclass(t, _ATOMS) or (obj.__class__ is not t and isinstance(obj, _ATOMS))


_EMPTY_WHEN_FALSE = {list, tuple, dict, set, OrderedDict}


# How each kind of child extends its parent's path (``str.format`` of the
# parent's path and the child's key), spelled out only when asked for.
_ATTR, _ITEM, _KEY = "{}.{}", "{}[{}]", "{}[{!r}]"
_TENSOR_KEY, _TENSOR_VALUE, _MEMBER = "{}.keys[{}]", "{}.values[{}]", "{}{{{}}}"
_CLOSURE, _GLOBAL = "{}.<closure {}>", "{}.<global {}>"


def _children(obj) -> Iterator[tuple[str, Any, Any]]:
    """``(path format, key, child)`` for each child of ``obj``."""
    if isinstance(obj, torch.Tensor):
        with _compat.no_torch_function():  # the real .grad, also under a MetaMode
            grad = obj.grad if obj.is_leaf else None
            hooks = obj._backward_hooks, getattr(obj, "_post_accumulate_grad_hooks", None)
        if grad is not None:
            yield _ATTR, "grad", grad
        # what its stand-in runs and reads (Note [What a stand-in carries] in tensor/convert.py)
        for key, table in zip(("_backward_hooks", "_post_accumulate_grad_hooks"), hooks):
            if table:
                yield _ATTR, key, table
        for key, value in obj.__dict__.items():
            if not key.startswith("_md"):
                yield _ATTR, key, value
        return
    if type(obj) in (list, tuple) or isinstance(obj, (list, tuple)) and not hasattr(obj, "__dict__"):
        for i, v in enumerate(obj):
            yield _ITEM, i, v
        return
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(list(obj.items())):
            if isinstance(k, _ATOMS):
                yield _KEY, k, v
            else:  # a tensor key (optimizer state): the key by position, then its value
                yield _TENSOR_KEY, i, k
                yield _TENSOR_VALUE, i, v
        return
    if isinstance(obj, (set, frozenset)):
        for i, v in enumerate(sorted(obj, key=repr)):
            yield _MEMBER, i, v
        return
    if isinstance(obj, types.MethodType):
        yield _ATTR, "__self__", obj.__self__
        yield _ATTR, "__func__", obj.__func__
        return
    if isinstance(obj, functools.partial):
        yield _ATTR, "func", obj.func
        yield _ATTR, "args", obj.args
        yield _ATTR, "keywords", obj.keywords
        return
    if isinstance(obj, types.FunctionType):
        yield from _function_children(obj)
        return
    if _walks_dict(obj):
        for k, v in list(vars(obj).items()):
            yield _ATTR, k, v


# Note [The integrations' steps are the user's]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A function from torch or metadispatch closes over nothing of the user's,
# so its closure and globals are not walked -- except the steps
# metadispatch.integrations builds for the user (FitCheck's Trainer loop
# for one batch, ``training_step_fn``): they close over the Trainer, the
# module and its optimizers, and through the Trainer over the callbacks.
# Unwalked, ``md.tracer(restore="all")`` of such a step saved nothing it
# reached that way, and a callback's counters and lists came out of
# FitCheck's dry run changed, holding MetaTensors.
_INTEGRATIONS = "metadispatch.integrations."


def _function_children(fn: types.FunctionType) -> Iterator[tuple[str, Any, Any]]:
    module = _module_of(fn)
    if module.startswith(("torch", "metadispatch")) and not module.startswith(_INTEGRATIONS):
        return
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            yield _CLOSURE, name, cell.cell_contents
        except ValueError:  # an empty cell
            continue
    if fn.__defaults__:
        yield _ATTR, "__defaults__", fn.__defaults__
    if fn.__kwdefaults__:
        yield _ATTR, "__kwdefaults__", fn.__kwdefaults__
    g = fn.__globals__
    for name in sorted(_global_names(fn.__code__)):
        if name in g and not isinstance(g[name], _SKIP) and not _library_callable(g[name]):
            yield _GLOBAL, name, g[name]


def _global_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _library_callable(obj) -> bool:
    """A function or object from torch or the standard library: not the user's state."""
    if isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Generator)):
        return False
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return False
    module = _module_of(obj)
    return callable(obj) and module.split(".")[0] in (
        "torch",
        "builtins",
        "functools",
        "math",
        "metadispatch",
        "numpy",
        "typing",
    )


def _module_of(obj) -> str:
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        module = getattr(type(obj), "__module__", "") or ""
    return module


def _walks_dict(obj) -> bool:
    # Cheapest tests first: torch.Generator's metaclass answers isinstance in
    # Python, and this runs for every object an ``md.trace`` reaches.
    if isinstance(obj, _USER_STATE):
        return True
    if not hasattr(obj, "__dict__"):
        return False
    module = type(obj).__module__ or ""
    if module.split(".")[0] in ("torch", "builtins", "metadispatch", "numpy"):
        return False
    return not isinstance(obj, (torch.Generator, torch.Tensor))


# torch's objects that hold the user's training state (a GradScaler's scale
# and per-optimizer records).
_USER_STATE = (nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


def is_container(obj) -> bool:
    """A list, dict or set (or a subclass: ``OrderedDict``, ``defaultdict``) the user may keep values in."""
    return isinstance(obj, (list, dict, set))


def is_machinery(obj) -> bool:
    """A module, optimizer, scheduler or grad scaler: the training machinery
    ``md.trace`` gives back as it was (Note [What md.trace gives back] in
    tracing/tracer.py)."""
    return isinstance(obj, _USER_STATE)


def holds_state(obj) -> bool:
    """An object whose attributes are the user's state: a module, optimizer,
    scheduler or grad scaler, or an object of a class not from torch or the
    standard library."""
    return _walks_dict(obj) and not isinstance(obj, functools.partial)


def find(roots: dict[str, Any], keep: Callable[[Any], bool], empty: bool = False) -> list:
    """The objects reachable from ``roots`` for which ``keep`` holds, in walk
    order; atoms (numbers, strings, dtypes, ...) are never offered to ``keep``,
    nor empty containers unless ``empty``."""
    out = []
    for _, obj, first in walk(roots, named=False, empty=empty):
        if first is None and keep(obj):
            out.append(obj)
    return out
