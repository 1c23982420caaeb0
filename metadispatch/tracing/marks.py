"""``md.mark``: name a point of the traced code, so that an analysis can start there.

A model built and sharded inside the traced code is made by calls like any
activation; ``md.memory(trace, since="start")`` (and ``md.fits``) leave
out what happened before ``md.mark("start")`` and count what it left alive
-- the parameters, their shards, an optimizer's state -- as live from the
step's start (ir/cut.py).  Outside a recording MetaMode a mark does
nothing, so the same code runs eagerly.
"""

from __future__ import annotations

from .. import _compat
from ..errors import MetaDispatchError
from ..ir.trace import Trace
from ..mode.mode import MetaMode

__all__ = ["mark", "mark_index"]


def mark(name: str = "start") -> str:
    """Note that the next call of the active trace starts ``name``; returns ``name``.

    >>> import torch, metadispatch as md
    >>> def step(x):
    ...     w = torch.ones(1024, 1024)  # built in the trace: 4 MiB
    ...     md.mark()
    ...     return (w @ x).sum()
    >>> t = md.tracer()(step, torch.ones(1024, 1))
    >>> t.marks, md.memory(t).by_category["activations"], md.memory(t, since="start").by_category["activations"]
    ({'start': 1}, 4198404, 4100)
    """
    mode = _compat.get_infra_mode(_compat.mode_key)
    if isinstance(mode, MetaMode) and mode.record:
        mode.trace.marks[name] = len(mode.trace.calls)
    return name


def mark_index(trace: Trace, since) -> int:
    """The call a ``since=`` names: a mark's name, or a call index."""
    if type(since) is int and 0 <= since <= len(trace.calls):
        return since
    if isinstance(since, str) and since in trace.marks:
        return trace.marks[since]
    known = ", ".join(map(repr, trace.marks)) or "none (md.mark() in the traced code sets one)"
    raise MetaDispatchError(f"since={since!r}: not a mark of this trace nor a call index; its marks: {known}")
