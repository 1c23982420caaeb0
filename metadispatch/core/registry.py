"""The rule registry: ``@register_meta(op)`` and the built-in rule table.

A rule is a plain function called with the op's arguments (MetaTensors in
place of tensors) that returns what the op would return.  It runs with
metadispatch active but not recording, so it can build its outputs with
ordinary torch calls (``torch.empty(..., device=x.device)``,
``x.new_empty(...)``); those calls are not recorded as separate calls.

A rule that declares a keyword-only ``fallback`` parameter is handed a
callable running the rest of the router (native meta kernel, then
decomposition), so it can refine or check torch's answer instead of
replacing it.

Registering the same op twice raises unless ``override=True``; a packet
(``torch.ops.aten.add``) expands to all its overloads, as in
``torch._decomp.register_decomposition``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from .. import _compat
from ..spec.schema import op_name, schema_of

__all__ = ["register_meta", "unregister_meta", "builtin_rule", "rule_for", "resolve_ops", "rule_skeleton", "version"]

_USER: dict = {}
_BUILTIN: dict = {}
_WANTS_FALLBACK: set = set()
_version = [0]  # bumped on every change; caches key on it


def version() -> int:
    return _version[0]


def resolve_ops(op) -> list:
    """OpOverload, OpOverloadPacket, or "ns::name[.overload]" -> overloads."""
    if isinstance(op, (list, tuple)):
        return [o for x in op for o in resolve_ops(x)]
    if isinstance(op, _compat.OpOverload):
        return [op]
    if isinstance(op, _compat.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    if isinstance(op, str):
        ns, sep, rest = op.partition("::")
        if not sep:
            ns, _, rest = op.partition(".")
        name, _, overload = rest.partition(".")
        try:
            packet = getattr(getattr(torch.ops, ns), name)
        except (AttributeError, RuntimeError) as e:
            raise ValueError(f"register_meta: no op named {op!r} is registered with torch") from e
        if overload:
            return [getattr(packet, overload)]
        return resolve_ops(packet)
    raise TypeError(
        f"register_meta: expected an OpOverload, OpOverloadPacket or 'ns::name' string, got {type(op).__name__}: {op!r}"
    )


def _register(table: dict, ops: list, fn: Callable, override: bool) -> Callable:
    if not override:
        taken = [op_name(o) for o in ops if o in table]
        if taken:
            raise RuntimeError(
                f"a meta rule is already registered for {', '.join(taken)}; pass override=True to replace it"
            )
    wants = "fallback" in inspect.signature(fn).parameters
    for o in ops:
        table[o] = fn
        (_WANTS_FALLBACK.add if wants else _WANTS_FALLBACK.discard)(fn)
    _version[0] += 1
    return fn


def register_meta(op, *, override: bool = False) -> Callable:
    """Register a user meta rule for ``op``; it wins over every other stage.

    >>> import torch, metadispatch as md
    >>> lib = torch.library.Library("mdexample", "DEF")
    >>> _ = lib.define("scale(Tensor x, float s) -> Tensor")
    >>> @md.register_meta("mdexample::scale")
    ... def scale_meta(x, s):
    ...     return torch.empty_like(x)
    >>> t = md.trace(lambda x: torch.ops.mdexample.scale(x, 2.0), torch.ones(3))
    >>> print(t[0].format())
    $1: f32[3] = mdexample.scale.default($0, 2.0)  # [user]
    >>> md.unregister_meta("mdexample::scale")
    """
    ops = resolve_ops(op)  # a bad target fails here, not at first use

    def decorator(fn: Callable) -> Callable:
        return _register(_USER, ops, fn, override)

    return decorator


def unregister_meta(op) -> None:
    """Remove the user rules for ``op`` (all overloads of a packet)."""
    for o in resolve_ops(op):
        _USER.pop(o, None)
    _version[0] += 1


def builtin_rule(op, *, override: bool = False) -> Callable:
    """Register a built-in rule (used by ``metadispatch/rules``)."""
    ops = resolve_ops(op)

    def decorator(fn: Callable) -> Callable:
        return _register(_BUILTIN, ops, fn, override)

    return decorator


def rule_for(func):
    """(rule, stage) for ``func`` from the user and built-in tables, else (None, None)."""
    fn = _USER.get(func)
    if fn is not None:
        return fn, "user"
    fn = _BUILTIN.get(func)
    if fn is not None:
        return fn, "builtin"
    return None, None


def wants_fallback(fn) -> bool:
    return fn in _WANTS_FALLBACK


def rule_skeleton(func) -> str:
    """A ``@register_meta`` rule to fill in, with the op's schema as its signature."""
    schema = schema_of(func)
    params = []
    for a in schema.arguments:
        if a.kwarg_only and "*" not in params:
            params.append("*")
        params.append(
            a.name
            if a.default_value is None and not a.kwarg_only
            else f"{a.name}={a.default_value!r}"
            if a.default_value is not None
            else f"{a.name}=None"
        )
    fn_name = f"{schema.name.split('::')[-1]}_{schema.overload_name or 'default'}_meta"
    ns, _, name = schema.name.partition("::")
    target = f"{ns}::{name}" + (f".{schema.overload_name}" if schema.overload_name else "")
    return (
        f'@metadispatch.register_meta("{target}")\n'
        f"def {fn_name}({', '.join(params)}):\n"
        f"    # schema: {schema}\n"
        f"    # return tensors with the shape, dtype, strides and device the real kernel gives\n"
        f"    raise NotImplementedError"
    )
