"""A pipeline's step time and bubble, from each stage's trace: ``md.runtime([trace0, trace1, ...])``.

Note [A pipeline's bubble from its stages' traces]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank of a pipeline is traced alone (world/pipeline.py); its trace is
its own program in the order its schedule runs it, with a ``send`` or
``recv`` wherever it hands activations or gradients on.  Priced call by
call (``md.runtime``), each rank is a sequence of compute spans cut by its
point-to-point calls.  The ranks are then run against each other: a send
finishes its transfer after its own time (``md.runtime`` prices it); the
k-th receive on rank q from rank r waits for the k-th send from r to q;
every other call runs as soon as the one before it on its rank is done.
The step is as long as the last rank to finish; a rank's bubble is the
step less the time it spends busy, and the pipeline's bubble is the share
of all ranks' time spent idle -- for GPipe and 1F1B with equal stages,
``(p - 1) / (m + p - 1)`` for ``p`` stages and ``m`` micro-batches.

Micro-batches in flight, per rank: forward spans begun and not yet matched
by a backward span (each span a maximal run of calls of one phase, in the
stage's modules, between point-to-point calls), at most -- what 1F1B
bounds and GPipe does not; with several stages a rank (interleaved
schedules) each span is one stage's chunk of a micro-batch.

Limits: a receive is taken to wait where it is posted (torch's schedules
post and wait on each one before the work that needs it); communication
and compute on one rank do not overlap; the ranks' traces must pair up
(each send a receive), else the simulation stops, naming the rank.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..errors import MetaDispatchError
from ..ir.records import Group

__all__ = ["PipelineRuntime", "pipeline_runtime"]

_P2P = {"c10d.send.default": "send", "c10d.recv_.default": "recv"}


@dataclass
class PipelineRuntime:
    """The step of a pipeline whose ranks were traced one by one.

    ``total``: seconds until the last rank finishes; ``busy[r]``: seconds
    rank ``r`` computes or communicates; ``bubble[r]``: ``total - busy[r]``;
    ``bubble_fraction``: the idle share of all ranks' time;
    ``in_flight[r]``: the most micro-batches rank ``r`` holds at once.
    """

    total: float
    busy: list
    bubble: list
    in_flight: list
    ranks: list | None = None  # each trace's rank in its world (None: 0, 1, ...)

    @property
    def bubble_fraction(self) -> float:
        return sum(self.bubble) / (self.total * len(self.busy)) if self.total else 0.0

    def __str__(self) -> str:
        lines = [
            f"pipeline over {len(self.busy)} ranks: step {self.total * 1e3:.2f} ms, bubble {self.bubble_fraction:.1%}"
        ]
        ranks = self.ranks or range(len(self.busy))
        for r, b, idle, n in zip(ranks, self.busy, self.bubble, self.in_flight):
            lines.append(f"  rank {r}: busy {b * 1e3:.2f} ms, idle {idle * 1e3:.2f} ms, {n} micro-batches in flight")
        return "\n".join(lines)


def _events(trace, per_call: list) -> list:
    """``("run", seconds, phase, module)``, ``("send"|"recv", peer, seconds)`` in call order."""
    out: list = []
    for call, t in zip(trace.calls, per_call):
        kind = _P2P.get(call.op)
        if kind is None:
            if t:
                out.append(("run", t, call.phase, call.module))
            continue
        group = next((a for a in call.args if isinstance(a, Group)), None)
        peer = call.args[2] if len(call.args) > 2 else call.kwargs.get("dst", call.kwargs.get("src"))
        out.append((kind, group.ranks[peer] if group is not None else peer, t))
    return out


def _in_flight(events: list) -> int:
    begun = done = most = 0
    span = None  # the phase of the span running, None after a point-to-point call
    for e in events:
        if e[0] != "run":
            span = None
        elif e[2] != span and e[3]:  # the stage's modules at work (not building, not scaling its grads)
            span = e[2]
            begun += span == "forward"
            done += span == "backward"
            most = max(most, begun - done)
    return most


def pipeline_runtime(traces: list, runtimes: list) -> PipelineRuntime:
    """Run the ranks' priced traces against each other (Note [A pipeline's bubble from its stages' traces])."""
    # A trace's peers are ranks of its world; the traces of one pipeline
    # (its first stage's rank 0, the next's rank 8 under --fsdp) are found
    # by the rank each was traced as, else by their place in the list.
    ranks = [t.world[1] for t in traces if t.world is not None]
    place = {r: i for i, r in enumerate(ranks)} if len(set(ranks)) == len(traces) else {}
    events = [[_placed(e, place) for e in _events(t, r.per_call)] for t, r in zip(traces, runtimes)]
    clock = [0.0] * len(events)
    busy = [0.0] * len(events)
    at = [0] * len(events)
    arrivals: dict = defaultdict(list)  # (src, dst) -> arrival time of each send, in order
    taken: dict = defaultdict(int)  # (src, dst) -> sends received so far
    while any(i < len(e) for i, e in zip(at, events)):
        moved = False
        for r, evs in enumerate(events):
            while at[r] < len(evs):
                kind, a, b = evs[at[r]][:3]
                if kind == "recv":
                    key = (a, r)
                    if taken[key] >= len(arrivals[key]):
                        break  # its send is not run yet
                    clock[r] = max(clock[r], arrivals[key][taken[key]])
                    taken[key] += 1
                    t = b
                elif kind == "send":
                    t = b
                    arrivals[(r, a)].append(clock[r] + t)
                else:
                    t = a  # a run's seconds
                clock[r] += t
                busy[r] += t
                at[r] += 1
                moved = True
        if not moved:
            stuck = [r for r, (i, e) in enumerate(zip(at, events)) if i < len(e)]
            raise MetaDispatchError(
                f"md.runtime over a pipeline: rank {ranks[stuck[0]] if place else stuck[0]} waits for a send no "
                "rank's trace makes; give one trace per rank of the pipeline, in rank order, of the same step"
            )
    total = max(clock, default=0.0)
    in_flight = [_in_flight(e) for e in events]
    return PipelineRuntime(total, busy, [total - b for b in busy], in_flight, ranks if place else None)


def _placed(event: tuple, place: dict) -> tuple:
    """A send's or receive's peer as the index of its trace."""
    if event[0] == "run" or not place:
        return event
    return (event[0], place.get(event[1], -1), *event[2:])
