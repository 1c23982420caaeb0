"""One value a trace did not compute but assumed: made up, given, or declared by a policy.

``md.check`` makes values up (or takes them from ``values=``) for reads no
rule can answer; ``md.tracer(assume=...)`` takes them from a declared policy
(values/assume.py).  Either way every such value is one :class:`Assumption`,
naming the call, the op, the user's line and why that value: what follows
it in the trace holds only while the assumption does.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Assumption", "after_warmup"]


class Assumption(NamedTuple):
    """A value made up, given or declared for one call."""

    index: int  # of the call in the trace (a read outside any op, Tensor.tolist: of the next call)
    op: str
    module: str
    source: str | None
    value: str  # "3", or the outputs' types, "i64[10, 2]"
    basis: str  # "a value in [0, 5] from uniform_(0.0, 5.0)", "given by values=", "GenerateAssumptions(token_id=0)"

    def __str__(self) -> str:
        return (
            f"call #{self.index} {self.op} at {self.source or '?'} ({self.module or '<top>'}): "
            f"assumed {self.value}, {self.basis}"
        )


def after_warmup(assumptions: list, cut: int) -> list:
    """What a declared policy's ``warmup=`` trace (cut at ``cut``) keeps: the
    warm-up runs' own assumptions go, the arguments' (call 0) stay (Note
    [Warm-up assumptions: declared ones go, made-up ones stay], values/assume.py)."""
    return [a for a in assumptions if a.index >= cut or a.op.startswith("arg ")]
