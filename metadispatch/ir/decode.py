"""Decoding the typed values a trace file holds, without running anything.

A trace file is data (Note [Tables, not trees] in serialize.py): what JSON
cannot say -- non-finite floats, integers beyond 64 bits, complex numbers,
dtypes, layouts, memory formats, devices -- is a one-key tagged object, and
ops are named ``ns.op.overload``.  Each is decoded here by lookup in a fixed
table or by a number parser, never by ``getattr`` on a name from the file:
``getattr(torch, "onnx")`` imports a package.  The enum tables are read from
``vars(torch)`` once (what torch defines, without its lazy ``__getattr__``),
and an op name must be in the dispatcher's registry before anything is looked
up.  ``reader.py`` turns a raised ``TypeError``/``ValueError`` into a
:class:`TraceFormatError` with the path.

Note [Ops a file may name]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Replay runs every op the file names, so an op with effects outside its tensor
arguments would let a file act on the machine (metadispatch's own ops, in
``ownops.py``, are allowed: they write their tensor argument only): ``aten.from_file(path,
shared=True)`` maps a file of its choosing for writing, ``aten._print``
writes to the terminal, ``aten._backward`` runs autograd, ``profiler::`` ops
and other namespaces do what their library does.  :func:`refusal` says why
an op may not be loaded: outside ``aten``/``prims``; named in ``_EFFECTS``;
existing to raise (asserts, range checks -- their functional forms return a
token, so the next rule misses them -- and torch's ``_test_`` hooks);
returning nothing and writing no argument (so it exists for its effect:
``_print``, cache control); taking a file name, a storage, a stream or a
script object.  A caller names further ops to allow (``allow_ops=``).
"""

from __future__ import annotations

import re

import torch

from .. import _compat
from ..spec.ownops import OWN_OPS, ensure_defined
from ..spec.schema import schema_of
from .records import Group
from .rng import GeneratorRef

__all__ = ["TAGS", "RETURN_TYPES", "resolve_op", "refusal", "decode_device", "decode_group", "DTYPES", "is_marker"]


def _decode_float(v):
    if v not in ("inf", "-inf", "nan"):
        raise ValueError(v)
    return float(v)


def _decode_int(v: str) -> int:
    # int() alone would also take " 12", "1_000" and non-ASCII digits; the
    # length cap keeps int() linear (CPython refuses 4300+ digits anyway).
    if not (isinstance(v, str) and len(v) <= 400 and v.isascii() and v.removeprefix("-").isdigit()):
        raise ValueError(v)
    return int(v)


def _decode_number(v) -> float:
    if not isinstance(v, str) or len(v) > 64:
        raise ValueError(v)
    return float(v)  # float() parses numbers only


def _decode_complex(v) -> complex:
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError(v)
    return complex(_decode_number(v[0]), _decode_number(v[1]))


def _table(kind) -> dict:
    return {n: v for n, v in vars(torch).items() if isinstance(v, kind) and not n.startswith("_")}


DTYPES = _table(torch.dtype)  # "float32" -> torch.float32, "float" too
_ENUMS = {kind: _table(kind) for kind in (torch.dtype, torch.layout, torch.memory_format)}


def _enum(kind):
    table = _ENUMS[kind]

    def decode(name):
        v = table.get(name) if isinstance(name, str) else None
        if v is None:
            raise ValueError(name)
        return v

    return decode


def _return_types() -> dict:
    """``"topk"`` -> ``torch.return_types.topk``: the named tuples torch's ops return.

    Read from ``vars(torch.return_types)`` once, like the enum tables: a file
    names one of these classes and the reader looks the name up here, so a
    file can name nothing else (no import, no ``getattr``).  Only structseq
    classes -- tuple subclasses torch defines there -- are taken.
    """
    # Keyed by the class's own name: the module also holds a leftover loop
    # variable (``_attr``) bound to one of the classes.
    return {
        v.__name__: v
        for v in vars(torch.return_types).values()
        if isinstance(v, type)
        and issubclass(v, tuple)
        and v.__module__ == "torch.return_types"
        and hasattr(v, "n_sequence_fields")
    }


RETURN_TYPES = _return_types()


# Device types a trace may name; str(torch.device) spells them so.
_DEVICE = re.compile(
    r"(cpu|cuda|meta|mps|xpu|hpu|mtia|xla|lazy|ipu|maia|privateuseone)"
    r"(?::(0|[1-9][0-9]{0,3}))?"
)


def decode_device(name) -> torch.device:
    """``"cuda:1"`` as a device, from a fixed set of types and a small index."""
    m = _DEVICE.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(name)
    return torch.device(m[1]) if m[2] is None else torch.device(m[1], int(m[2]))


def _decode_generator(v) -> GeneratorRef:
    # Replay checks the index against the trace's generators.
    if type(v) is not int or not 0 <= v < 1 << 31:
        raise ValueError(v)
    return GeneratorRef(v)


_MAX_GROUP = 1 << 20  # ranks in one process group


def decode_group(v) -> Group:
    """``[name, size, rank, [global ranks]]``: a process group a collective ran on (version 4)."""
    name, size, rank, ranks = v
    if not (isinstance(name, str) and 0 < len(name) <= 200 and name.isprintable()):
        raise ValueError(name)
    if not (type(size) is int and 0 < size <= _MAX_GROUP and type(rank) is int and 0 <= rank < size):
        raise ValueError(v)
    if not (
        isinstance(ranks, list) and len(ranks) == size and all(type(r) is int and 0 <= r < _MAX_GROUP for r in ranks)
    ):
        raise ValueError(v)
    return Group(name, size, rank, tuple(ranks))


TAGS = {  # tag -> decoder; a decoder raises TypeError/ValueError on a bad value
    "float": _decode_float,
    "int": _decode_int,
    "dtype": _enum(torch.dtype),
    "layout": _enum(torch.layout),
    "memory_format": _enum(torch.memory_format),
    "device": decode_device,
    "complex": _decode_complex,
    "generator": _decode_generator,
    "group": decode_group,
}

_OP_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")
_registered: frozenset = frozenset()


def resolve_op(name: str):
    """The OpOverload called ``ns.op.overload``, or None; never runs anything else.

    The name must be in the dispatcher's registry before any attribute is
    looked up, so a file cannot create namespaces or reach ``torch.ops``'s
    own methods.

    >>> resolve_op("aten.mm.default")
    <OpOverload(op='aten.mm', overload='default')>
    >>> resolve_op("os.system.default") is None
    True
    """
    global _registered
    m = _OP_NAME.fullmatch(name) if isinstance(name, str) and len(name) <= 256 else None
    if m is None or m[1].startswith("__") or m[2].startswith("__"):
        return None
    ns, op, overload = m.groups()
    qualified = f"{ns}::{op}" if overload == "default" else f"{ns}::{op}.{overload}"
    if qualified in OWN_OPS:
        ensure_defined()  # Note [Data-dependent initialisers] in ownops.py
    if qualified not in _registered:
        _registered = _compat.registered_op_names()  # ops registered since
        if qualified not in _registered:
            return None
    try:
        func = getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        return None
    return func if isinstance(func, _compat.OpOverload) else None


_EFFECTS = {  # aten ops whose effects reach past their tensors (Note [Ops a file may name])
    "aten::from_file",
    "aten::from_file.out",
    "aten::_print",
    "aten::_backward",
    "aten::record_stream",
    "aten::_cufft_clear_plan_cache",
    "aten::_cufft_set_plan_cache_max_size",
}
_OPAQUE_TYPES = ("Storage", "Stream", "ScriptObject", "Any", "__torch__", "Capsule")
_FILE_ARGS = {"filename", "file", "path", "f"}
# Ops that exist to raise: asserts and range checks (``_functional_assert_*``
# thread a ``dep_token`` so that functionalization keeps them), and torch's
# own test hooks, which warn.
_RAISES = re.compile(r"_*(?:functional_)?(?:assert|sym_constrain_range|test_)")
_TOKEN_ARG = "dep_token"


# Note [Checks a trace records]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``F.one_hot`` records eager's CPU class checks as ``aten._assert_async.msg``
# (Note [one_hot's checks] in values/composites.py), so that replay raises
# where eager does.  A file may name it with eager's messages only: the op
# raises its message, which a file must not choose (tests/hostile_traces.py).
RECORDED_CHECKS = {
    "aten::_assert_async.msg": frozenset(
        {"Class values must be non-negative.", "Class values must be smaller than num_classes."}
    ),
}


# record_function's ranges: markers in a trace, which replay never runs
# (Note [record_function ranges in a trace] in core/dispatch.py).
MARKERS = frozenset({"profiler::_record_function_enter_new", "profiler::_record_function_exit"})


def is_marker(func) -> bool:
    """Whether op ``func`` is one of record_function's markers (any overload)."""
    return schema_of(func).name in MARKERS


def refusal(func) -> str | None:
    """Why replay must not run ``func`` (Note [Ops a file may name]), or None."""
    schema = schema_of(func)
    name = func.name()
    if is_marker(func):
        return None
    if name.partition("::")[0] not in ("aten", "prims") and name not in OWN_OPS:
        return "it is not an aten or prims op"
    if name in _EFFECTS:
        return "it acts outside its tensor arguments (files, printing, autograd, streams)"
    args = schema.arguments
    if _RAISES.match(name.partition("::")[2]) or any(a.name == _TOKEN_ARG for a in args):
        return "it exists to raise or warn (an assert, a range check, a test hook)"
    if not schema.returns and not any(a.alias_info is not None and a.alias_info.is_write for a in args):
        return "it returns nothing and writes no argument, so it runs for an effect"
    for a in args:
        t = str(a.type)
        if any(k in t for k in _OPAQUE_TYPES) or (a.name in _FILE_ARGS and t.startswith("str")):
            return f"its argument {a.name!r} ({t}) reaches outside tensors"
    return None
