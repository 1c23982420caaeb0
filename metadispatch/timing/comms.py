"""Communication of one traced rank: every collective it calls, and a table.

A trace made under ``MetaMode(world_size=N, rank=r)`` records collectives
as calls like any other (``c10d`` ops from ``torch.distributed``'s eager API
and FSDP, ``_c10d_functional`` ops from DTensor).  :func:`comms` lists them
as :class:`Collective` records -- kind, group, this rank's place in it, the
tensors, the payload -- and tabulates them per kind, group, module and
phase.

``bytes`` is the collective's payload as nccl-tests counts it: the gathered
output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce or broadcast.  ``sent`` (equal to bytes received) is what a ring
algorithm moves through this rank: ``(n-1)/n`` of the payload for
all-gather, reduce-scatter and all-to-all, twice that for all-reduce, the
payload for broadcast and point-to-point.  Given a GPU or a bandwidth,
each collective's time is estimated by the ring and tree model of
``collective_cost.py`` (Note [Time of a collective]).

Limits: ``wait_tensor`` and ``barrier`` move no payload and are not listed;
coalesced collectives count as one call with their tensors' total.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from ..ir.records import Group, dtype_abbr, tensor_metas
from ..ir.text import fmt_bytes, render
from ..ir.trace import Trace
from ..spec.profiles import GPUProfile
from ..spec.schema import schema_of
from .collective_cost import GPUS_PER_NODE, LATENCY, NETWORK, link, seconds

__all__ = ["Collective", "Comms", "comms", "collective", "COLLECTIVE_NAMESPACES"]

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")

# op name (namespace and overload stripped) -> kind
_KINDS = {
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
}
# The payload: the outputs' bytes (gathers) or the inputs' (everything else).
_PAYLOAD_IS_OUTPUT = {"all_gather", "gather"}  # a recv_ writes into its tensors argument
_RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}


class Collective(NamedTuple):
    """One collective call of the traced rank (or of a real run: ``md.testing.CollectiveLog``)."""

    op: str  # "c10d._allgather_base_.default"
    kind: str  # "all_gather", "reduce_scatter", "all_reduce", ...
    group: Group | None
    tensors: tuple  # "f32[4128]" per tensor argument, in schema order, then outputs
    bytes: int  # the payload (module docstring)
    sent: int  # what a ring moves through this rank each way
    module: str = ""
    phase: str = "forward"
    index: int = -1  # the call's index in the trace (-1: logged from a real run)
    seconds: float | None = None  # estimated time (``md.comms(..., gpu=)``), else None


def collective(
    op: str, args: list, outputs: list, group: Group | None, module: str = "", phase: str = "forward", index: int = -1
) -> Collective | None:
    """The :class:`Collective` of one call, or None for calls that move nothing.

    ``args`` is ``[(argument name, [(dtype, shape), ...]), ...]`` in schema
    order; ``outputs`` is ``[(dtype, shape), ...]`` for returned tensors
    that are not arguments (functional collectives).
    """
    kind = _KINDS.get(op.split(".")[1])
    if kind is None:
        return None
    written = [t for name, ts in args if name.startswith("output") for t in ts]
    read = [t for name, ts in args if not name.startswith("output") for t in ts]
    payload = _bytes(written + list(outputs)) if kind in _PAYLOAD_IS_OUTPUT else _bytes(read)
    n = group.size if group is not None else 1
    factor = _RING_FACTOR.get(kind)
    sent = payload * factor * (n - 1) // n if factor else payload
    tensors = tuple(_type(t) for _, ts in args for t in ts) + tuple(_type(t) for t in outputs)
    return Collective(op, kind, group, tensors, payload, sent, module, phase, index)


def _bytes(tensors) -> int:
    total = 0
    for dtype, shape in tensors:
        n = dtype.itemsize
        for s in shape:
            n *= s
        total += n
    return total


def _type(t) -> str:
    dtype, shape = t
    return f"{dtype_abbr(dtype)}[{', '.join(map(str, shape))}]"


class Comms:
    """The collectives of one traced rank; ``str()`` sums them per kind, group and phase."""

    def __init__(self, calls: list, world: tuple | None) -> None:
        self.calls = calls
        self.world = world

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.calls)

    @property
    def seconds(self) -> float | None:
        """Estimated time of every collective, one after another (None: not estimated)."""
        if any(c.seconds is None for c in self.calls):
            return None
        return sum(c.seconds for c in self.calls if c.seconds is not None)

    def table(self, width: int | None = None, modules: bool = True) -> str:
        """Count, payload, ring bytes and (when estimated) time per kind, group,
        module and phase (``modules=False``: all modules on one row)."""
        timed = self.seconds is not None
        rows: dict = defaultdict(lambda: [0, 0, 0, 0.0])
        for c in self.calls:
            g = f"{c.group.name} ({c.group.size} ranks)" if c.group is not None else "-"
            row = rows[(c.kind, g, (c.module or "<top>") if modules else "*", c.phase)]
            row[0] += 1
            row[1] += c.bytes
            row[2] += c.sent
            row[3] += c.seconds or 0.0
        body = [
            (k, g, m, p, str(n), fmt_bytes(b), fmt_bytes(s)) + ((f"{t * 1e3:.2f}",) if timed else ())
            for (k, g, m, p), (n, b, s, t) in sorted(rows.items())
        ]
        lines = render(
            ("collective", "group", "module", "phase", "calls", "bytes", "sent/rank") + (("ms",) if timed else ()),
            body,
            align="<<<<>>>" + (">" if timed else ""),
            width=width,
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        """A summary line and one row per kind, group and phase; ``table()`` splits the rows by module.

        Per module, a 32-layer model's FSDP step printed a hundred rows.
        """
        seconds = self.seconds
        head = f"{len(self.calls)} collectives, {fmt_bytes(self.bytes)} ({self.bytes:,} B)"
        if seconds is not None:
            head += f", {seconds * 1e3:.2f} ms estimated"
        return head + "\n" + self.table(modules=False) + "\n(per module: md.comms(trace).table())"


def comms(
    trace: Trace,
    start: int = 0,
    *,
    gpu: str | GPUProfile | None = None,
    bandwidth: float | None = None,
    network: float = NETWORK,
    latency: float = LATENCY,
    gpus_per_node: int = GPUS_PER_NODE,
) -> Comms:
    """The collectives of a trace made in a logical world, in call order
    (from call ``start`` on: a training step after its setup).

    With ``gpu`` (a profile's interconnect) or ``bandwidth`` (bytes/s per
    rank within a node), each collective's ``seconds`` is estimated: ring or
    tree, ``latency`` per step, ``network`` bytes/s per rank across nodes of
    ``gpus_per_node`` ranks (Note [Time of a collective] in
    ``collective_cost.py``).

    >>> import torch, metadispatch as md
    >>> import torch.distributed as dist
    >>> with md.MetaMode(world_size=4, rank=1) as mode:
    ...     x = torch.ones(256)
    ...     _ = dist.all_reduce(x)
    >>> [(c.kind, c.bytes, c.sent) for c in md.comms(mode.trace).calls]
    [('all_reduce', 1024, 1536)]
    >>> c = md.comms(mode.trace, bandwidth=1e9, latency=0.0).calls[0]  # ring: 2 (n-1)/n S / B
    >>> c.seconds == 2 * 3 / 4 * 1024 / 1e9
    True
    """
    net = link(gpu, bandwidth, network, latency, gpus_per_node) if gpu is not None or bandwidth is not None else None
    out = []
    for call in trace.calls[start:]:
        if call.op.split(".")[0] not in COLLECTIVE_NAMESPACES:
            continue
        schema = schema_of(call.func)
        args, group = [], None
        values = list(call.args) + [call.kwargs.get(a.name) for a in schema.arguments[len(call.args) :]]
        for a, v in zip(schema.arguments, values):
            if isinstance(v, Group):
                group = v
            elif a.name == "group_name" and isinstance(v, str):
                group = trace.groups.get(v)
            else:
                args.append((a.name, [(m.dtype, m.shape) for m in tensor_metas(v)]))
        fresh = [(m.dtype, m.shape) for m in tensor_metas(call.outputs) if m.id not in {x.id for x in call.inputs}]
        c = collective(call.op, args, fresh, group, call.module, call.phase, call.index)
        if c is not None and net is not None:
            ranks = tuple(c.group.ranks) if c.group is not None else (0,)
            c = c._replace(seconds=seconds(c.kind, c.bytes, ranks, net))
        if c is not None:
            out.append(c)
    return Comms(out, trace.world)
