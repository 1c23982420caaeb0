"""A trace from one of its calls on: the step after the warmup, the step after a mark.

Requirements: what the calls before the cut left alive -- a model built in the mode, optimizer state, gradients kept
across steps, caches -- is live from the cut trace's start and dies when the full trace saw it die; the cut trace is
an ordinary :class:`Trace` (memory, fits, flops, printing, files and replay read it as any other); storage numbers
and tensor ids are kept, so a figure of the cut trace names the same storages as the full one.  Limits: replay of a
cut trace fills its ``state`` leaves with made-up values (the calls that made them are gone), and its random ops draw
from the full trace's start state.
"""

from __future__ import annotations

import copy

from .calls import OpCall
from .records import Leaf
from .trace import Trace

__all__ = ["Scan", "step_from", "step_until", "STATE", "state_phase"]

STATE = "state"  # the leaf kind of what the calls before the cut left alive
_RESIZE = "inductor.resize_storage_bytes_.default"  # world/fsdp_storage.RESIZE_OP (a room above)


def _known_at(trace: Trace, tid: int, start: int):
    """Note [Known state across a cut]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    AdamW's step count is a tensor built from constants (``zeros``, then ``+= 1`` each step), so its value is known
    while tracing and the traced step reads it with ``.item()``; replay checks that number (Note [Values fixed into
    a trace] in execution/matching.py).  A cut turned it into a ``state`` leaf with no value, replay made one up,
    and every replay of a steady-state trace said "value 2.0 when traced, 1.0 now" -- and a constant the steps
    before the cut wrote (``torch.tensor(0.0)``, the step count an optimizer made in the first step) kept the value
    it was made with.  So a state leaf, or a constant, whose tensor had a known value (at most 64 elements) when the
    cut was made carries that value, and replay binds it.
    """
    value = None
    for before, v in getattr(trace, "known_writes", {}).get(tid, ()):  # its value as of call ``before``
        if before <= start:
            value = v
    return value


def step_from(trace: Trace, start: int, before: Scan | None = None) -> Trace:
    """The calls ``trace[start:]`` as a trace of their own (Note [What the calls before a cut leave alive]);
    ``before``: a :class:`Scan` of the calls before ``start`` (of this trace, or one it was cut from).

    Note [What the calls before a cut leave alive]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A tensor a call before ``start`` made is, from the cut on, a leaf of kind ``state`` named for its maker:
    ``optimizer #812 aten.zeros_like.default`` (``md.memory`` names its category by the phase: ``optimizer`` ->
    optimizer state, ``backward`` -> grads, ``forward`` -> params where the step's optimizer writes it).  Its record
    is the one the first call after the cut reads.  A storage alive at the cut that no later call reads (the
    gradients ``zero_grad`` drops unread, AdamW's state for a frozen parameter) becomes such a leaf too, from the
    last record before the cut, so ``md.memory`` counts it until its recorded death.  A storage FSDP2 resized before
    the cut starts at the size the last resize gave it (``trace.start_bytes``), not at the size of its tensors.
    Deaths, marks and random-state events move with the calls; those before the cut go.  Assumptions move too;
    those before the cut stay at call 0, marked as the warmup's: the step's start state holds only while they do.
    """
    if not 0 <= start <= len(trace.calls):
        raise ValueError(f"step_from: start {start} is not a call of a trace of {len(trace.calls)}")
    if start == 0:
        return trace
    deaths = trace.deaths or {}

    def alive(storage) -> bool:
        died = deaths.get(storage)
        return died is None or died > start

    made, last, resized = (before or Scan(trace.calls)).to(start)
    leaves = dict(trace.leaves)
    for tid, leaf in trace.leaves.items():
        if leaf.value is not None:  # a constant the steps before the cut wrote: its value at the cut
            now = _known_at(trace, tid, start)
            if now is not None:
                leaves[tid] = leaf._replace(value=now)
    covered = {leaf.meta.storage for leaf in leaves.values()}
    calls = []
    for call in trace.calls[start:]:
        for m in call.inputs:
            if m.id in made and m.id not in leaves:
                leaves[m.id] = Leaf(m, STATE, _maker(*made[m.id]), _known_at(trace, m.id, start))
                covered.add(m.storage)
        calls.append(_shifted(call, start))
    for storage, (m, maker) in last.items():
        if storage not in covered and alive(storage):
            leaves[m.id] = Leaf(m, STATE, _maker(*maker), _known_at(trace, m.id, start))
            covered.add(storage)
    out = copy.copy(trace)
    out.calls, out.leaves = calls, leaves
    out.known_writes = {}
    if trace.deaths is not None:
        out.deaths = {s: max(d - start, 0) for s, d in trace.deaths.items()}
    out.start_bytes = dict(trace.start_bytes)
    out.start_bytes.update((storage, size) for storage, size in resized.items() if alive(storage))
    out.marks = {k: i - start for k, i in trace.marks.items() if i >= start}
    out.rng_events = [e._replace(at=e.at - start) for e in trace.rng_events if e.at >= start]
    out.assumptions = [_assumed_at(a, start) for a in trace.assumptions]
    out.warmup = trace.warmup
    return out


class Scan:
    """What :func:`step_from` reads of ``calls[:at]`` (``made``: tensor id -> (index, call) of its maker; ``last``:
    storage -> its last record and maker; ``resized``: FSDP2's last sizes), kept for several cuts of one trace."""

    def __init__(self, calls: list) -> None:
        self.calls, self.at, self.resized = calls, 0, dict[int, int]()
        self.made, self.last = dict[int, tuple](), dict[int, tuple]()

    def to(self, start: int) -> tuple:
        if start < self.at:  # a cut further back: from the first call again
            self.at, self.made, self.last, self.resized = 0, {}, {}, {}
        made, last = self.made, self.last
        for i in range(self.at, start):
            call = self.calls[i]
            for m in call.output_metas:
                made.setdefault(m.id, (i, call))
                last[m.storage] = (m, made[m.id])
            for m in call.inputs:
                if m.id in made:
                    last[m.storage] = (m, made[m.id])
            if call.op == _RESIZE:
                self.resized[call.args[0].storage] = call.args[1]
        self.at = start
        return made, last, self.resized


def step_until(trace: Trace, end: int) -> Trace:
    """The calls ``trace[:end]`` as a trace of their own: what is alive at ``end`` lives to its end.

    The other side of :func:`step_from`, for a trace of several steps one after another (``md.plan`` traces the
    micro-batch sizes of one mesh after one warmup, Note [One build for the configurations of a mesh] in
    planning/programs.py): a storage that dies after ``end`` is live to the cut trace's end, as a trace's persistent
    state is live to its end; marks and random-state events after ``end`` go.
    """
    if not 0 <= end <= len(trace.calls):
        raise ValueError(f"step_until: end {end} is not a call of a trace of {len(trace.calls)}")
    out = copy.copy(trace)  # a copy also at the end: md.plan sets each cut's marks (planning/programs.py)
    out.calls = trace.calls[:end]
    if trace.deaths is not None:
        out.deaths = {s: d for s, d in trace.deaths.items() if d <= end}
    out.marks = {k: i for k, i in trace.marks.items() if i <= end}
    out.rng_events = [e for e in trace.rng_events if e.at < end]
    out.assumptions = [a for a in trace.assumptions if a.index < end]
    out.known_writes = {t: [(b, v) for b, v in w if b < end] for t, w in getattr(trace, "known_writes", {}).items()}
    return out


def state_phase(leaf: Leaf) -> str | None:
    """The phase of the call that made a ``state`` leaf (``"optimizer"``), or None for another leaf."""
    return leaf.name.partition(" ")[0] if leaf.kind == STATE else None


def _maker(index: int, call: OpCall) -> str:
    return f"{call.phase} #{index} {call.op}"


def _assumed_at(a, start: int):
    if a.index >= start:
        return a._replace(index=a.index - start)
    return a._replace(index=0, basis=f"{a.basis} (before the cut, at call #{a.index})")


def _shifted(c: OpCall, start: int) -> OpCall:
    return OpCall(
        c.index - start, c.func, c.op, c.args, c.kwargs, c.outputs, c.module, c.phase, c.rule, c.source, c.note
    )
