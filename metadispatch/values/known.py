"""Known values: tensors built from constants keep their real contents.

Note [Known values]
~~~~~~~~~~~~~~~~~~~
A MetaTensor holds no data, so code that branches on a tensor's values stops
with a DataDependentError.  Much of that code branches on constants, not on
the user's data: ``transformers`` checks for packed sequences with
``(position_ids[:, -1] == 0).all()`` where ``position_ids`` comes from
``arange``.  So a tensor whose contents follow from constants alone carries
its real CPU value, ``t._md.known = (value, cell)``, while it has at most
``mode.known_limit`` elements:

* sources: non-random factories (``arange``, ``zeros``, ``full``...; never
  ``empty``, whose contents are garbage), ``torch.tensor(...)`` literals
  (``lift_fresh``), and ``zeros_like``-style ops, whose values do not depend on
  their input's;
* every op whose tensor inputs are all known runs for real on the values
  too, so results of small ops on constants are known;
* real tensors that reach an op from the user's scope -- a closure, a
  global, an index tensor -- are constants too (``MetaMode.from_scope``),
  so ``tensor_split(x, idx)`` or ``x[idx]`` with a real ``idx`` is answered
  as without a mode; tensors the user converts (``mode.from_tensor``,
  ``md.trace``'s arguments), parameters, buffers and tensors that need
  grad are data, never known (but for step counters: an optimizer's, and
  Note [Counters in buffers] in standins/standins.py), and neither is anything
  computed from them -- except
  under ``md.check``, whose integer and boolean arguments (lengths, ids,
  labels) keep their values: a check reports on the run of those inputs;
* a data-dependent op (``item``, ``nonzero``, ``bool(t)``) on known inputs is
  answered by the real kernel (the dispatcher calls :func:`answer`), and the
  trace marks the call with ``<known value>``;
* a value a policy declares (:func:`declare`: the next token under
  ``md.GenerateAssumptions``, values/assume.py) is known too, and its cell
  says it is assumed; everything computed from it carries that mark, so a
  read of it is listed as the assumption's consequence.

The metadata cache may serve a call on known inputs, but never an answer
whose computation read a value (``value_reads`` in tensor.py; Note [What
the key must hold] in cache.py).

Views share their base's value storage and its ``cell``; an in-place op
whose inputs are not all known invalidates the cell, and so the value of the
tensor and of every view of it.  FakeTensorMode does the same for tensors of
at most one element only.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..spec.schema import facts, schema_of
from ..tensor.tensor import MetaTensor, note_value_read, value_of
from .realrun import flat, map_args, materialize, run_real, to_meta_outputs

__all__ = [
    "value_of",
    "know",
    "declare",
    "assumed",
    "concerns",
    "propagate",
    "answer",
    "from_numbers",
    "NOTE",
    "DEFAULT_LIMIT",
]

aten = torch.ops.aten

NOTE = "known value"
DEFAULT_LIMIT = 1 << 12  # elements: enough for position ids and padding masks, small enough to stay cheap

# Ops whose outputs hold uninitialised memory: never a known value.
_GARBAGE = ("empty", "resize", "set_")
# Collectives: their outputs hold what other ranks send, never a value one rank knows (run for
# real on the logical world's fake group they crashed the process); a declared routing's counts
# are declared by its policy instead (routing.py).
_COLLECTIVES = ("_c10d_functional.", "_c10d_functional_autograd.", "c10d.")
# Ops whose output values depend on their input's shape, not its values.
_SHAPE_ONLY = {
    "aten.zeros_like.default",
    "aten.ones_like.default",
    "aten.full_like.default",
    "aten.new_zeros.default",
    "aten.new_ones.default",
    "aten.new_full.default",
}
_LIFT = {"aten.lift_fresh.default", "aten.lift_fresh_copy.default"}
# Note [An operand that decides the result]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``known | x`` is all True when the known boolean operand is, whatever
# ``x`` holds; ``known & x`` is all zeros when the known (bool or integer)
# operand is.  generate()'s stopping criteria rely on it: the length
# criterion is a known all-True tensor or'ed with an EOS check of a made-up
# token, and ``unfinished & ~done`` then zeroes the (long) unfinished flags;
# without this rule the loop's stop read is made up too (``False``) and
# md.check on generate() never ends.  Only out-of-place ops: an in-place one
# keeps today's invalidation, which is always safe.
_DECIDED_BY = {
    "aten.bitwise_or.Tensor": True,
    "aten.logical_or.default": True,
    "aten.bitwise_and.Tensor": False,
    "aten.logical_and.default": False,
}
SPECIAL = _SHAPE_ONLY | _LIFT  # ops whose outputs can be known though no input is (kept off the hit path)


class _Cell:
    """Shared by a value and its views; cleared when one of them is overwritten.

    ``assumed``: the value follows from a declared one (a policy's next
    token, values/assume.py), so a read of it is a consequence of that
    assumption, which the trace lists (:func:`assumed`).
    """

    __slots__ = ("valid", "assumed")

    def __init__(self) -> None:
        self.valid = True
        self.assumed = False


def declare(t: MetaTensor, real: torch.Tensor, mode, limit: int | None = None) -> None:
    """Give ``t`` the declared value ``real``, marked as an assumption (:func:`assumed`)."""
    know(t, real, mode, limit)
    if t._md.known is not None:
        t._md.known[1].assumed = True


def assumed(tensors) -> bool:
    """Whether the known value of one of ``tensors`` follows from a declared one."""
    return any(isinstance(t, MetaTensor) and t._md.known is not None and t._md.known[1].assumed for t in tensors)


def know(t: MetaTensor, real: torch.Tensor, mode, limit: int | None = None) -> None:
    """Give ``t`` a copy of ``real`` as its value, if small enough for ``mode``.

    A copy, made for real (not by the mode): in-place ops update a known
    value where it lives.
    """
    if isinstance(real, MetaTensor):  # a value is a real tensor; copying a traced one below would crash torch
        raise TypeError(f"a known value must be a real tensor, not a traced {real!r}")
    if real.numel() <= (_limit(mode) if limit is None else limit) and not real.is_meta:  # meta: no value to know
        # no torch-function mode either: called from Python (a patched pipeline stage), MetaMode's swap
        # would turn the copy into a traced tensor
        with _compat.no_torch_function(), _compat.no_python_dispatch():
            # Kept on the CPU whatever the real tensor's device: values are
            # computed with CPU kernels (run_real), which a GPU tensor among
            # their arguments would refuse; the copy is small.
            t._md.known = (real.detach().to("cpu", copy=True), _Cell())


def _limit(mode) -> int:
    return DEFAULT_LIMIT if mode is None else getattr(mode, "known_limit", DEFAULT_LIMIT)


def concerns(f, tensors) -> bool:
    """Cheap test, run on every call: can known values matter to it?

    No, for the common case -- an op whose first input has no known value and
    which neither makes values from shapes alone nor writes in place.
    """
    return (
        not tensors
        or f.mutates
        or tensors[0]._md.known is not None
        or f.name in SPECIAL
        or f.name in _DECIDED_BY  # a later operand may decide it; the hit path misses on a known one anyway
    )


def propagate(func, f, tensors, args, kwargs, result, mode) -> None:
    """Give the outputs of a routed call their value when all inputs are known."""
    reals = None
    # An op that returns nothing (``_foreach_add_`` on step counts) updates
    # its inputs: those are what must be small.
    if (_may_know(f, tensors) or _holds_nothing(f, result)) and _small(tensors if result is None else result, mode):
        reals = _values(f, tensors, mode)
    if reals is None:
        if f.mutates:
            _invalidate(func, args, kwargs)
        elif f.name in _DECIDED_BY:
            _decided(f.name, tensors, result, mode)
        return
    real_args, real_kwargs = _substitute(args, kwargs, reals)
    try:
        real_out = run_real(func, real_args, real_kwargs)
    except NotImplementedError:
        # No CPU kernel to compute the value with (``cudnn_batch_norm`` of
        # known tensors on a logical GPU): the outputs are not known.
        if f.mutates:
            _invalidate(func, args, kwargs)
        return
    if f.name in _LIFT:
        real_out = real_out.clone()  # never alias the user's tensor
    base = args[f.view_of] if f.is_view and f.view_of is not None and f.view_of < len(args) else None
    cell = base._md.known[1] if isinstance(base, MetaTensor) and value_of(base) is not None else None
    _attach(result, real_out, cell, assumed(tensors))  # what is computed from a declared value is assumed too


def answer(func, f, tensors, args, kwargs, device, mode):
    """Outputs of a data-dependent call computed from known inputs, else None."""
    if not tensors or f.mutates:
        return None
    reals = _values(f, tensors, mode)
    if reals is None:
        return None
    note_value_read()
    real_args, real_kwargs = _substitute(args, kwargs, reals)
    real_out = run_real(func, real_args, real_kwargs)
    out = to_meta_outputs(real_out, device)
    if all(o.numel() <= _limit(mode) for o in flat(real_out) if isinstance(o, torch.Tensor)):
        _attach(out, real_out, None, assumed(tensors))
    return out


def _decided(name, tensors, result, mode) -> None:
    """Note [An operand that decides the result]"""
    fill = _DECIDED_BY[name]
    if not isinstance(result, MetaTensor) or not _small(result, mode):
        return
    if fill and result.dtype != torch.bool:
        return  # an integer ``|`` is decided only by all bits set: not worth a rule
    for t in tensors:
        v = value_of(t)
        if v is None or v.numel() == 0 or v.is_floating_point() or v.is_complex():
            continue
        if fill and v.dtype != torch.bool:
            continue
        # aten ops through run_real: no mode of ours sees these computations
        decides = run_real(aten.all.default if fill else aten.any.default, (v,), {})
        with _compat.no_torch_function():
            decided = bool(decides) == fill
        if decided:
            value = run_real(aten.full.default, (list(result.shape), fill), {"dtype": result.dtype})
            _attach(result, value, None, assumed([t]))
            return


def from_numbers(func, args, kwargs):
    """Note [Wrapped numbers]
    ~~~~~~~~~~~~~~~~~~~~~~~~
    A Python number C++ wraps into a tensor (``1j * z``'s ``1j``: a "wrapped
    number", 0-dim on the CPU) reaches ``__torch_dispatch__`` as the number
    again.  Backward formulas call ops on such a tensor alone --
    ``mul``'s backward takes ``_conj`` of its saved scalar -- so a call can
    come with tensor parameters but no tensor: the meta kernel then ran
    for real on a CPU tensor torch made of the number, and its result was
    refused as "a meta rule returned a real tensor".  Such a call reads only
    numbers the trace records, so its value is computed for real here and
    known, on the CPU, where eager's wrapped number lies, with the conjugate
    bit of ``_conj``'s lazy view (which the next op resolves with a clone).
    """
    real_out = run_real(func, args, kwargs)
    out = to_meta_outputs(real_out, torch.device("cpu"))
    for o, r in zip(flat(out), flat(real_out)):
        if isinstance(r, torch.Tensor) and (r.is_conj() or r.is_neg()):
            _compat.copy_math_bits(r, o)
    _attach(out, real_out, None)
    return out


def _may_know(f, tensors) -> bool:
    # The common case first: an op on user data (cheap, runs for every call).
    if tensors and value_of(tensors[0]) is None and f.name not in _SHAPE_ONLY and f.name not in _LIFT:
        return False
    return _makes_values(f)


def _makes_values(f) -> bool:
    """Whether ``f``'s outputs follow from its inputs: not random, not garbage (``empty``), not a collective."""
    return not f.random and not any(g in f.name for g in _GARBAGE) and not f.name.startswith(_COLLECTIVES)


def _holds_nothing(f, result) -> bool:
    """An ``empty`` of no elements holds no garbage: its value is known (``one_hot`` of no indices, an
    expert-parallel rank no token is routed to, world/expert_parallel.py)."""
    return f.name.startswith("aten.empty") and isinstance(result, MetaTensor) and result.numel() == 0


def _small(result, mode) -> bool:
    outs = [o for o in flat(result) if isinstance(o, MetaTensor)]
    return bool(outs) and all(o.numel() <= _limit(mode) for o in outs)


def _values(f, tensors, mode) -> dict | None:
    """id(MetaTensor) -> real value for every tensor input, or None if one is unknown."""
    if _limit(mode) <= 0:
        return None
    if f.name in _SHAPE_ONLY:
        if any(t.numel() > _limit(mode) for t in tensors):
            return None
        return {id(t): materialize(t, limit=None)[0] for t in tensors}
    if f.name in _LIFT:
        return _literal(tensors[0], mode)
    reals = {}
    for t in tensors:
        v = value_of(t)
        if v is None:
            return None
        reals[id(t)] = v
    return reals


def _literal(t, mode) -> dict | None:
    # lift_fresh receives the real tensor torch.tensor(...) built; the mode
    # converted it on the way in.  Named tensors are user arguments/params.
    real = mode._recorder.real_of(t) if mode is not None else None
    if real is None or t._md.name is not None or real.requires_grad or real.numel() > _limit(mode):
        return None
    return {id(t): real}


def _substitute(args, kwargs, reals):
    return map_args(lambda x: reals.get(id(x), x) if isinstance(x, MetaTensor) else x, args, kwargs)


def _attach(result, real_out, cell, from_assumed: bool = False) -> None:
    """Give each output its value; ``from_assumed``: computed from a declared one (``_Cell.assumed``)."""
    metas = flat(result)
    reals = flat(real_out)
    if len(metas) == len(reals):
        for m, r in zip(metas, reals):
            if isinstance(m, MetaTensor) and isinstance(r, torch.Tensor):
                # (an in-place op updated the value where it lives: keep it)
                if m._md.known is None or m._md.known[0] is not r:
                    m._md.known = (r, cell or _Cell())
    if from_assumed:
        for m in metas:
            if isinstance(m, MetaTensor) and m._md.known is not None:
                m._md.known[1].assumed = True


_MUTATED: dict = {}  # OpOverload -> positions/names of the arguments it writes


def _invalidate(func, args, kwargs) -> None:
    where = _MUTATED.get(func)
    if where is None:
        where = _MUTATED[func] = tuple(
            a.name if a.kwarg_only else i
            for i, a in enumerate(schema_of(func).arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    for w in where:
        x = kwargs.get(w) if isinstance(w, str) else (args[w] if w < len(args) else None)
        for t in x if isinstance(x, (list, tuple)) else (x,):
            kv = t._md.known if isinstance(t, MetaTensor) else None
            if kv is not None:
                kv[1].valid = False


def limit_hint(tensors, mode) -> str:
    """What a data-dependent error adds where a larger ``known_limit`` would answer the read."""
    n = constant_over_limit(tensors, mode)
    if n is None:
        return ""
    return (
        f" Its values follow from constants alone, but a tensor they are computed from has {n:,} elements, "
        f"over known_limit={_limit(mode):,} (Note [Known values] in values/known.py): MetaMode(known_limit=N) "
        f"or md.tracer(known_limit=N) (metadispatch trace --known-limit N) with N >= {n:,} keeps them."
    )


def constant_over_limit(tensors, mode) -> int | None:
    """For a data-dependent error: the most elements of a tensor that the
    values of ``tensors`` were computed from, where they follow from
    constants alone (non-random factories, through ops whose inputs are all
    such) and only the known-value limit lost them -- else None.

    Run on the error path only (``md.check`` meets it at every read it
    answers): a walk back from the tensors' own calls, stopping at the first
    leaf -- an argument, parameter, buffer or a real tensor from the user's
    scope is data, so the answer never asks for a larger limit where none
    would help -- and after ``_WALK`` calls, a few milliseconds.
    """
    trace, recorder = getattr(mode, "trace", None), getattr(mode, "_recorder", None)
    if trace is None or recorder is None:
        return None
    calls, leaves, token = trace.calls, trace.leaves, recorder.token
    need: set = set()
    start = -1
    for t in tensors:
        st = t._md if isinstance(t, MetaTensor) else None
        if st is None or st.recorder is not token or st.meta is None or st.call is None or st.meta.id in leaves:
            return None  # data, or recorded by another mode (its call numbers are another trace's)
        need.add(st.meta.id)
        start = max(start, st.call)
    largest = 0
    for i in range(min(start, len(calls) - 1), max(-1, start - _WALK), -1):
        call = calls[i]
        outs = call.output_metas
        if not any(m.id in need for m in outs):
            continue
        if isinstance(call.func, str) or not _makes_values(facts(call.func)):
            return None
        for m in outs:
            need.discard(m.id)
            largest = max(largest, m.numel)
        for m in call.inputs:
            if m.id in leaves:
                return None
            need.add(m.id)
        if not need:
            return largest if largest > _limit(mode) else None
    return None  # made before the trace, or further back than the walk goes


_WALK = 20_000
