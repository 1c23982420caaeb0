"""The part of a trace some tensors depend on: a backwards slice over its calls.

``md.materialize`` replays what built a module, and only that: the mode it
was built in may also have run a step on a real model, whose parameters and
inputs the trace holds no values for.  :func:`slice_for` keeps the calls
that made, or wrote into, the memory of the wanted tensors, and -- walking
backwards -- the calls that made or wrote what those read, and so on.  Every
other call is left out, with the leaves only it read.

Note [Slicing keeps eager's random numbers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Dependencies through memory are exact: a tensor's value is a function of the
calls that created or wrote its storage (through any alias: ``w[:2].zero_()``
writes ``w``) and of what those read, so walking the calls backwards over
storages, and over the ids of the tensors each kept call reads, finds all of
them.  The random streams are the one dependency memory does not show: a
random op draws from a generator whose position is whatever the calls
before it drew.  So every call that drew from the same stream *before* a
kept random call is kept too, with what it read, though nothing wanted
reads its result: HF models initialise a layer and then overwrite it, or
build a head that tying discards, and eager drew those numbers all the
same.  Draws after the last kept random call change nothing, nor do draws
before the stream was set to recorded bytes (a ``torch.manual_seed`` or
``set_rng_state`` inside the mode: the kept calls draw from there).

A draw kept for its position may read what the trace has no values for: a
dropout in a real model's step run in the mode before the module was built
reads that model's activations.  How many numbers an op draws can depend on
the values it is given (``trunc_normal_`` redraws until in range), so
replay cannot stand in made-up values for them and be sure of eager's
position: :func:`slice_for` raises :class:`SliceError` naming that call.
RNG state reads and writes are kept, at the same points among the calls
that remain.
"""

from __future__ import annotations

from bisect import bisect_left

from ..binding.streams import stream_of
from ..errors import MetaDispatchError
from ..ir.records import tensor_metas
from ..ir.rng import GeneratorRef
from ..ir.trace import Trace
from ..spec.ownops import OWN_OPS
from ..spec.schema import arg_value, facts

__all__ = ["slice_for", "SliceError"]


class SliceError(MetaDispatchError):
    """The wanted tensors' random draws depend on calls the slice leaves out."""


def slice_for(trace: Trace, wanted: list) -> Trace:
    """The sub-trace that computes the tensor records ``wanted`` (TensorMeta, as they are now).

    The calls keep their order and their ``index`` in ``trace``; the leaves
    are those the kept calls read (or that are wanted themselves).  Raises
    :class:`SliceError` where Note [Slicing keeps eager's random numbers]
    says it must.
    """
    forced: set = set()  # draws kept for the stream position they leave behind
    while True:
        kept, ids = _backwards(trace, wanted, forced)
        more = _earlier_draws(trace, kept) - forced
        if not more:
            break
        forced |= more
    if forced:
        _refuse_draws_on_outside_data(trace, forced)
    return _sub_trace(trace, [c for c in trace.calls if c.index in kept], ids)


def _backwards(trace: Trace, wanted: list, forced: set) -> tuple:
    """(indexes of the calls ``wanted`` and the ``forced`` calls depend on, the ids they read)."""
    ids = {m.id for m in wanted}
    storages = {m.storage for m in wanted}
    kept: set = set()
    for call in reversed(trace.calls):
        outs = call.output_metas
        # Made what is wanted (views included: a kept call reads the view),
        # or wrote into wanted memory through any alias.  A view nobody
        # wanted (``w.t()`` in a later forward) writes nothing: left out.
        writes = [m for arg in facts(call.func).writes for m in tensor_metas(arg_value(call, arg))]
        if call.index in forced or any(m.id in ids for m in outs) or any(m.storage in storages for m in writes):
            kept.add(call.index)
            for m in (*call.inputs, *outs):
                ids.add(m.id)
                storages.add(m.storage)
    return kept, ids


def _draws(call) -> str | None:
    """The random stream ``call`` draws from, or None."""
    if not facts(call.func).random and call.func.name() not in OWN_OPS:
        return None
    for a in (*call.args, *call.kwargs.values()):
        if type(a) is GeneratorRef:
            return f"generator {a.index}"
    metas = call.output_metas or call.inputs
    return stream_of(metas[0].device) if metas else "cpu"


def _earlier_draws(trace: Trace, kept: set) -> set:
    """Calls left out that draw from a stream before a kept call draws from it."""
    draws = [(call.index, _draws(call)) for call in trace.calls]
    last: dict = {}  # stream -> index of the last kept call drawing from it
    for i, stream in draws:
        if stream is not None and i in kept:
            last[stream] = i
    start: dict = {}  # stream -> the call before which recorded bytes last set it
    for e in trace.rng_events:
        if e.action == "load" and e.state is not None and e.at <= last.get(e.stream, -1):
            start[e.stream] = max(start.get(e.stream, 0), e.at)
    for e in trace.rng_events:  # a state saved earlier and loaded after: everything before counts
        if e.action == "load" and e.state is None and e.at > start.get(e.stream, 0):
            start[e.stream] = 0
    return {i for i, stream in draws if stream in last and i not in kept and start.get(stream, 0) <= i < last[stream]}


def _refuse_draws_on_outside_data(trace: Trace, forced: set) -> None:
    """A draw kept only for the stream's position may not read data the trace has no values for."""
    outside = {tid for tid, leaf in trace.leaves.items() if leaf.value is None}
    if not outside or not outside & _backwards(trace, [], forced)[1]:
        return
    for call in trace.calls:
        if call.index in forced and outside & _backwards(trace, [], {call.index})[1]:
            where = f" in {call.module}" if call.module else ""
            line = f" ({call.source})" if call.source else ""
            raise SliceError(
                f"call #{call.index} {call.op}{where}{line} drew from the {_draws(call)} generator "
                "before the calls that built these tensors did, and it read tensors the trace "
                "keeps no values for (another model's data): eager's construction drew from where "
                "that call left the generator, which replay cannot know"
            )


def _sub_trace(trace: Trace, kept: list, ids: set) -> Trace:
    sub = Trace()
    sub.calls = kept
    sub.leaves = {tid: leaf for tid, leaf in trace.leaves.items() if tid in ids}
    sub.world, sub.groups, sub.gpu = trace.world, trace.groups, trace.gpu
    sub.rng_state, sub.rng_cuda, sub.generators = trace.rng_state, trace.rng_cuda, trace.generators
    # Each state read or write before the same kept call as in ``trace``.
    positions = [c.index for c in kept]
    sub.rng_events = [e._replace(at=bisect_left(positions, e.at)) for e in trace.rng_events]
    return sub
