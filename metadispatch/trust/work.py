"""The work one call does and the scratch memory it may take: the budget's per-call estimates.

Work is counted in FLOPs (Note [Budgets] in budget.py): torch's formulas
(``torch.utils.flop_counter``) where it has one, ``2 * output elements *
inner size`` for other products, ``n**3`` per matrix for decompositions and
solves -- and never less than the elements the call reads and writes.  The
floor is what bounds the rest: a file can make a 4-byte leaf of 2**62
elements (stride 0) and ``sum`` it; the output is one element, the reading
is 2**62 additions.  Views read nothing.

Scratch memory: a kernel may copy an input it cannot use as strided
(``median``, ``sort``, a product of an expanded tensor): that costs the
input's logical size, which for a tensor with overlapping elements (stride
0) is more than its storage holds.  Dense inputs cost no more than what
replay already holds; the budget's default (half the free memory) leaves
room for such copies.

Arguments are meta tensors or :class:`TensorMeta` records: both have
``shape`` and a dtype; strides are read through :func:`strides`.
"""

from __future__ import annotations

import math
import re

from torch.utils.flop_counter import flop_registry

from ..ir.records import TensorMeta
from ..spec.schema import facts

__all__ = ["work", "scratch", "strides", "extent_bytes", "is_view_call"]

_PRODUCTS = re.compile(
    r"_*(?:matmul|einsum|linear|bilinear|tensordot|addmv|mv|dot|vdot|addr|outer"
    r"|ger|kron|cdist|addbmm|chain_matmul|trilinear)(?:_|$)"
)
_CUBIC = re.compile(
    r"_*(?:linalg|cholesky|lu|qr|svd|eig|symeig|solve|inverse|triangular|geqrf"
    r"|ormqr|householder|slogdet|logdet|det|lstsq|matrix_exp|pinverse)(?:_|$)"
)


def strides(t) -> tuple:
    return t.stride if type(t) is TensorMeta else t.stride()


def _offset(t) -> int:
    return t.storage_offset if type(t) is TensorMeta else t.storage_offset()


def _numel(t) -> int:
    return math.prod(t.shape)


def extent_bytes(t) -> int:
    """Bytes of storage ``t`` reaches: offset plus the furthest element."""
    if 0 in t.shape:
        return _offset(t) * t.dtype.itemsize
    return (_offset(t) + sum((s - 1) * st for s, st in zip(t.shape, strides(t))) + 1) * t.dtype.itemsize


def is_view_call(call) -> bool:
    """Every return shares memory with an argument and nothing is written: no data moves."""
    f = facts(call.func)
    return bool(f.aliases) and all(f.aliases) and not f.writes


def scratch(call, inputs: list) -> int:
    """Bytes a kernel may copy its inputs into: the logical size of those with overlapping elements."""
    if is_view_call(call):
        return 0
    copies = sum(_numel(t) * t.dtype.itemsize for t in inputs if _numel(t) * t.dtype.itemsize > extent_bytes(t))
    name = call.func.name().partition("::")[2].partition(".")[0]
    if name in ("mvlgamma", "mvlgamma_"):  # adds p terms per element in one tensor
        copies += _SCALAR_WORK[name](call, inputs) * 8
    return copies


def work(call, inputs: list, outputs: list, on_meta) -> int:
    """FLOPs ``call`` runs, estimated (module docstring); ``on_meta(x)`` gives an argument on meta."""
    if is_view_call(call):
        return 0
    touched = sum(map(_numel, inputs)) + sum(map(_numel, outputs))
    name = call.func.name().partition("::")[2].partition(".")[0]
    by_scalar = _SCALAR_WORK.get(name)
    if by_scalar is not None:
        return max(touched, by_scalar(call, inputs))
    formula = flop_registry.get(call.func.overloadpacket)
    cubic = _CUBIC.match(name) is not None
    if formula is None and not cubic and _PRODUCTS.match(name) is None:
        return touched
    if formula is not None:
        try:
            counted = formula(
                *[on_meta(a) for a in call.args],
                **{k: on_meta(v) for k, v in call.kwargs.items()},
                out_val=_out_val(call, outputs),
            )
            return max(touched, int(counted))
        except Exception:  # a formula that cannot read these arguments
            pass
    biggest = max((t for t in inputs if len(t.shape)), key=_numel, default=None)
    if biggest is None:
        return touched
    out_elems = sum(map(_numel, outputs))
    if cubic:
        n = max(biggest.shape[-2:])
        return max(touched, math.prod(biggest.shape[:-2]) * n**3 + out_elems)
    return max(touched, 2 * max(out_elems, 1) * biggest.shape[-1])


def _matrix_power(call, inputs: list) -> int:
    """Repeated squaring: two products of n x n matrices per bit of the exponent."""
    (a,) = inputs[:1] or [None]
    if a is None or len(a.shape) < 2:
        return 0
    exponent = abs(int(call.args[1])) if len(call.args) > 1 else abs(int(call.kwargs.get("n", 0)))
    n = a.shape[-1]
    return math.prod(a.shape[:-2]) * 2 * max(exponent.bit_length(), 1) * 2 * n**3


def _per_element_times_arg(index: int, name: str):
    """Work of ``arg`` passes over every element (``mvlgamma(p)``, ``diff(n)``)."""

    def count(call, inputs: list) -> int:
        k = call.args[index] if len(call.args) > index else call.kwargs.get(name, 1)
        return sum(map(_numel, inputs)) * max(abs(int(k)), 1)

    return count


# Ops whose work grows with a number argument, not with their output.
_SCALAR_WORK = {
    "matrix_power": _matrix_power,
    "mvlgamma": _per_element_times_arg(1, "p"),
    "mvlgamma_": _per_element_times_arg(1, "p"),
    "diff": _per_element_times_arg(1, "n"),
}


def _out_val(call, outputs: list):
    if len(outputs) == 1 and len(call.outputs) == 1:
        return outputs[0]
    return tuple(outputs)
