"""Replay's budgets: the bytes and work a trace will cost, known before it runs.

A trace is a program, and a small file can describe a large one: a 373-byte
trace can fill 4 GiB, a few kilobytes can multiply 16k x 16k matrices, sum
2**62 elements of a 4-byte tensor or make 200k calls.  So replay works out
what a trace will cost before it runs anything and refuses one over its
:class:`Budget`, naming the first call that crosses it
(:class:`~metadispatch.errors.BudgetExceededError`).

Note [Budgets]
~~~~~~~~~~~~~~
*Bytes* are the peak of what replay holds: every storage a call's outputs
live in, from the first output on it until the generated program frees the
last (``free_points`` in ir/liveness.py), its growth (``resize_``), the scratch
a kernel may take to copy inputs whose elements overlap (work.py), plus the
leaves replay makes up or copies and a fixed cost per call and output (the
compiled program, tensor objects).  *Work* is FLOPs: torch's formulas where
it has one, products and decompositions by their shapes, and never less than
the elements a call reads and writes, plus a fixed cost per call (work.py,
costs.py).  An estimate of time, good to a small factor.

For a loaded trace (``trace.untrusted``) the sizes are not the file's: its
calls first run on the ``meta`` device, where kernels compute sizes without
allocating (costs.py).  Where meta cannot say -- list returns, sizes that
depend on data -- Note [Sizes known before running] in sizes.py bounds
them, and replay checks while running that each such call stays within what
was counted (fences.py).  A call of an op without a meta kernel cannot be
sized at all: with a limit set, replay refuses the trace.

Limits: the work estimate can be low by more than a small factor for an op
whose cost grows faster than what it reads and writes (a contraction
``einsum`` named directly); a kernel's scratch beyond copying its inputs
(sort's indices, a solver's workspace) is not counted.
"""

from __future__ import annotations

import bisect
import os
from typing import NamedTuple

import torch

from ..errors import BudgetExceededError, ReplayError
from ..ir.trace import Trace
from .costs import costs, fixed_costs

__all__ = ["Budget", "default_budget", "check_budget"]


class Budget(NamedTuple):
    """What one replay may spend: peak bytes held and FLOPs run (None: no limit).

    >>> Budget(bytes=1 << 30, flops=10**12).bytes
    1073741824
    """

    bytes: int | None
    flops: int | None


def default_budget(device: torch.device) -> Budget:
    """Half the memory free on ``device`` now; 10**12 FLOPs on a CPU, 10**16 on a GPU."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return Budget(free // 2, 10**16)
    return Budget(_host_available() // 2, 10**12)


def _host_available() -> int:
    # Read raw rather than through a text file object: this runs on every
    # replay, and decoding /proc/meminfo line by line cost tens of us.
    try:
        fd = os.open("/proc/meminfo", os.O_RDONLY)
        try:
            info = os.read(fd, 1 << 14)
        finally:
            os.close(fd)
        at = info.find(b"MemAvailable:")
        if at >= 0:
            return int(info[at + 13 : info.index(b"kB", at)]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def check_budget(trace: Trace, budget: Budget, leaf_bytes: int = 0, keep_all: bool = False) -> None:
    """Raise BudgetExceededError naming the first call that crosses ``budget``.

    What the trace costs by its size alone (``fixed_costs``) is checked
    first, before the walk that sizes each call.
    """
    fixed_bytes, fixed_work = fixed_costs(trace)
    base = {"bytes": leaf_bytes + fixed_bytes, "flops": 0}
    for what, limit, need in (("bytes", budget.bytes, base["bytes"]), ("flops", budget.flops, fixed_work)):
        if limit is not None and need > limit:
            raise BudgetExceededError(
                f"replay refused: its leaves, and replay's own work for its {len(trace.calls)} calls, "
                f"need {_fmt(need)} {what}, over the budget of {_fmt(limit)} "
                "(md.replay(..., budget=Budget(bytes=N, flops=M)) sets it)",
                call=-1,
                what=what,
                need=need,
                limit=limit,
            )
    c = costs(trace, keep_all)
    if c.unknown and (budget.bytes is not None or budget.flops is not None):
        n, why = c.unknown[0]
        call = trace.calls[n]
        raise ReplayError(
            f"replay refused: call #{call.index} {call.op}: replay cannot tell what it allocates before "
            f"running it, as {why} (md.replay(..., budget=Budget(bytes=None, flops=None)) runs it unbounded)",
            call=call.index,
        )
    for what, limit, running in (("bytes", budget.bytes, c.peak), ("flops", budget.flops, c.flops)):
        if limit is None:
            continue
        n = bisect.bisect_right(running, limit - base[what])
        if n < len(running):
            call = trace.calls[n]
            need = running[n] + base[what]
            raise BudgetExceededError(
                f"replay refused: call #{call.index} {call.op} brings the trace to {_fmt(need)} "
                f"{what}, over the budget of {_fmt(limit)} (md.replay(..., budget=Budget("
                "bytes=N, flops=M)) sets it; None means no limit)",
                call=call.index,
                what=what,
                need=need,
                limit=limit,
            )


def _fmt(n: int) -> str:
    return f"{n:.3g}" if n >= 10**6 else str(n)
