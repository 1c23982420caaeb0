"""The checks replay runs just before a loaded trace's calls whose kernels follow values unchecked: their registry.

Note [Checking values before the call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Note [Values that become positions] in trust/positions.py classifies every op
a file may name; class ``checked`` is this registry of checks keyed by op
(the checks of values in value_checks.py, of shapes in shape_checks.py),
each handed the call's real arguments by schema name (``sizes.bind``) just
before the kernel runs.  A check derives what the
kernel will index from the other arguments -- the plane ``self`` gives
``max_pool2d``'s indices, ``num_weights`` an embedding's, the data's length
a segment's lengths -- and raises :class:`Refusal` naming the argument and
the value; the fence (fences.py) turns that into a ``ReplayError`` naming
the call, before the kernel has run.  Checks read their tensors with
reductions (``aminmax``, ``cumsum``), never by an index taken from a file.

Two more refusals come from the classification itself, before anything
runs: an op classed ``refused`` (:func:`screen`), and -- default deny -- a
call of an op with no class at all that is handed an integer or boolean
tensor, the only kind whose values can become positions
(:func:`unclassified`).  A trace built in this process runs none of this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import ReplayError
from ..spec.schema import schema_of
from .positions import CHECKED, REFUSED, position

__all__ = [
    "Refusal",
    "check",
    "index_check",
    "needs_pre",
    "screen",
    "unclassified",
    "CHECKS",
    "int_arg",
    "tensor_arg",
    "dims_arg",
    "within",
    "expect_shape",
    "non_decreasing",
]


class Refusal(Exception):
    """What a check found: the argument (schema name) and what is wrong with it."""

    def __init__(self, arg: str, what: str) -> None:
        super().__init__(f"{arg}: {what}")
        self.arg = arg
        self.what = what


CHECKS: dict[str, Callable] = {}  # op or packet name ("aten::div.Tensor_mode", "aten::gather") -> check(args)


def check(*names: str):
    """Register a check for ``names`` (packets or overloads); it gets the arguments by name."""

    def register(fn):
        for name in names:
            if name in CHECKS:
                raise ValueError(f"a value check for {name} is registered twice")
            CHECKS[name] = fn
        return fn

    return register


def index_check(func) -> Callable | None:
    """The check for ``func``: its overload's, else its packet's; None if it has none."""
    return CHECKS.get(func.name()) or CHECKS.get(schema_of(func).name)


def needs_pre(func) -> bool:
    """Whether replay of a loaded trace checks a call of ``func`` before it runs."""
    p = position(func)
    return p is None or p.kind == CHECKED


def screen(calls: list) -> None:
    """Refuse, before anything runs, a loaded trace holding an op classed ``refused``."""
    seen: set = set()
    for call in calls:
        if call.func in seen:
            continue
        seen.add(call.func)
        p = position(call.func)
        if p is not None and p.kind == REFUSED:
            arg = f" (its argument {p.args[0]!r})" if p.args else ""
            raise ReplayError(
                f"replay refused: call #{call.index} {call.op}{arg}: it {p.why}; a loaded trace may not run it. "
                "Nothing was run",
                call=call.index,
            )


_INDEX_DTYPES = frozenset(
    {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
    | {getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)}
)


def unclassified(a: dict) -> None:
    """Default deny for an op with no class: no integer or boolean tensor may reach it."""
    for name, v in a.items():
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor) and t.dtype in _INDEX_DTYPES:
                raise Refusal(
                    name,
                    f"is a {str(t.dtype).removeprefix('torch.')} tensor, and this op has no memory class "
                    "(Note [Values that become positions]): its values could be positions nothing checks",
                )


# -- helpers


def int_arg(a: dict, name: str) -> torch.Tensor | None:
    t = a.get(name)
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise Refusal(name, f"is {type(t).__name__}, not a tensor")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise Refusal(name, f"holds {str(t.dtype).removeprefix('torch.')} values where integers are expected")
    return t


def within(a: dict, name: str, lo: int, hi: int, what: str = "") -> None:
    """Every value of integer tensor ``a[name]`` lies in [lo, hi)."""
    t = int_arg(a, name)
    if t is None or t.numel() == 0:
        return
    low, high = (int(x) for x in torch.aminmax(t.to(torch.int64)))
    if low < lo or high >= hi:
        bad = low if low < lo else high
        raise Refusal(name, f"holds {bad}, outside [{lo}, {hi}){what}")


def expect_shape(a: dict, name: str, want, what: str = "") -> None:
    t = a.get(name)
    if isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(want):
        raise Refusal(name, f"has shape {list(t.shape)} where {list(want)} is expected{what}")


def tensor_arg(a: dict, name: str) -> torch.Tensor:
    t = a.get(name)
    if not isinstance(t, torch.Tensor):
        raise Refusal(name, f"is {type(t).__name__}, not a tensor")
    return t


def dims_arg(a: dict, name: str, n: int) -> torch.Tensor:
    t = tensor_arg(a, name)
    if t.dim() != n:
        raise Refusal(name, f"has {t.dim()} dimensions where {n} are expected")
    return t


def non_decreasing(a: dict, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and bool((t[..., 1:] < t[..., :-1]).any()):
        raise Refusal(name, "decreases somewhere; it must be non-decreasing")
