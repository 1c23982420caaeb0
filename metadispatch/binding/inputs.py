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
* a MetaTensor, a FakeTensor or a tensor on ``meta`` anywhere: it holds no data;
* a tensor laid out otherwise than when traced (Note [Inputs keep their layout]),
  or tensors that overlapped when traced and do not, or overlap otherwise;
* a device that is not available here.

Note [Inputs keep their layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Equal values are not enough for eager's bits: a float32 ``sum`` adds in the
order its input lies in memory, so ``x.t().contiguous()`` and ``x.t()`` sum
to different last bits (1 ulp on a 257x513 input), and every call's
recorded metadata still matches.  So a given tensor must have the strides
that were recorded (the significant ones, Note [Significant strides] in
ir/compare.py), and tensors that shared memory when traced must share it
again, at the same distance: ``f(x[:4], x[2:6])`` writing its first
argument changes its second in eager, and two separate tensors would not.
The storage offset of a tensor alone is not compared -- it moves no
element of the result -- only offsets between tensors of one memory.

Passing nothing at all (``md.replay(trace)``) is allowed: every leaf is then
made up and listed in ``Replay.made_up``.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import _compat
from .._compat import pytree
from ..errors import ReplayInputError
from ..ir.compare import describe, differences
from ..ir.records import arg_name, attribute_tensors, describe_constant
from ..ir.trace import Trace
from ..tensor.tensor import MetaTensor, normalize_device

__all__ = ["given_tensors", "check_inputs", "check_device"]

_FROM_MODULE = ("param", "buffer", "grad")


def given_tensors(args, kwargs, module, flat: list | None = None) -> dict:
    """(kind, name) -> tensor, named as ``md.trace`` named them.

    A tensor argument's ``.grad`` is ``("grad", its name)``, as a parameter's
    is.  ``flat`` is :func:`flat_inputs` of ``args`` and ``kwargs``, when the
    caller has it.
    """
    named, modules = {}, [module] if module is not None else []
    for name, v in flat_inputs(args, kwargs) if flat is None else flat:
        if isinstance(v, torch.Tensor):
            named[("arg", name)] = v
            if v.grad is not None:
                named[("grad", name)] = v.grad
        elif isinstance(v, nn.Module):
            modules.append(v)
    buffers: list = []
    for mod in modules:
        params, bufs = _named_tensors(mod)
        for name, p in params:
            if nn.parameter.is_lazy(p):
                continue  # Note [Lazy modules in replay]
            named.setdefault(("param", name), p)
            if p.grad is not None:
                named.setdefault(("grad", name), p.grad)
        buffers += bufs
    for name, b in buffers:
        if not nn.parameter.is_lazy(b):
            named.setdefault(("buffer", name), b)
    for mod in modules:  # Note [Values fixed into a trace] in execution/matching.py
        for name, t in attribute_tensors(mod):
            named.setdefault(("const", name), t)
    return named


# Note [Lazy modules in replay]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A lazy module (``nn.LazyLinear``) holds ``UninitializedParameter``s until
# its first forward; a traced step that runs that forward records the
# materialisation as construction (``empty``, then the init's ``uniform_``),
# not as parameter leaves, and md.trace leaves the user's module as it was.
# Replay given that module again must not touch the uninitialised tensors:
# they hold no storage, and asking for one raises torch's ValueError inside
# the write guard.  They are no tensors replay could bind or write, so they
# are not among those given.


def flat_inputs(args, kwargs) -> list:
    """(name, value) of each leaf of ``args`` and ``kwargs``, named as ``md.trace`` names arguments."""
    return [(arg_name(p), v) for p, v in pytree.tree_flatten_with_path((tuple(args), kwargs or {}))[0]]


_WALK = (nn.Module.named_modules, nn.Module.named_parameters, nn.Module.named_buffers, _compat.module_named_members)
_PLAIN: dict = {}  # module class -> it names its tensors as nn.Module does


def _named_tensors(mod: nn.Module) -> tuple:
    """``named_parameters`` and ``named_buffers`` of ``mod`` (``remove_duplicate=False``), in one walk.

    Each of torch's methods walks every submodule through nested generators;
    replay asks for both on every run, which on a small model cost as much as
    a twentieth of the step.  The walk here yields the same names in the same
    order; a module whose class overrides any of those methods gets torch's own.
    """
    params: list = []
    buffers: list = []
    stack = [("", mod)]
    while stack:
        prefix, m = stack.pop()
        cls = type(m)
        plain = _PLAIN.get(cls)
        if plain is None:
            plain = _PLAIN[cls] = (
                cls.named_modules,
                cls.named_parameters,
                cls.named_buffers,
                cls._named_members,
            ) == _WALK
        if not plain:
            return list(mod.named_parameters(remove_duplicate=False)), list(mod.named_buffers(remove_duplicate=False))
        for k, v in m._parameters.items():
            if v is not None:
                params.append((prefix + k, v))
        for k, b in m._buffers.items():
            if b is not None:
                buffers.append((prefix + k, b))
        subs = [(f"{prefix}{k}.", sub) for k, sub in m._modules.items() if sub is not None]
        stack += reversed(subs)  # depth first, in order, as named_modules
    return params, buffers


def check_inputs(trace: Trace, args, kwargs, module) -> dict:
    """Raise :class:`ReplayInputError` for inputs that cannot be bound (see the
    module docstring); else return :func:`given_tensors` of them."""
    if not isinstance(args, (tuple, list)):
        raise ReplayInputError(
            f"replay: args must be a tuple of the traced call's positional arguments, got {type(args).__name__}"
        )
    if module is not None and not isinstance(module, nn.Module):
        raise ReplayInputError(f"replay: module must be an nn.Module, got {type(module).__name__}")
    flat = flat_inputs(args, kwargs)
    given = given_tensors(args, kwargs, module, flat)
    for (kind, name), t in given.items():
        what = _dataless(t)
        if what:
            raise ReplayInputError(f"replay: {kind} {name} is {what} and holds no data; pass the real tensor or module")
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
    _check_constants(trace, args, kwargs, module, flat)
    args_named = set(trace.arg_names or ())
    from_module = module is not None or any(k not in ("arg", "grad") or n not in args_named for k, n in given)
    for leaf in needed:
        if leaf.kind in _FROM_MODULE and (leaf.kind, leaf.name) not in given:
            if leaf.kind == "grad" and leaf.name in args_named:
                if args or kwargs:
                    raise ReplayInputError(
                        f"replay: argument {leaf.name} had a .grad when traced, which backward "
                        "accumulated into; the tensor given has none (set it, or trace without it)"
                    )
            elif from_module:
                raise ReplayInputError(_not_in_module(leaf, given))
    _check_grads(trace, given)
    _check_layouts(trace, given)
    _check_aliasing(trace, given)
    return given


def _check_constants(trace: Trace, args, kwargs, module, flat: list) -> None:
    """Note [Non-tensor arguments are constants] (ir/records.py): the same, or refused."""
    passed = [n for n, v in flat if isinstance(v, nn.Module)]
    if module is not None and passed:
        raise ReplayInputError(
            f"replay: a module was given as argument {passed[0]} and as module=; pass it once "
            "(module= is for a module the traced code reached without being given it)"
        )
    recorded = trace.arg_constants
    if recorded is None or not (args or kwargs):
        return
    given = {n: describe_constant(v) for n, v in flat if not isinstance(v, torch.Tensor)}
    for name, was in recorded.items():
        now = given.get(name)
        if now != was:
            raise ReplayInputError(
                f"replay: argument {name}: the trace ran with {was}, "
                f"{'it was not given' if now is None else f'got {now}'} "
                "(a non-tensor argument is a constant of the trace: trace again to change it)"
            )
    extra = sorted(set(given) - set(recorded) - set(trace.arg_names or ()))
    if extra:
        raise ReplayInputError(
            f"replay: argument {extra[0]} ({given[extra[0]]}) was not an argument of the traced call"
        )


def _check_grads(trace: Trace, given: dict) -> None:
    """A ``.grad`` the traced step would accumulate into: given iff it was there when traced."""
    if not any(kind == "grad" for kind, _ in given):
        return
    leaves = {(leaf.kind, leaf.name) for leaf in trace.leaves.values()}
    accumulated = set(trace.grads) | {
        leaf.name for leaf in trace.leaves.values() if leaf.kind == "arg" and leaf.meta.requires_grad
    }
    backward = any(c.phase == "backward" for c in trace.calls)
    for kind, name in given:
        if kind == "grad" and ("grad", name) not in leaves and backward and name in accumulated:
            owner = "param" if ("param", name) in given else "argument"
            raise ReplayInputError(
                f"replay: {owner} {name} has a .grad, but had none when traced: eager would "
                "accumulate into it, the trace does not (set it to None, or trace with it)"
            )


def _check_aliasing(trace: Trace, given: dict) -> None:
    """The tensors given alias each other as the traced ones did, or a refusal naming them.

    Tied weights are the common case: a module whose head shares the
    embedding's weight reads one tensor where an untied one reads two.
    """
    for alias, canonical in (trace.aliases or {}).items():
        a, c = tuple(alias.split(" ", 1)), tuple(canonical.split(" ", 1))
        if c in given and given.get(a) is not given[c]:
            raise ReplayInputError(
                f"replay: {alias} was the same tensor as {canonical} when traced (tied); "
                f"in what was given it is {'missing' if a not in given else 'a tensor of its own'}"
            )
    by_storage: dict = {}  # real storage -> (recorded storage number, leaf)
    by_record: dict = {}  # recorded storage number -> (real storage, real offset - recorded offset, leaf)
    for leaf in trace.leaves.values():
        t = given.get((leaf.kind, leaf.name))
        if t is None or t.layout != torch.strided:
            continue
        key, m = _compat.storage_key(t), leaf.meta
        seen = by_storage.setdefault(key, (m.storage, leaf))
        if seen[0] != m.storage:
            raise ReplayInputError(
                f"replay: {seen[1].kind} {seen[1].name} and {leaf.kind} {leaf.name} share memory "
                "in what was given (tied, or the same tensor twice) but were separate tensors "
                "when traced; eager would see writes to one in the other"
            )
        # Note [Inputs keep their layout]: memory shared when traced is shared again, at the same distance.
        first = by_record.setdefault(m.storage, (key, t.storage_offset() - m.storage_offset, leaf))
        if first[:2] != (key, t.storage_offset() - m.storage_offset):
            other = first[2]
            raise ReplayInputError(
                f"replay: {other.kind} {other.name} and {leaf.kind} {leaf.name} shared memory when "
                f"traced ({leaf.name} at {m.storage_offset - other.meta.storage_offset:+} elements from "
                f"{other.name}); in what was given they "
                + ("do not" if first[0] != key else "overlap otherwise")
                + ", and eager would see writes to one in the other as traced"
            )


def _check_layouts(trace: Trace, given: dict) -> None:
    """Note [Inputs keep their layout]: each given tensor has its recorded strides."""
    for leaf in trace.leaves.values():
        t = given.get((leaf.kind, leaf.name)) if leaf.kind in ("arg", *_FROM_MODULE) else None
        if t is None or t.layout != torch.strided or tuple(t.shape) != leaf.meta.shape:
            continue  # another shape is bind_leaves' refusal
        diff = [d for d in differences(leaf.meta, t) if d[0] == "stride"]
        if diff:
            raise ReplayInputError(
                f"replay: {leaf.kind} {leaf.name}: {describe(*diff[0])} (recorded != given); a kernel's "
                "result can depend on the order its input lies in memory, so replay runs the layout "
                "that was traced (pass a tensor laid out like it, or trace with this one)"
            )


def _dataless(t: torch.Tensor) -> str:
    """What ``t`` is if it holds no data replay could run on, else ''."""
    if isinstance(t, MetaTensor) or t.is_meta:
        return "a MetaTensor (or on meta)"
    if _compat.is_fake(t):
        return "a FakeTensor"
    return ""


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
    kind = d.type
    if kind == "cpu":
        return d
    if kind == "meta":
        raise ReplayInputError("replay: device 'meta' runs no kernels; replay on a real device")
    if kind == "cuda" and not (torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count()):
        raise ReplayInputError(f"replay: device {d} is not available here ({torch.cuda.device_count()} CUDA devices)")
    try:
        torch.empty(0, device=d)
    except Exception as e:  # any backend's way of saying it is not there
        raise ReplayInputError(f"replay: device {d} is not available here: {e}") from None
    return d
