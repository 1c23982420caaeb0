"""The cache-hit path: a recorded call whose answer the cache already holds.

Note [The cache-hit path]
~~~~~~~~~~~~~~~~~~~~~~~~~
Most recorded calls of a model are cache hits (layer 7 runs layer 0's ops on
layer 0's shapes), and a hit needs less than the full path gives every call.
For an op that can be served this way (:func:`eligible`, decided once per op
with its facts: ``dispatch._FAST``) and a call whose tensors are all
MetaTensors, :func:`answer_hit` makes one pass over the arguments: each
tensor's record is the one its state already holds (``t._md.meta``; a leaf
is numbered on its first read as ``encode`` numbers it), and from those
records it builds the cache key exactly as ``MetaCache.key_from_encoded``
does and finds the outputs' logical device as ``_common_device`` does -- the
top-level tensors inline, those in lists and keyword arguments through
:func:`_take`.  On a hit, :func:`_made` builds each output from the recipe
and makes its record in the same step (a fresh output or a view: the
recipe's shape, strides, offset and dtype, a new id, its storage numbered;
the input itself, or a plain value, as the recorder's ``out`` records it),
and ``Recorder.append`` appends the call with its module and phase.  No
real tensor is converted, no device argument resolved, no schema read, and
no value knowledge or bounds run unless an input has some (below).  On
anything else -- a miss, an uncachable entry, an argument of another kind,
two devices that would raise -- it answers :data:`MISS` and the full path
runs from the start, having changed nothing (a tensor whose record lacked
its ``requires_grad`` has it corrected, which the full path would do too).

A known value or bounds among the inputs (a zero bias, a dropout mask's
[0, 1] that GPT-2's ``div_`` scales: 37 calls a step) cannot change the
outputs' metadata -- an entry computed from a value is UNCACHABLE
(``value_reads``), and the key holds no values -- so such a call hits too,
and then runs what the full path runs after answering (:func:`value_rules`:
bounds, decided comparisons, known values), which give its outputs theirs.
Under ``md.tracer(warmup=)`` (``keep_known``) such a call misses: the
full path notes each known input as it encodes it.

The key must be the one the full path builds, or the two paths would fill
the cache with entries the other never finds:
``tests/core/test_cache_differential.py`` holds them equal (cache off, on, and
interleaved), and ``test_hit_path_key_is_the_full_path_key`` compares keys.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import MetaDispatchError, mark_call
from ..ir.records import PLAIN_TYPES, TensorMeta
from ..source import user_frame
from ..tensor.state import TensorState
from ..tensor.tensor import META, STATE, MetaTensor
from ..values import assume, bounds, known
from ..world import inflight
from .cache import UNCACHABLE, context, view_bits
from .recipe import build

__all__ = ["MISS", "eligible", "answer_hit", "value_rules"]

MISS = object()
_PLAIN = frozenset(PLAIN_TYPES) - {int}
_CPU_TYPE = "cpu"
_EMPTY_STRIDED = torch.empty_strided
_AS_STRIDED = torch.as_strided
_TUPLE_NEW = tuple.__new__
_MAKE_CPU = _compat.make_cpu_subclass
_MAKE_META = _compat.make_meta_subclass
_INT = frozenset({int})


def eligible(f, cross_device) -> int:
    """Whether calls of the op ``f`` may take the hit path: 0 if not; 1 if
    cached, with no device argument, not a factory, and nothing value
    knowledge would add to its outputs; 2 if also its outputs get bounds of
    their own (``sigmoid``'s [0, 1]) -- the bounds rule runs after the hit
    (Note [The cache-hit path])."""
    if not (
        f.cacheable
        and not f.passthrough
        and f.device_arg is None
        and not f.is_factory
        and f.name not in cross_device
        and f.name not in known.SPECIAL
        and not f.implicit_composite  # decomposed as the backend runs it (Note [Composites that reach the mode])
        and f.name != assume.FINITE_CHECK  # declares its flag (Note [GradScaler's found_inf] in values/assume.py)
        and not inflight.issues(f.name)  # held until waited on (Note [A collective's buffers live until its wait])
    ):
        return 0
    return 2 if bounds.bounds_without_inputs(f.name) else 1


def answer_hit(func, f, args, kwargs, mode, with_bounds: bool):
    """The recorded outputs of a call the cache can answer, else :data:`MISS`."""
    rec = mode._recorder
    token = rec.token
    tensors: list = []
    storages: list = []
    parts: list = [getattr(func, "_op", func), None, None]  # as cache._op_key
    enc: list = []
    # Inside lists and keyword arguments (_take): the first device, a CPU
    # scalar's, a loose meta's (_common_device); whether an input has a value
    # or bounds.  The same for the top-level tensors, inline below (most
    # calls have no other), in locals: only which devices, not their order,
    # decides the answer.
    devices: list = [None, None, None, False]
    first = scalar = loose = None
    valued = bits = False
    for a in args:
        t = type(a)
        if t is MetaTensor:  # _take's MetaTensor case, inline
            st = a._md
            if st.known is not None or st.bounds is not None:
                valued = True
            m = st.meta
            if st.recorder is not token or m.requires_grad != a.requires_grad:
                m = rec.meta_of(a)  # a leaf's first read; or autograd set requires_grad after its producer
            d = st.device
            if d is not first:
                if d.type == "meta":
                    loose = d
                elif not m.shape and d.type == _CPU_TYPE:
                    scalar = scalar or d
                elif first is None:
                    first = d
                elif d != first:
                    return MISS
            if a.is_conj() or a.is_neg():
                bits = True
            tensors.append(a)
            storages.append(m.storage)
            parts.append(m[1:7])
            enc.append(m)
        elif t is list or t is tuple:
            if _INT.issuperset(map(type, a)):  # sizes and dims: _take's int case for each, in C
                ints = tuple(a)
                parts.append((tuple, ints))
                enc.append(ints)
                continue
            sub_key: list = []
            sub_enc: list = []
            bits = True  # view_bits asks each tensor
            for x in a:
                if (
                    type(x) is list
                    or type(x) is tuple
                    or not _take(x, rec, devices, tensors, storages, sub_key, sub_enc)
                ):
                    return MISS
            parts.append((tuple, tuple(sub_key)))  # encode() turns lists into tuples
            enc.append(tuple(sub_enc))
        elif not _take(a, rec, devices, tensors, storages, parts, enc):
            return MISS
    enc_kwargs = None
    if kwargs:
        # Each name, then its value (_call_key).  Not a list: the full path's
        # tensors (the recipe's positions) hold a kwarg's tensor, not a list's.
        enc_kwargs = {}
        kw_enc: list = []
        bits = True
        for name, v in kwargs.items():
            parts.append(name)
            t = type(v)
            if t is list or t is tuple or not _take(v, rec, devices, tensors, storages, parts, kw_enc):
                return MISS
            enc_kwargs[name] = kw_enc.pop()
    if devices[0] is not None:
        if first is None:
            first = devices[0]
        elif devices[0] != first:
            return MISS
    device = first or scalar or devices[1] or loose or devices[2]
    valued = valued or devices[3]
    if not tensors or device is None or (valued and rec.keep_known):
        return MISS
    parts[1] = device
    parts[2] = context(mode, f)
    if len(storages) > 1 and len(set(storages)) < len(storages):
        seen: dict = {}
        parts.append(("aliasing", tuple([seen.setdefault(s, i) for i, s in enumerate(storages)])))
    key = tuple(parts)
    if bits:
        marked = view_bits(tensors)
        if marked:
            key += (marked,)
    cache = mode.cache
    hit = cache.entries.get(key)
    if hit is None or hit[0] is UNCACHABLE:
        return MISS
    STATE.ambient = device  # as _device() leaves it (Note [Meta from options] in dispatch.py)
    recipe = hit[0]
    cache.hits += 1
    calls = rec.calls_now()
    index = len(calls)
    try:
        rw = f.returns_write
        if len(rw) == 1:
            result, out = _made(recipe, tensors, device, rec, index)
            outputs: tuple = (out,)
        elif rw:  # a ("tuple", parts) recipe
            made = [_made(r, tensors, device, rec, index) for r in recipe[1]]
            result = tuple([m[0] for m in made])
            outputs = tuple([m[1] for m in made])
        else:
            result, outputs = build(recipe, tensors, device), ()
        if valued:
            value_rules(func, f, args, kwargs, result, tensors, mode)
        elif with_bounds:  # no input has bounds, so no comparison is decided by them (bounds.decided)
            bounds.propagate(f.name, f.mutates, args, kwargs, result)
        rec.append(func, f, tuple(enc), enc_kwargs, outputs, hit[1], None, calls)
    except MetaDispatchError as e:  # a result a trace cannot hold
        mark_call(e, f.name, user_frame())
        raise
    return result


def _made(recipe, inputs, device, rec, index: int) -> tuple:
    """``(output, its record)``: ``recipe.build`` and the recorder's ``out``
    in one pass, the record of a fresh output or a view taken from the recipe
    (its shape, strides, offset and dtype) and not asked of the new tensor
    (Note [The cache-hit path]; Note [Recipes] in recipe.py)."""
    kind = recipe[0]
    if kind == "fresh":
        _, shape, stride, offset, dtype, where, nbytes = recipe
        if nbytes is None:
            elem = _EMPTY_STRIDED(shape, stride, dtype=dtype, device=META)
            if offset:
                elem = elem.as_strided(shape, stride, offset)
    elif kind == "view":
        _, i, shape, stride, offset, dtype, where = recipe
        with _compat.no_python_dispatch():  # the base is a MetaTensor
            elem = _AS_STRIDED(inputs[i], shape, stride, offset)
    elif kind == "list":
        made = [_made(r, inputs, device, rec, index) for r in recipe[2]]
        return recipe[1](m[0] for m in made), tuple([m[1] for m in made])
    else:  # the input itself ("same"), or a plain value
        o = build(recipe, inputs, device)
        return o, rec.out(o)
    if kind == "fresh" and nbytes is not None:  # on a storage of its recorded size
        t = build(recipe, inputs, device)
        st = t._md
    else:
        d = where or device
        # _compat.make_subclass's two cases, inline (Note [Backend keys of a logical CPU])
        t = (_MAKE_CPU if d.type == _CPU_TYPE else _MAKE_META)(MetaTensor, elem, False)
        st = t._md = TensorState(d)
    storage = rec.storage_number(t)
    # made with requires_grad=False; autograd sets it later (Recorder.meta_of)
    m = _TUPLE_NEW(TensorMeta, (rec.new_id(), shape, dtype, stride, offset, st.device, False, storage))
    rec.bases.setdefault(storage, m)
    st.recorder, st.meta, st.call = rec.token, m, index
    return t, m


def value_rules(func, f, args, kwargs, result, tensors, mode, note=None) -> None:
    """What a top-level call's outputs get after it is answered, on either
    path (dispatch.py): bounds (Note [Value bounds]), a comparison its
    input's bounds decide (Note [Bounds that decide a comparison]), and
    known values (Note [Known values]) unless ``note`` says the answer came
    from them."""
    bounds.propagate(f.name, f.mutates, args, kwargs, result)
    answer = bounds.decided(f.name, args) if f.name in bounds.COMPARISONS else None
    if answer is not None and isinstance(result, MetaTensor):
        with _compat.no_python_dispatch():  # a 0-dim value expanded: know() copies it only if small
            known.know(result, torch.full((), answer).expand(result.shape), mode)
    if note is None and known.concerns(f, tensors):
        known.propagate(func, f, tensors, args, kwargs, result, mode)


def _take(x, rec, devices: list, tensors: list, storages: list, key: list, enc: list) -> bool:
    """Append ``x``'s key part and record (as ``_call_key`` and ``encode`` make
    them) and note its device as ``_common_device`` does; False where the full
    path must answer: two devices (the full path raises), another type.  A
    tensor with a known value or bounds sets ``devices[3]`` (Note [The cache-hit path])."""
    t = type(x)
    if t is int:
        key.append(x)  # untagged (Note [What an entry weighs] in cache.py)
        enc.append(x)
        return True
    if t is MetaTensor:
        st = x._md
        if st.known is not None or st.bounds is not None:
            devices[3] = True  # value_rules after the hit
        if st.recorder is not rec.token:
            # A leaf's first read (a parameter in each trace): numbered as
            # encode() numbers it; a full path after a MISS finds it numbered.
            m = rec.meta_of(x)
        else:
            m = st.meta
            if m.requires_grad != x.requires_grad:
                m = rec.meta_of(x)  # autograd set it after the producing call: the record follows
        d = st.device
        if d.type == "meta":
            devices[2] = d
        elif not m.shape and d.type == _CPU_TYPE:
            devices[1] = devices[1] or d
        elif devices[0] is None:
            devices[0] = d
        elif d != devices[0]:
            return False
        tensors.append(x)
        storages.append(m.storage)
        key.append(m[1:7])
        enc.append(m)
        return True
    if t in _PLAIN:
        key.append((t, x))
        enc.append(x)
        return True
    return False
