"""Declared routing: the token counts a dropless expert-parallel MoE layer reads.

Note [Dispatching under a declared routing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A dropless MoE layer (torchtitan, DeepSpeed-MoE without capacity) counts
the tokens routed to each expert (``torch.histc`` of the top-k indices, as
torchtitan does, or ``torch.bincount(indices, minlength=experts)``), sends the counts by ``all_to_all_single`` and reads
them back (``.tolist()``) as the split sizes of the all-to-all of the
tokens.  The counts are data and the received ones are what other ranks
route: one traced rank cannot know them, so a plain trace stops with
``DataDependentError``.  The buffer sizes only need a routing, so
``md.tracer(assume=md.RoutingAssumption(...), world_size=N, rank=r)``
declares one, the same on every rank:

* ``"uniform"``: each expert gets ``picks // experts`` of a rank's
  ``picks`` top-k choices (the remainder to the first experts);
* ``"worst"``: every rank sends all its picks to the experts of rank 0
  (spread evenly over them): rank 0 receives every token of every rank;
* ``{expert: fraction}``: each expert's share of the picks (fractions
  that sum to 1; an expert not named gets 0), rounded down, the
  remainder to the largest shares;
* a list of per-rank count lists (recorded from a real run): rank ``s``
  routes ``counts[s][e]`` picks to expert ``e``.

Every count op's result is declared (a known value marked assumed, Note
[Known values] in known.py) and listed in ``trace.assumptions``; an
``all_to_all_single`` (functional or ``dist.``) of a declared count vector
receives, from each rank ``s``, rank ``s``'s counts for this rank's
experts under the same routing, declared and listed too; a functional
one over a group smaller than the world (an expert-parallel group) counts
``s`` and the experts within the group.  The ``.tolist()``
and the splits then compute from known values, as eager does.  ``picks``
is the count op's input size: a ``histc`` whose ``min``/``max`` leave out
some inputs is counted as if it did not.  Every rank is assumed to route
as many picks.  ``torch.bincount``'s length depends on the indices' largest
value: under a routing every index is an expert below ``minlength``, so it
is answered with ``minlength`` counts (without ``minlength``, or with
``weights``, it is refused).  The count all-to-all's split sizes, where
given, must be the routing's (``experts / world`` counts to and from each
rank); others are refused, naming the op and the values.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import UnsupportedFeatureError
from ..ir.assumptions import Assumption, after_warmup
from ..source import user_frame
from ..tensor.tensor import MetaTensor
from . import known

__all__ = ["RoutingAssumption"]

BINCOUNT = "aten.bincount.default"
COUNT_OPS = frozenset({"aten.histc.default", BINCOUNT})
ALL_TO_ALL = frozenset({"_c10d_functional.all_to_all_single.default", "c10d.alltoall_base_.default"})
# A functional collective's result passes through these (their input, as
# rules/collectives.py says); run for real on a known value they would wait
# on no collective (a crash) or wrap it in an AsyncCollectiveTensor.
PASS = frozenset({"_c10d_functional.wait_tensor.default", "_c10d_functional._wrap_tensor_autograd.default"})


class RoutingAssumption:
    """What ``md.tracer(assume=...)`` declares about an MoE layer's routing (Note [Dispatching under a declared routing]).

    ``routing``: ``"uniform"``, ``"worst"``, ``{expert: fraction}`` or a
    list of per-rank count lists recorded from a run.
    """

    def __init__(self, routing="uniform") -> None:
        if isinstance(routing, str):
            if routing not in ("uniform", "worst"):
                raise ValueError(f"RoutingAssumption({routing!r}): 'uniform', 'worst', {{expert: fraction}} or counts")
        elif isinstance(routing, dict):
            bad = [k for k, v in routing.items() if type(k) is not int or k < 0 or not 0 <= float(v) <= 1]
            if bad or abs(sum(float(v) for v in routing.values()) - 1) > 1e-6:
                raise ValueError(f"RoutingAssumption({routing!r}): expert ids >= 0 to fractions in [0, 1] summing to 1")
        elif isinstance(routing, (list, tuple)) and routing and all(isinstance(r, (list, tuple)) for r in routing):
            if any(type(c) is not int or c < 0 for r in routing for c in r) or len({len(r) for r in routing}) != 1:
                raise ValueError("RoutingAssumption(counts): one list of int counts >= 0 per rank, all as long")
            routing = [list(r) for r in routing]
        else:
            raise TypeError(
                f"RoutingAssumption({routing!r}): 'uniform', 'worst', {{expert: fraction}} or per-rank count lists"
            )
        self.routing = routing

    def __repr__(self) -> str:
        return f"RoutingAssumption({self.routing!r})"

    def start(self, mode) -> Routing:
        """The policy's state for one recording ``mode``: it writes into ``mode.trace``."""
        return Routing(self, mode)

    def counts(self, rank: int, world: int, experts: int, picks: int) -> list[int]:
        """The picks rank ``rank`` routes to each of ``experts`` experts."""
        r = self.routing
        if isinstance(r, list):
            if len(r) != world or len(r[0]) != experts or sum(r[rank]) != picks:
                raise ValueError(
                    f"{self!r}: counts for {world} ranks of {experts} experts, {picks} picks a rank, needed"
                )
            return list(r[rank])
        if r == "uniform":
            shares = {e: 1 / experts for e in range(experts)}
        elif r == "worst":
            local = max(experts // world, 1)
            shares = {e: 1 / local for e in range(local)}
        else:
            if max(r, default=0) >= experts:
                raise ValueError(f"{self!r}: expert {max(r)} of a layer with {experts}")
            shares = {e: float(v) for e, v in r.items()}
        out = [int(picks * shares.get(e, 0.0)) for e in range(experts)]
        order = sorted(range(experts), key=lambda e: (-shares.get(e, 0.0), e))
        for k in range(picks - sum(out)):
            out[order[k % len(order)]] += 1
        return out


class Routing:
    """One trace's answers under a :class:`RoutingAssumption` (the mode's ``assume``)."""

    ops = COUNT_OPS | ALL_TO_ALL | PASS

    def __init__(self, policy: RoutingAssumption, mode) -> None:
        self.policy, self.mode = policy, mode
        self.picks: dict[int, int] = {}  # experts -> picks of the last count op of that size

    def tokens(self, name: str, result, args: tuple = ()) -> str | None:
        """Declare a count op's or a count all-to-all's output; the call's note (None if not one)."""
        world = self.mode.world
        if world is None:
            raise ValueError(f"{self.policy!r} declares the routing of a world: trace with world_size= and rank=")
        src = args[1] if name == "c10d.alltoall_base_.default" and len(args) > 1 else (args[0] if args else None)
        if name in PASS:
            if not isinstance(src, MetaTensor) or not known.assumed([src]) or not isinstance(result, MetaTensor):
                return None
            held = known.value_of(src)
            if held is None:
                return None
            with _compat.no_python_dispatch():
                known.declare(result, held.clone(), self.mode)
            return f"the declared counts, waited on: {self.policy!r}"
        if name in COUNT_OPS:
            if not isinstance(result, MetaTensor) or result.dim() != 1 or not isinstance(src, torch.Tensor):
                return None
            experts = result.shape[0]
            self.picks[experts] = src.numel()
            value = self.policy.counts(world.rank, world.world_size, experts, src.numel())
        else:
            out = args[0] if name == "c10d.alltoall_base_.default" else result
            if not isinstance(out, MetaTensor) or not isinstance(src, MetaTensor) or not known.assumed([src]):
                return None
            experts, members = src.shape[0], _members(name, args, world)
            n = len(members)
            if experts not in self.picks or experts % n:
                return None
            local, me = experts // n, members.index(world.rank)
            _check_splits(name, args, local, n, self.policy)
            every = [self.policy.counts(s, n, experts, self.picks[experts]) for s in range(n)]
            value = [c for s in range(n) for c in every[s][me * local : (me + 1) * local]]
            result = out
        with _compat.no_python_dispatch():
            known.declare(result, torch.tensor(value, dtype=result.dtype), self.mode)
        shown = f"counts = {value}"
        trace = self.mode.trace
        entry = Assumption(len(trace.calls), name, _module(self.mode), user_frame(), shown, repr(self.policy))
        trace.assumptions.append(entry)
        return f"assumed {shown}: {self.policy!r}"

    def value_read(self, name: str, value: torch.Tensor) -> None:
        """A ``.tolist()``/``.item()`` of declared counts (the split sizes): listed."""
        shown = str(value.tolist()) if value.numel() <= 16 else f"{value.dtype} {list(value.shape)}"
        basis = f"computed from {self.policy!r}'s counts"
        trace = self.mode.trace
        trace.assumptions.append(Assumption(len(trace.calls), name, _module(self.mode), user_frame(), shown, basis))

    def follows(self, name: str, out) -> str:
        """A read computed from declared counts: listed as what the routing implies."""
        shown = str(out) if not isinstance(out, (torch.Tensor, tuple)) else "its outputs"
        basis = f"computed from {self.policy!r}'s counts"
        trace = self.mode.trace
        trace.assumptions.append(Assumption(len(trace.calls), name, _module(self.mode), user_frame(), shown, basis))
        return f"assumed {shown}: {basis}"

    def read(self, name: str, device, args: tuple = (), kwargs: dict | None = None):
        """A ``bincount`` of the expert ids (data-dependent: its length is the largest id + 1):
        ``minlength`` counts, as the declared routing has every id below it; :meth:`tokens` then
        declares them.  None for any other call."""
        if name != BINCOUNT:
            return None
        kwargs = kwargs or {}
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
        if weights is not None or not minlength:
            raise UnsupportedFeatureError(
                f"{name} under {self.policy!r}: the routing answers bincount(expert_ids, minlength=<experts>) "
                f"without weights; got minlength={minlength}{' and weights' if weights is not None else ''} "
                "(without minlength the length is the largest id + 1, which the routing does not say)"
            )
        return torch.empty(minlength, dtype=torch.int64, device="meta"), None

    def inputs(self, args, kwargs) -> None:
        return None

    def forget_warmup(self, trace, cut: int) -> None:
        """As ``GenerateAssumptions``': a warm-up run's routing is not the traced call's."""
        trace.assumptions = after_warmup(trace.assumptions, cut)

    def finish(self, trace, cut: int = 0) -> None:
        return None


def _check_splits(name: str, args: tuple, local: int, world: int, policy) -> None:
    """The count all-to-all's split sizes must be the routing's: ``local`` counts to and from each rank."""
    at = (3, 4) if name == "c10d.alltoall_base_.default" else (1, 2)
    even = [local] * world
    for label, i in zip(("output_split_sizes", "input_split_sizes"), at):
        given = list(args[i]) if i < len(args) and args[i] else []
        if given and given != even:
            raise UnsupportedFeatureError(
                f"{name}: {label}={given} for the expert counts, but {policy!r} answers with {local} "
                f"counts from each of {world} ranks ({label}={even}): experts spread evenly over the "
                "ranks, the count vector's length divided by the world size"
            )


def _members(name: str, args: tuple, world) -> list:
    """The ranks of a functional all-to-all's group (an expert-parallel group smaller than the world), or
    the world's: rank ``s`` of the group routes as rank ``s`` of ``counts``."""
    if name.startswith("_c10d_functional.") and len(args) > 3 and isinstance(args[3], str):
        pg = _compat.resolve_process_group(args[3])
        return list(_compat.distributed_c10d.get_process_group_ranks(pg))
    return list(range(world.world_size))


def _module(mode) -> str:
    modules = mode._recorder.modules
    return modules.current() if modules is not None else ""
