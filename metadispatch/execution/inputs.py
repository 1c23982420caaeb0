"""What replay is handed: check it can be bound to the trace, or refuse by name.

Replay binds the caller's tensors to the trace's leaves by the names
``md.trace`` gave them (``args[0]``, ``mask``, ``fc1.weight``).  An input it
cannot bind must not be quietly replaced by made-up values -- the result
would be "ok" about numbers eager never computes -- so each of these is a
:class:`~metadispatch.errors.ReplayInputError` naming the argument or
parameter:

* an argument the trace read that was not given, or given as something
  other than a tensor (a numpy array, a list);
* a tensor argument the traced call was not given (an extra one), when the
  trace knows its arguments (files of format 4 and later);
* a module without a parameter or buffer the trace read (differently named),
  or without the ``.grad`` the trace accumulated into;
* a MetaTensor (or a tensor on ``meta``) anywhere: it holds no data;
* a device that is not available here.

Passing nothing at all (``md.replay(trace)``) is allowed: every leaf is then
made up and listed in ``Replay.made_up``.
"""

from __future__ import annotations

import torch
from torch import nn

from .._compat import pytree
from ..core.tensor import MetaTensor, normalize_device
from ..errors import ReplayInputError
from ..ir.records import arg_name
from ..ir.trace import Trace

__all__ = ["given_tensors", "check_inputs", "check_device"]

_FROM_MODULE = ("param", "buffer", "grad")


def given_tensors(args, kwargs, module) -> dict:
    """(kind, name) -> tensor, named as ``md.trace`` named them."""
    named, modules = {}, [module] if module is not None else []
    for path, v in pytree.tree_flatten_with_path((tuple(args), kwargs or {}))[0]:
        if isinstance(v, torch.Tensor):
            named[("arg", arg_name(path))] = v
        elif isinstance(v, nn.Module):
            modules.append(v)
    for mod in modules:
        for name, p in mod.named_parameters(remove_duplicate=False):
            named.setdefault(("param", name), p)
            if p.grad is not None:
                named.setdefault(("grad", name), p.grad)
        for name, b in mod.named_buffers(remove_duplicate=False):
            named.setdefault(("buffer", name), b)
    return named


def check_inputs(trace: Trace, args, kwargs, module) -> dict:
    """Raise :class:`ReplayInputError` for inputs that cannot be bound (see the
    module docstring); else return :func:`given_tensors` of them."""
    if not isinstance(args, (tuple, list)):
        raise ReplayInputError(
            f"replay: args must be a tuple of the traced call's positional arguments, got {type(args).__name__}"
        )
    if module is not None and not isinstance(module, nn.Module):
        raise ReplayInputError(f"replay: module must be an nn.Module, got {type(module).__name__}")
    given = given_tensors(args, kwargs, module)
    for (kind, name), t in given.items():
        if isinstance(t, MetaTensor) or t.device.type == "meta":
            raise ReplayInputError(
                f"replay: {kind} {name} is a MetaTensor (or on meta) and holds no data; pass the real tensor or module"
            )
    needed = [leaf for leaf in trace.leaves.values() if leaf.kind in ("arg", *_FROM_MODULE)]
    if args or kwargs:
        for leaf in needed:
            if leaf.kind == "arg" and ("arg", leaf.name) not in given:
                found = _found(args, kwargs or {}, leaf.name)
                raise ReplayInputError(
                    f"replay: argument {leaf.name}: the trace read a tensor {leaf.meta.type_str()} "
                    f"there, {'but it was not given' if found is None else f'got {found}'}"
                )
        if trace.arg_names is not None:
            extra = sorted(n for k, n in given if k == "arg" and n not in set(trace.arg_names))
            if extra:
                raise ReplayInputError(
                    f"replay: argument {extra[0]} was not an argument of the "
                    f"traced call (it had {', '.join(trace.arg_names) or 'none'})"
                )
    if module is not None or any(k != "arg" for k, _ in given):
        for leaf in needed:
            if leaf.kind in _FROM_MODULE and (leaf.kind, leaf.name) not in given:
                raise ReplayInputError(_not_in_module(leaf, given))
    return given


def _found(args, kwargs, name: str) -> str | None:
    """The type of what was given where the trace had argument ``name``."""
    tops = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    for top, v in tops:
        if name == top or name.startswith(top + "["):
            cls = type(v)
            return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return None


def _not_in_module(leaf, given: dict) -> str:
    if leaf.kind == "grad":
        return (
            f"replay: param {leaf.name} had a .grad when traced, which backward accumulated "
            "into; the module given has none (set it, or trace without it)"
        )
    kind = "parameter" if leaf.kind == "param" else "buffer"
    have = [n for k, n in given if k == leaf.kind]
    shown = ", ".join(have[:6]) + (", ..." if len(have) > 6 else "")
    return f"replay: {leaf.kind} {leaf.name}: the module given has no {kind} of that name (it has {shown or 'none'})"


def check_device(device) -> torch.device:
    """``device`` as a torch.device where real kernels can run here, else a refusal."""
    try:
        d = normalize_device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ReplayInputError(f"replay: device {device!r} is not a device: {e}") from None
    if d.type == "meta":
        raise ReplayInputError("replay: device 'meta' runs no kernels; replay on a real device")
    if d.type == "cuda" and not (torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count()):
        raise ReplayInputError(f"replay: device {d} is not available here ({torch.cuda.device_count()} CUDA devices)")
    try:
        torch.empty(0, device=d)
    except Exception as e:  # any backend's way of saying it is not there
        raise ReplayInputError(f"replay: device {d} is not available here: {e}") from None
    return d
