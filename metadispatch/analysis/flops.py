"""FLOPs of a trace, from torch's own formulas applied to the recorded shapes.

``torch.utils.flop_counter`` keeps a registry of FLOP formulas, one per op
packet (``aten.mm``, ``aten.convolution_backward``, the attention kernels),
that take input *shapes*.  A trace records every shape, so counting needs no
tensors at all: each call's formula gets ``torch.Size`` objects where the
call had tensors, exactly what ``FlopCounterMode`` hands it after unwrapping
real tensors.  Totals therefore equal ``FlopCounterMode`` on the same run.

Limits: ops with no formula (elementwise ops, reductions, views) count no
FLOPs -- like ``FlopCounterMode`` -- but are listed in ``.uncounted`` rather
than hidden.  Custom ops get a formula with :func:`register_flops`::

    @md.register_flops(torch.ops.mylib.fused_mlp)
    def _(x_shape, w_shape, *, out_shape, **kwargs):
        return 2 * x_shape[0] * x_shape[1] * w_shape[1]

Modules are attributed as in ``FlopCounterMode``: a call counts toward its
module and every enclosing one, so ``.by_module[""]`` is the total.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils.flop_counter import flop_registry as _torch_formulas
from torch.utils.flop_counter import shape_wrapper

from .. import _compat
from ..ir.text import render
from ..ir.trace import TensorMeta, Trace

__all__ = ["Flops", "flops", "register_flops", "unregister_flops", "formula_for", "fmt_count"]

_USER: dict = {}  # OpOverloadPacket -> formula over shapes (ours, never torch's registry)


def register_flops(op, *, override: bool = False) -> Callable:
    """Decorator: a FLOP formula for ``op`` (a packet or overload).

    The formula is called like torch's: shapes (``torch.Size``) in place of
    tensors, other arguments as recorded, and ``out_shape=`` the output
    shape(s).  It applies to every overload of the op's packet.

    >>> import torch, metadispatch as md
    >>> @md.register_flops(torch.ops.aten.cumsum)
    ... def cumsum_flops(x_shape, dim, *args, out_shape=None, **kwargs):
    ...     return x_shape.numel()
    >>> md.flops(md.trace(lambda x: x.cumsum(0), torch.ones(8))).total
    8
    >>> md.unregister_flops(torch.ops.aten.cumsum)
    """
    packet = getattr(op, "overloadpacket", op)

    def decorator(fn: Callable) -> Callable:
        if packet in _USER and not override:
            raise ValueError(f"a FLOP formula for {packet} is already registered; pass override=True")
        _USER[packet] = fn
        return fn

    return decorator


def unregister_flops(op) -> None:
    _USER.pop(getattr(op, "overloadpacket", op), None)


def formula_for(func) -> Callable | None:
    """The formula for an OpOverload, called as ``FlopCounterMode`` calls it:
    ``formula(*args, out_val=out, **kwargs)`` with tensors.  A registered
    one comes first, then torch's."""
    packet = func.overloadpacket
    if packet in _USER:
        return shape_wrapper(_USER[packet])
    return _torch_formulas.get(packet)


def _tensors(x):
    # Some of torch's formulas read ``.shape`` of tensors themselves (the
    # "raw" ones), so hand every formula meta tensors of the recorded
    # shapes, as FlopCounterMode hands it real ones.
    if isinstance(x, TensorMeta):
        return torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device="meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_tensors(y) for y in x)
    if isinstance(x, dict):
        return {k: _tensors(v) for k, v in x.items()}
    return x


def call_flops(call) -> int | None:
    """FLOPs of one recorded call, or None when no formula exists."""
    formula = formula_for(call.func)
    if formula is None:
        return None
    out = call.outputs[0] if len(call.outputs) == 1 else call.outputs
    with _compat.no_python_dispatch():
        args, kwargs, out = _tensors((call.args, call.kwargs, out))
        try:
            return int(formula(*args, out_val=out, **kwargs))
        except (AssertionError, RuntimeError, ValueError, TypeError, IndexError):
            return None  # shapes the formula rejects: a loaded trace may hold anything


def ancestors(module: str):
    """``a.b.c`` -> ``""``, ``a``, ``a.b``, ``a.b.c``."""
    yield ""
    if module:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            yield ".".join(parts[:i])


class Flops:
    """FLOPs of a trace; print it for a table.  All dicts map names to ints."""

    def __init__(self, trace: Trace) -> None:
        self.per_call: list = []  # FLOPs of each call, None where uncounted
        self.by_op: Counter = Counter()
        self.by_phase: Counter = Counter()
        self.by_module: Counter = Counter()  # inclusive: a module and its children
        self.uncounted: Counter = Counter()  # op name -> calls with no formula
        for call in trace.calls:
            n = call_flops(call)
            self.per_call.append(n)
            if n is None:
                self.uncounted[call.op] += 1
                continue
            self.by_op[call.op] += n
            self.by_phase[call.phase] += n
            for m in ancestors(call.module):
                self.by_module[m] += n
        self.total = sum(self.by_op.values())

    def __int__(self) -> int:
        return self.total

    def __repr__(self) -> str:
        return f"<Flops total={fmt_count(self.total)}>"

    def __str__(self) -> str:
        rows = [(op, fmt_count(n), _pct(n, self.total)) for op, n in self.by_op.most_common()]
        phases = ", ".join(f"{p} {fmt_count(n)}" for p, n in sorted(self.by_phase.items()))
        lines = [f"{fmt_count(self.total)} FLOPs" + (f" ({phases})" if phases else "")]
        lines += render(("op", "FLOPs", "share"), rows, align="<>>")
        if self.uncounted:
            top = self.uncounted.most_common(6)
            more = len(self.uncounted) - len(top)
            lines.append(
                f"no formula: {len(self.uncounted)} ops, {sum(self.uncounted.values())} calls ("
                + ", ".join(f"{op} x{n}" for op, n in top)
                + (f", {more} more)" if more else ")")
            )
        return "\n".join(lines)


def flops(trace: Trace) -> Flops:
    """Count the FLOPs of a trace with torch's registered formulas.

    >>> import torch, metadispatch as md
    >>> f = md.flops(md.trace(lambda a, b: (a @ b).relu(), torch.ones(4, 8), torch.ones(8, 2)))
    >>> f.total, dict(f.by_op), dict(f.uncounted)
    (128, {'aten.mm.default': 128}, {'aten.relu.default': 1})
    """
    return Flops(trace)


def fmt_count(n: float) -> str:
    """``1234567`` -> ``1.23M``: three significant figures, SI-style suffixes."""
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return str(int(n))


def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"
