"""Collectives in replay: a rank's trace run over a real process group.

A trace made under ``MetaMode(world_size=N, rank=r)`` replays in rank
``r``'s process of a real N-process job (``gloo`` on CPU): every rank
replays its own trace at once, and the collectives meet.  The trace records
a process group as a :class:`~metadispatch.ir.records.Group` (its members'
global ranks), a reduce op by name (``"<reduce op SUM>"``) and a Work as a
marker; here each becomes the live object again.

Note [Collectives replay on live groups]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A recorded group is matched to a live one by its members, not by its name:
names are handed out in creation order, and the replaying process may make
its groups in another order.  The world's group is the default one; any
other must exist before replay (``dist.new_group(ranks)``, or the
``DeviceMesh`` the run used), since making a group is itself a collective
every rank must join.  A c10d op runs as the ProcessGroup method behind it
and is waited on at once: the trace is one sequence of calls, and what it
recorded as returned -- the tensors written -- is what the method writes.
A functional collective (``_c10d_functional``) runs as itself with the live
group's name; its ``wait_tensor`` is a call of its own in the trace.

Limits: point-to-point ops are not traced, so not replayed; ``reduce_``,
``gather_``, ``scatter_``, ``allgather_coalesced_`` and ``alltoall_``
are refused by name; a PREMUL_SUM reduce op (its factor is not recorded)
and a reduce op the backend lacks (gloo has no AVG) fail as the backend
fails, naming the call.
"""

from __future__ import annotations

from .. import _compat
from ..errors import ReplayError
from ..ir.records import Group
from ..ir.trace import Trace
from ..spec.schema import schema_of
from ..world.world import REDUCE_OP, WORK

__all__ = ["check_world", "collective_callable", "is_collective", "live_group", "NAMESPACES"]

NAMESPACES = ("c10d", "_c10d_functional")
_REDUCE_PREFIX = REDUCE_OP.partition("{")[0]


def check_world(trace: Trace) -> None:
    """Refuse, before anything runs, a rank's trace outside that rank's process of its world."""
    if trace.world is None:
        return
    n, rank = trace.world
    dist = _compat.dist
    here = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else None
    if here != (n, rank):
        where = "no process group" if here is None else f"rank {here[1]} of {here[0]}"
        raise ReplayError(
            f"replay: this trace is rank {rank} of a world of {n}; it replays in that rank's process of "
            f"a real {n}-process job (dist.init_process_group, e.g. 'gloo'), every rank replaying its "
            f"own trace at once -- this process is {where}. To check the step's values in one process, "
            "trace it without a world and replay that (docs/distributed.md)"
        )


def live_group(group: Group):
    """The live process group with ``group``'s members (Note [Collectives replay on live groups])."""
    dist = _compat.dist
    if tuple(group.ranks) == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    for pg in _compat.named_process_groups():
        if tuple(_compat.distributed_c10d.get_process_group_ranks(pg)) == tuple(group.ranks):
            return pg
    raise ReplayError(
        f"replay: the trace's process group {group.name!r} (ranks {list(group.ranks)}) does not exist in "
        f"this process; make it first, on every rank (dist.new_group({list(group.ranks)}) or the DeviceMesh "
        "the run used)"
    )


def _reduce_op(marker, op: str):
    if not (isinstance(marker, str) and marker.startswith(_REDUCE_PREFIX) and marker.endswith(">")):
        raise ReplayError(f"replay: {op} recorded without its reduce op ({marker!r}); trace it again")
    name = marker[len(_REDUCE_PREFIX) : -1]
    try:
        return _compat.reduce_op(name)
    except KeyError:
        raise ReplayError(f"replay: {op}: unknown reduce op {name!r}") from None


def _opts(kind, **fields):
    opts = kind()
    for k, v in fields.items():
        setattr(opts, k, v)
    return opts


def _c10d(op: str):
    """The method call behind c10d op ``op`` (name without namespace or overload):
    ``run(args, pg) -> (Work, what the op returns besides its Work)``."""
    dist = _compat.dist
    runs = {
        "_allgather_base_": lambda a, pg: (_compat.allgather_base(pg, a[0], a[1]), a[0]),
        "_reduce_scatter_base_": lambda a, pg: (
            _compat.reduce_scatter_base(pg, a[0], a[1], _reduce_op(a[3], op)),
            a[0],
        ),
        "allreduce_": lambda a, pg: (
            pg.allreduce(list(a[0]), _opts(dist.AllreduceOptions, reduceOp=_reduce_op(a[2], op))),
            list(a[0]),
        ),
        "allreduce_coalesced_": lambda a, pg: (
            pg.allreduce_coalesced(list(a[0]), _opts(dist.AllreduceCoalescedOptions, reduceOp=_reduce_op(a[2], op))),
            None,
        ),
        "allgather_": lambda a, pg: (pg.allgather([list(x) for x in a[0]], list(a[1])), [list(x) for x in a[0]]),
        "allgather_into_tensor_coalesced_": lambda a, pg: (
            pg.allgather_into_tensor_coalesced(list(a[0]), list(a[1])),
            None,
        ),
        "reduce_scatter_": lambda a, pg: (
            pg.reduce_scatter(
                list(a[0]), [list(x) for x in a[1]], _opts(dist.ReduceScatterOptions, reduceOp=_reduce_op(a[3], op))
            ),
            list(a[0]),
        ),
        "reduce_scatter_tensor_coalesced_": lambda a, pg: (
            pg.reduce_scatter_tensor_coalesced(
                list(a[0]), list(a[1]), _opts(dist.ReduceScatterOptions, reduceOp=_reduce_op(a[3], op))
            ),
            None,
        ),
        "broadcast_": lambda a, pg: (
            pg.broadcast(list(a[0]), _opts(dist.BroadcastOptions, rootRank=a[2], rootTensor=a[3])),
            list(a[0]),
        ),
        "alltoall_base_": lambda a, pg: (pg.alltoall_base(a[0], a[1], list(a[3]), list(a[4])), None),
        "barrier": lambda a, pg: (pg.barrier(), None),
    }
    return runs.get(op)


def collective_callable(func, groups: dict):
    """What replay calls for collective ``func``, whose recorded groups are ``groups`` (name -> Group)."""
    namespace, name = str(func).split(".")[:2]
    if namespace == "_c10d_functional":
        return _functional(func, groups)
    run = _c10d(name)
    if run is None:
        raise ReplayError(f"replay: {func} is not replayed over a process group yet (docs/distributed.md)")
    returns_tensors = len(schema_of(func).returns) == 2

    def call(*args, **kwargs):
        schema = schema_of(func).arguments
        args = list(args) + [kwargs.get(a.name, a.default_value) for a in schema[len(args) :]]
        group = next((a for a in args if isinstance(a, Group)), None)
        if group is None:
            raise ReplayError(f"replay: {func} recorded without its process group")
        work, written = run(args, live_group(group))
        work.wait()
        return (written, WORK) if returns_tensors else WORK

    return call


def _functional(func, groups: dict):
    """A functional collective with the live group's name in place of the recorded one."""
    index = next(i for i, a in enumerate(schema_of(func).arguments) if a.name == "group_name")
    real = _compat.op_callable(func)

    def call(*args, **kwargs):
        args = list(args)
        recorded = args[index] if index < len(args) else kwargs.get("group_name")
        group = groups.get(recorded)
        if group is None:
            raise ReplayError(f"replay: {func} names group {recorded!r}, which the trace does not record")
        name = live_group(group).group_name
        if index < len(args):
            args[index] = name
        else:
            kwargs["group_name"] = name
        return real(*args, **kwargs)

    return call


def is_collective(func) -> bool:
    return getattr(func, "namespace", None) in NAMESPACES
