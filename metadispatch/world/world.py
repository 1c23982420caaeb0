"""A logical N-rank world: ``torch.distributed`` as one rank of it sees it.

``MetaMode(world_size=N, rank=r)`` installs it on entry: the default process
group is torch's ``fake`` backend (N ranks, this one ``r``), which answers
every collective at once and moves no data, so one process traces what rank
``r`` of a real N-process run would do.  Collectives reach the mode as
c10d / ``_c10d_functional`` calls and are recorded like any other call
(``rules/collectives.py`` gives their outputs); ``md.comms`` reads them.

The user's own ``init_process_group(...)`` -- with "nccl", "gloo" or any
backend -- finds the world already made and joins it: a ``world_size`` or
``rank`` it names must agree with the mode's.  Everything is undone on exit,
also on exceptions: the groups are destroyed, the patched entry points and
``RANK``/``WORLD_SIZE`` are put back.

Limits: one logical world at a time in a process, in one thread (torch
names process groups in one process-wide registry); a process group already
initialised in the mode's thread is refused; ``RANK`` and ``WORLD_SIZE``
are process-wide while the world is entered; the fake backend's answers
carry no data, so code that reads a collective's values (a loss all-reduced
and printed) reads nothing.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref

import torch

from .. import _compat
from ..errors import MetaDispatchError
from ..ir.records import Group
from . import context_parallel, ddp_setup, fsdp_chunks, fsdp_storage, pipeline
from .inflight import InFlight

__all__ = ["World", "PATCHES", "WIRING", "describe", "group_named", "WORK", "REDUCE_OP"]

_ENV = ("RANK", "WORLD_SIZE")
WORK = "<work>"
REDUCE_OP = "<reduce op {}>"  # the op's name: "<reduce op SUM>"


class _Wiring:
    """What a world needs of the rules: ``collectives_defined()``, run once torch's
    functional collectives are imported (set by rules/collectives.py)."""

    collectives_defined = staticmethod(lambda: None)


WIRING = _Wiring()


class World:
    """The logical world of one MetaMode (``world_size`` ranks, seen from ``rank``)."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        if type(world_size) is not int or world_size < 1:
            raise MetaDispatchError(f"world_size={world_size!r}: a positive int")
        if type(rank) is not int or not 0 <= rank < world_size:
            raise MetaDispatchError(f"rank={rank!r}: an int in [0, {world_size})")
        self.world_size = world_size
        self.rank = rank
        # functional collectives not yet waited on (Note [A collective's buffers live until its wait])
        self.in_flight = InFlight()

    def install(self, steps: list, trace) -> None:
        """Note [One rank of a logical world]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        ``MetaMode(world_size=N, rank=r)``: torch.distributed is an
        initialised N-rank world seen from rank ``r`` while the mode is
        entered -- in its thread: the mode claims ``PATCHES`` through the
        ledger (mode/ledger.py), among them torch's registry of process
        groups, so the world's groups live in that thread alone and another
        thread sees torch.distributed as the host has it.  On a logical GPU
        on a host without CUDA, ``torch.cuda`` answers for it
        (logical_cuda.py, as the mode's GPU); on a logical CPU, as the host.
        One process traces one rank; what differs between ranks (uneven
        shards) is traced rank by rank.  ``trace`` keeps the world and its
        groups, which ``md.comms`` reads, as they stood on exit.  Each
        change is preceded by the step that undoes it (Note [Interrupts in
        mode entry and exit] in mode.py).
        """
        trace.world = (self.world_size, self.rank)
        steps.append(self.in_flight.clear)  # undone last: after the trace's last call
        # Note [One world at a time]
        _compat.clear_dtensor_caches()
        steps.append(_compat.clear_dtensor_caches)
        _compat.functional_collectives_module()  # Note [A rule for an op defined on import] in rules/collectives.py
        WIRING.collectives_defined()
        self._make(steps)
        # Undone first: the groups are read before they are destroyed.
        steps.append(functools.partial(self.record_groups, trace.groups))

    def check_free(self) -> None:
        """Refuse a world where torch.distributed is already initialised: the
        logical world's groups would take the names torch gave the real ones
        (one process-wide registry).  Asked before the world's patches go in."""
        if _compat.dist.is_initialized():
            raise MetaDispatchError(
                "MetaMode(world_size=...) needs torch.distributed uninitialised: a process group "
                "already exists in this process; destroy it first"
            )

    def _make(self, steps: list) -> None:
        steps.append(functools.partial(_compat.call_locked, _LOCK, _leave, self))
        _compat.call_locked(_LOCK, _enter, self)
        steps.append(functools.partial(_restore_env, {k: os.environ.get(k) for k in _ENV}))
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size))
        steps.append(_destroy_all)
        _CURRENT.making = True
        try:
            _compat.dist.init_process_group(
                "fake", store=_compat.fake_process_group_store(), rank=self.rank, world_size=self.world_size
            )
        finally:
            _CURRENT.making = False

    def join(
        self,
        backend=None,
        init_method=None,
        timeout=None,
        world_size=-1,
        rank=-1,
        store=None,
        group_name="",
        pg_options=None,
        device_id=None,
    ):
        """``init_process_group`` inside the mode: the world exists; check it is the one meant."""
        if world_size not in (-1, None, self.world_size) or rank not in (-1, None, self.rank):
            raise MetaDispatchError(
                f"init_process_group(world_size={world_size}, rank={rank}) inside "
                f"MetaMode(world_size={self.world_size}, rank={self.rank}): trace the rank you mean "
                "with MetaMode's own options"
            )

    def record_groups(self, into: dict) -> None:
        """Add every live process group to ``into``, by name."""
        into.update(self.groups())

    def groups(self) -> dict:
        """Name -> :class:`Group`, for every live process group."""
        if not _compat.dist.is_initialized():
            return {}
        return {name: _group(pg, name) for pg, name in _compat.named_process_groups().items()}


def _group(pg, name: str) -> Group:
    return Group(name, pg.size(), pg.rank(), tuple(_compat.distributed_c10d.get_process_group_ranks(pg)))


def describe(obj: torch.ScriptObject):
    """What the trace records for a c10d op's boxed argument or result:
    a :class:`Group` for a process group, ``"<reduce op SUM>"`` for a
    reduce op, a marker for the rest."""
    kind = obj._type().qualified_name().rpartition(".")[2]
    if kind == "ProcessGroup":
        pg = _compat.process_group_of(obj)
        return _group(pg, pg.group_name)
    if kind == "ReduceOp":
        # Replay passes it on (execution/collectives.py); PREMUL_SUM's factor is not readable.
        return REDUCE_OP.format(_compat.reduce_op_name(obj))
    return WORK if kind == "Work" else f"<{kind}>"


# Note [A DTensor's logical device]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A DTensor takes its C++ device from its local tensor's C++ device, and a
# MetaTensor on a logical CUDA device is a meta tensor underneath (Note
# [Logical device] in tensor.py): ``fully_shard`` would then find its
# parameters "still on meta" and refuse to train.  While a world is entered a
# DTensor reports its local tensor's device, as it does on a real run.
_TENSOR_DEVICE = torch.Tensor.device


def _dtensor_device(self) -> torch.device:
    local = getattr(self, "_local_tensor", None)  # unset while DTensor.__new__ runs
    if isinstance(local, torch.Tensor):
        return local.device
    return _TENSOR_DEVICE.__get__(self)


def _sharding_through_decomposition(below):
    """Note [DTensor's sharding through a decomposition]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    An op DTensor has no sharding rule for -- ``aten.linear`` under
    ``torch.inference_mode()``, where the composite reaches DTensor whole
    (Note [Composites that reach the mode] in core/dispatch.py) -- gets its
    sharding from its decomposition, run once per candidate placement on
    fresh ``device="meta"`` tensors under DTensor's own placement-tracking
    mode.  That is bookkeeping on the meta device, no kernel of the step:
    under a MetaMode it recorded every candidate's calls (4,400 for two TP
    linears).  So it runs with the MetaMode out of torch's FAKE slot, as in
    eager; DTensor then runs the op's decomposition on its local tensors,
    which the mode records.
    """

    def propagate(self, *args, **kwargs):
        if _compat.get_infra_mode(_compat.mode_key) is None:
            return below(self, *args, **kwargs)
        return _compat.call_without_infra_mode(below, (self, *args), kwargs)

    return propagate


# Note [Eager, not compiling]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Functional collectives take a different path when torch believes it is
# compiling, and it believes so whenever the FAKE dispatch-mode slot is
# taken -- where MetaMode sits (Note [Logical CUDA without CUDA] in
# _compat/dispatch.py).  Compiling, a result is waited on at once; eager, it is
# wrapped by ``_c10d_functional._wrap_tensor_autograd`` in an
# ``AsyncCollectiveTensor`` that holds it (the real run's memory).  A MetaMode traces eager code, so the question is
# answered as an eager run would answer it.
def _are_we_tracing(original) -> bool:
    mode = _compat.get_infra_mode(_compat.mode_key)
    if mode is None or isinstance(mode, _compat.FakeTensorMode):
        return original()
    return torch.compiler.is_compiling()  # the slot holds a MetaMode


# Note [A wrapped collective can be waited on]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager, a functional collective returns an ``AsyncCollectiveTensor`` and user
# code (torchtitan, DTensor) calls its ``.wait()``.  In a logical world the
# output is the traced tensor itself (rules/collectives.py), so it is given a
# ``wait`` that runs ``_c10d_functional.wait_tensor`` on it -- the op the
# real wrapper's ``wait`` runs, recorded in the trace where eager records it.
# It refers to the output weakly: a cycle would keep it to the next
# garbage collection, past where the real run frees it (CP's peak).
def _maybe_wrap_tensor(original, tensor):
    out = original(tensor)
    if isinstance(_compat.get_infra_mode(_compat.mode_key), _compat.FakeTensorMode) or hasattr(out, "wait"):
        return out
    out.wait = functools.partial(_wait, weakref.ref(out))  # a weak one: no cycle keeps the output past its use
    return out


def _wait(ref):
    return torch.ops._c10d_functional.wait_tensor.default(ref())


# Note [One world at a time]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DTensor caches its sharding and redistribution plans keyed by specs whose
# DeviceMesh compares by layout alone, not by process group.  A plan cached
# in one world (rank 0's) holds that world's mesh, and a later world (rank
# 2's, in the same process) would run its collectives on the first world's
# group names.  A real run has one world per process; tracing rank after
# rank does not, so the caches are emptied when a world is made and when it
# goes.
def _destroy_all() -> None:
    if _compat.dist.is_initialized():
        _compat.dist.destroy_process_group()


def _restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def group_named(name: str) -> Group:
    """The live process group called ``name`` (functional collectives name their group)."""
    return _group(_compat.resolve_process_group(name), name)


class _Current(threading.local):
    world: World | None = None
    making = False


_CURRENT = _Current()
_LOCK = threading.Lock()
_LIVE: list = []  # the World entered, in any thread (one at a time: Note [One world at a time])


def _enter(world: World) -> None:
    if _LIVE and _LIVE[0] is not world:
        raise MetaDispatchError(
            "MetaMode(world_size=...): another thread's logical world is entered; one logical world "
            "at a time in a process (torch registers process groups by name process-wide)"
        )
    if not _LIVE:
        # fmt: off
        _LIVE.append(world); _CURRENT.world = world  # noqa: E702
        # fmt: on


def _leave(world: World) -> None:
    if _LIVE and _LIVE[0] is world:
        # fmt: off
        _LIVE.clear(); _CURRENT.world = None  # noqa: E702
        # fmt: on


def _init_process_group(below, *args, **kwargs):
    """``init_process_group`` inside the mode joins its world (``World.join``)."""
    world = _CURRENT.world
    if world is None or _CURRENT.making:
        return below(*args, **kwargs)
    return world.join(*args, **kwargs)


def _patched(make):
    return lambda below: make


# (owner, attribute, make, why): the ledger's rows (mode/ledger.py), claimed
# by a world's mode in its thread.
PATCHES = [
    (
        _compat.distributed_c10d,
        "_world",
        lambda below: _compat.new_c10d_world(),
        "torch.distributed's registry of process groups: the logical world's, in its thread",
    ),
    *[
        (owner, "init_process_group", lambda below: functools.partial(_init_process_group, below), "joins the world")
        for owner in (_compat.dist, _compat.distributed_c10d)
    ],
    (
        _compat.dtensor_class,
        "device",
        _patched(property(_dtensor_device)),
        "a DTensor's logical device (Note [A DTensor's logical device])",
    ),
    (
        _compat.functional_collectives_module,
        "_are_we_tracing",
        lambda below: functools.partial(_are_we_tracing, below),
        "functional collectives run eagerly (Note [Eager, not compiling])",
    ),
    (
        _compat.functional_collectives_module,
        "_maybe_wrap_tensor",
        lambda below: functools.partial(_maybe_wrap_tensor, below),
        "a functional collective's output has .wait() (Note [A wrapped collective can be waited on])",
    ),
    (
        _compat.dtensor_decomp_strategy_class,
        "_propagate_through_decomp",
        _sharding_through_decomposition,
        "DTensor's sharding found through a decomposition, on meta outside the mode "
        "(Note [DTensor's sharding through a decomposition])",
    ),
    *fsdp_storage.PATCHES,
    *fsdp_chunks.PATCHES,
    *ddp_setup.PATCHES,
    *pipeline.PATCHES,
    *context_parallel.PATCHES,
]
