"""Decoding the typed values a trace file holds, without running anything.

A trace file is data (Note [Tables, not trees] in serialize.py): what JSON
cannot say -- non-finite floats, integers beyond 64 bits, complex numbers,
dtypes, layouts, memory formats, devices -- is a one-key tagged object, and
ops are named ``ns.op.overload``.  Each is decoded here by lookup or by a
number parser: a name must be an attribute torch defines with the right
type, an op an existing ``OpOverload``.  ``reader.py`` turns a raised
``TypeError``/``ValueError`` into a :class:`TraceFormatError` with the path.
"""

from __future__ import annotations

import torch

__all__ = ["TAGS", "resolve_op"]


def _decode_float(v):
    if v not in ("inf", "-inf", "nan"):
        raise ValueError(v)
    return float(v)


def _decode_int(v: str) -> int:
    # int() alone would also take " 12", "1_000" and non-ASCII digits.
    if not (isinstance(v, str) and v.isascii() and v.removeprefix("-").isdigit()):
        raise ValueError(v)
    return int(v)


def _decode_complex(real: str, imag: str) -> complex:
    return complex(float(real), float(imag))  # float() parses numbers only


def _enum(kind):
    def decode(name):
        v = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
        if not isinstance(v, kind):
            raise ValueError(name)
        return v
    return decode


TAGS = {  # tag -> decoder; a decoder raises TypeError/ValueError on a bad value
    "float": _decode_float,
    "int": _decode_int,
    "dtype": _enum(torch.dtype),
    "layout": _enum(torch.layout),
    "memory_format": _enum(torch.memory_format),
    "device": torch.device,
    "complex": lambda v: _decode_complex(*v),
}


def resolve_op(name: str):
    """The OpOverload called ``ns.op.overload``, or None; never runs anything else.

    >>> resolve_op("aten.mm.default")
    <OpOverload(op='aten.mm', overload='default')>
    >>> resolve_op("os.system.default") is None
    True
    """
    parts = name.split(".")
    if len(parts) != 3 or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        return None
    ns, op, overload = parts
    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or overload not in packet.overloads():
        return None
    func = getattr(packet, overload)
    return func if isinstance(func, torch._ops.OpOverload) else None
