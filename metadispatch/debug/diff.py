"""Comparing traces: a canonical printed form and a unified diff of two.

Two traces are *equivalent* when they run the same ops, in the same order, on
tensors of the same types (dtype, shape, strides, device), with the same
non-tensor arguments.  The printed form of a trace almost says this, but it
also says things that differ between equivalent runs, so the canonical form
(:func:`canonical`) leaves them out or rewrites them:

- ids are renumbered in order of first appearance, so a trace that met a
  parameter earlier than another still compares equal;
- which router stage answered a call (``[decomp]``) is dropped: it follows
  from the torch version, not from the model;
- floats are rounded to 8 significant digits: an init bound computed in a
  slightly different order is the same bound;
- keyword arguments that hold their default (``pin_memory=False``,
  ``memory_format=torch.preserve_format``) are dropped: torch's Python
  bindings pass them or not depending on the version;
- memory addresses and absolute paths, should a constant's ``repr`` carry
  one, are masked;
- module attribution and leaf names are kept only when asked for, since a
  refactor that renames ``fc`` to ``proj`` runs the same ops.

>>> import torch, metadispatch as md
>>> a = md.trace(lambda x: x.relu().sum(), torch.ones(2))
>>> b = md.trace(lambda x: x.sigmoid().sum(), torch.ones(2))
>>> print(md.diff(a, b))
--- a
+++ b
@@ -1,3 +1,3 @@
 $0: f32[2] = arg
-$1: f32[2] = aten.relu.default($0)
+$1: f32[2] = aten.sigmoid.default($0)
 $2: f32[] = aten.sum.default($1)
>>> md.diff(a, a)
''
"""

from __future__ import annotations

import difflib
import re

import torch

from ..ir.trace import OpCall, Trace

__all__ = ["diff", "canonical"]

# Keyword values that mean "the default" whatever the schema says.
_DEFAULT_LIKE = {
    ("pin_memory", False),
    ("layout", torch.strided),
    ("memory_format", torch.preserve_format),
    ("non_blocking", False),
}
_ID = re.compile(r"\$(\d+)")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_ABS_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+-]+)+[\\/]([\w.+-]+)")


def canonical(trace: Trace | str, *, modules: bool = True, names: bool = True) -> list[str]:
    """The lines of ``trace`` in canonical form (see the module docstring).

    A string is taken as an already printed trace and only renumbered and
    masked.
    """
    if isinstance(trace, str):
        lines = trace.splitlines()
    else:
        lines = _lines(trace, modules=modules, names=names)
    return _renumber([_mask(line) for line in lines])


def diff(a: Trace | str, b: Trace | str, *, modules: bool = False, names: bool = False, context: int = 3) -> str:
    """A unified diff of two traces' ops and shapes; ``""`` when equivalent.

    ``modules=True`` also compares module attribution, ``names=True`` the
    names of arguments, parameters and buffers.
    """
    la = canonical(a, modules=modules, names=names)
    lb = canonical(b, modules=modules, names=names)
    if la == lb:
        return ""
    lb = _align_ids(la, lb)
    return "\n".join(difflib.unified_diff(la, lb, "a", "b", n=context, lineterm=""))


def _align_ids(la: list[str], lb: list[str]) -> list[str]:
    """``lb`` with its ids renamed to those of the matching lines of ``la``.

    Numbering by first appearance shifts every later id when one call is
    inserted, which would make the whole rest of a diff differ.  So lines are
    first matched with ids blanked out; the outputs of matched (or replaced)
    lines take their counterpart's id, and ids ``b`` alone defines come after
    ``a``'s.
    """
    blank = lambda lines: [_ID.sub("$", line) for line in lines]  # noqa: E731
    ids: dict = {}
    matcher = difflib.SequenceMatcher(None, blank(la), blank(lb), autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag in ("equal", "replace"):  # a replaced line stands where its counterpart stood
            for i, j in zip(range(a0, a1), range(b0, b1)):
                defined_a = _ID.findall(la[i].split(" = ", 1)[0])
                defined_b = _ID.findall(lb[j].split(" = ", 1)[0])
                for ib, ia in zip(defined_b, defined_a):
                    ids.setdefault(ib, ia)
    fresh = iter(range(1 + max((int(i) for line in la for i in _ID.findall(line)), default=-1), 1 << 30))

    def new_id(m: re.Match) -> str:
        if m.group(1) not in ids:
            ids[m.group(1)] = str(next(fresh))
        return "$" + ids[m.group(1)]

    return [_ID.sub(new_id, line) for line in lb]


def _lines(trace: Trace, *, modules: bool, names: bool) -> list[str]:
    def leaf_text(leaf) -> str:
        return f"{leaf.kind} {leaf.name}" if names and leaf.name else leaf.kind

    return trace.lines(leaf_text=leaf_text, call_text=lambda call: _bare(call, modules).format())


def _bare(call: OpCall, modules: bool) -> OpCall:
    """``call`` without what equivalent runs may differ in."""
    kwargs = {k: _round(v) for k, v in call.kwargs.items() if not _is_default(call.func, k, v)}
    return OpCall(
        call.index,
        call.func,
        call.op,
        _round(call.args),
        kwargs,
        call.outputs,
        call.module if modules else "",
        call.phase,
        "meta",
        None,
        call.note,
    )


def _round(v):
    if type(v) is float:
        return float(f"{v:.8g}")
    if type(v) in (tuple, list):
        return type(v)(_round(x) for x in v)
    return v


def _is_default(func, name: str, value) -> bool:
    if isinstance(value, (bool, torch.layout, torch.memory_format)) and (name, value) in _DEFAULT_LIKE:
        return True
    schema = getattr(func, "_schema", None)
    for arg in schema.arguments if schema is not None else ():
        if arg.name == name and arg.has_default_value():
            return arg.default_value == value
    return False


def _mask(line: str) -> str:
    return _ABS_PATH.sub(r"\1", _ADDRESS.sub("0x?", line))


def _renumber(lines: list[str]) -> list[str]:
    ids: dict = {}

    def new_id(m: re.Match) -> str:
        return "$" + str(ids.setdefault(m.group(1), len(ids)))

    return [_ID.sub(new_id, line) for line in lines]
