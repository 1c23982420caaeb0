"""Trace files holding one call of a position case (tests/position_cases.py), written as an attacker writes them.

:func:`arguments` gives a case's arguments by schema name with one bad
variant applied; :func:`case_doc` appends the call to the document of the
small valid trace every hostile file starts from (hostile_doc.base_doc):
each tensor argument a constant leaf holding its values (or, with
``fill=``, the output of an ``aten.full`` call in the file), the outputs
recorded as the legitimate call returns them, and the call's outputs the
trace's output -- no tracing, so no meta kernel stands between the file
and replay.  Replayed against ``hostile_doc.user_tensors()``.
"""

from __future__ import annotations

import math

import torch

from tests.hostile_doc import Doc, ref
from tests.hostile_memory import const

__all__ = ["arguments", "split", "case_doc", "eager", "bitwise"]


def arguments(case, bad=None) -> dict:
    """The case's legitimate arguments by name, with ``bad`` (argument, value, ...) applied."""
    args, kwargs = case.build()
    a = _bind(case.op, args, kwargs)
    if bad is not None:
        name, value = bad[0], bad[1]
        a[name] = value(a) if callable(value) else value
    return a


def _bind(op, args, kwargs) -> dict:
    out = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    out.update(zip((a.name for a in op._schema.arguments), args))
    out.update(kwargs)
    return out


def split(op, a: dict) -> tuple:
    """Arguments by name back into (args, kwargs) as the schema takes them."""
    args, kwargs = [], {}
    for arg in op._schema.arguments:
        if arg.name not in a:
            continue
        if arg.kwarg_only:
            kwargs[arg.name] = a[arg.name]
        else:
            args.append(a[arg.name])
    return tuple(args), kwargs


def eager(case, a: dict):
    """The op run on (copies of) ``a``: what a replay of the legitimate call must return."""
    args, kwargs = split(case.op, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()})
    with torch.enable_grad() if case.grad else torch.no_grad():
        return case.op(*args, **kwargs)


def case_doc(base: dict, case, a: dict, fill: str | None = None) -> Doc:
    """The base document with ``case.op`` called on ``a`` appended, its outputs the trace's output.

    ``fill`` names a tensor argument made by ``aten.full`` in the file (from
    its first value) instead of stored as a constant.
    """
    d = Doc(base)
    args, kwargs = split(case.op, a)

    def encode(v, name=None):
        if isinstance(v, torch.Tensor):
            if fill is not None and name == fill:
                return ref(_full(d, v))
            return ref(const(d, v))
        if isinstance(v, (list, tuple)):
            return [encode(x) for x in v]
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, float) and not math.isfinite(v):
            return {"float": str(v)}
        return v

    names = [arg.name for arg in case.op._schema.arguments if not arg.kwarg_only]
    enc_args = [encode(v, names[k]) for k, v in enumerate(args)]
    enc_kwargs = {k: encode(v, k) for k, v in kwargs.items()}
    outs = [_record(d, r) for r in _returns(case, eager(case, arguments(case)))]
    d.call(str(case.op), enc_args, enc_kwargs, outs)
    d.d["output"] = outs if len(outs) != 1 else outs[0]
    return d


def _returns(case, result) -> list:
    return [result] if len(case.op._schema.returns) == 1 else list(result)


def _record(d: Doc, value):
    if value is None:  # an undefined tensor: recorded empty (Note [Undefined outputs] in execution/matching.py)
        return ref(d.tensor(d.next_id(), [0]))
    if not isinstance(value, torch.Tensor):
        return value
    dtype = str(value.dtype).removeprefix("torch.")
    return ref(d.tensor(d.next_id(), list(value.shape), dtype=dtype, stride=list(value.stride())))


def _full(d: Doc, like: torch.Tensor) -> int:
    """``aten.full`` of ``like``'s shape and dtype, filled with its first value: a row of the tensors table."""
    dtype = str(like.dtype).removeprefix("torch.")
    row = d.tensor(d.next_id(), list(like.shape), dtype=dtype)
    value = like.reshape(-1)[0].item() if like.numel() else 0
    d.call("aten.full.default", [list(like.shape), value], {"dtype": {"dtype": dtype}}, [ref(row)])
    return row


def bitwise(a, b) -> bool:
    """Equal values, bit for bit (NaNs included), of tensors or nested tuples of them."""
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(bitwise(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b or (a is None and isinstance(b, torch.Tensor) and b.numel() == 0)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)
