"""One aten call: convert inputs, find the device, route, wrap, record.

Shared by ``MetaTensor.__torch_dispatch__`` (no mode: nothing is recorded)
and ``MetaMode.__torch_dispatch__`` (recorded into the mode's trace).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import DataDependentError, MetaDispatchError, UnsupportedOpError, explain_meta_refusal, mark_call
from ..ir.decode import is_marker
from ..source import user_frame
from ..spec.schema import facts
from ..tensor.convert import Converter
from ..tensor.lostcopy import warn_if_lost
from ..tensor.tensor import META, STATE, MetaTensor, is_wrapper_subclass, normalize_device, value_reads, wrap
from ..values import assume, known
from ..world import inflight
from . import hit
from .cache import UNCACHABLE, MetaCache, context
from .call import Call
from .router import route

__all__ = ["dispatch"]

# Ops whose tensor arguments may legitimately sit on different devices.
_CROSS_DEVICE = {
    "aten.copy_.default",
    "aten._to_copy.default",
    "aten.copy.default",
    "aten._copy_from.default",
    "aten._copy_from_and_resize.default",
    "aten.index.Tensor",
    "aten.index_put_.default",
    "aten.index_put.default",
    "aten._index_put_impl_.default",
    "aten.lift_fresh.default",
    "aten.lift_fresh_copy.default",
    "aten._pack_padded_sequence.default",  # lengths on the CPU, whatever the input's device
}

# What a meta kernel or fake impl raises when it refuses a call (torch._check
# raises the first four; custom ops' fake impls raise anything).
_REFUSALS = (RuntimeError, NotImplementedError, ValueError, IndexError, TypeError)


_PRIM_DEVICE = torch.ops.prim.device.default
_FAST: dict = {}  # op -> (its facts, whether its calls may take the cache-hit path: hit.eligible), decided once


def dispatch(func, args, kwargs, mode):
    """Answer one aten call ``func(*args, **kwargs)`` with MetaTensors, and
    record it when ``mode`` is a recording MetaMode at top level.

    ``mode`` is None for a MetaTensor outside any mode (nothing recorded).
    The ways a call is answered, in order, are listed in router.py's
    docstring; Note [A call's way through the engine] in call.py.
    """
    if func is _PRIM_DEVICE:
        # C++ asking a logical-CPU MetaTensor for its device
        # (Note [Backend keys of a logical CPU]).
        return args[0].device
    known_op = _FAST.get(func)  # (one OpOverload.__hash__, a Python method, for both)
    if known_op is None:
        f = facts(func)
        known_op = _FAST[func] = (f, hit.eligible(f, _CROSS_DEVICE))
    f, fast = known_op
    if mode is not None and mode.world is not None and mode.world.in_flight and not mode._depth:
        mode.world.in_flight.use(func, args, kwargs)  # Note [A collective's buffers live until its wait]
    if (
        fast
        and mode is not None
        and mode._depth == 0
        and mode.record
        and mode.cache is not None
        and (mode.assume is None or f.name not in mode.assume.ops)  # a token call gets its declared value below
    ):
        out = hit.answer_hit(func, f, args, kwargs, mode, fast == 2)  # Note [The cache-hit path] in hit.py
        if out is not hit.MISS:
            return out
    if f.passthrough:
        # Note [record_function ranges in a trace]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # torch.profiler.record_function ranges (an optimizer opens one per
        # step, DDP and FSDP theirs) hold no tensors and run as they are.  A
        # real run's dispatch log has them, so the trace records them too
        # (md.testing.assert_matches_eager failed on every step with an
        # optimizer): their ScriptObject handle as a marker string, which a
        # file may name and replay skips (MARKERS in ir/decode.py).  Other
        # profiler ops (the legacy enter returns a tensor handle) run unrecorded.
        with _compat.no_python_dispatch():
            out = func(*args, **kwargs)
        if is_marker(func) and mode is not None and mode._depth == 0 and mode.record:
            recorder = mode._recorder
            recorder.record(func, f, recorder.encode_inputs(args, kwargs), out, "real")
        return out
    if mode is None:
        warn_if_lost(func, args)  # Note [Copying real values into a MetaTensor outside a mode]
    converted = _convert(args, kwargs, _Lazy(mode))
    if converted is None:
        return NotImplemented  # Note [Wrapper subclasses dispatch first], a composite too (inference_mode)
    if f.implicit_composite and _autograd_left_out(args):
        return _decompose(func, args, kwargs, mode)
    args, kwargs, tensors = converted
    device, args, kwargs, kargs, kkwargs = _device(f, args, kwargs, tensors, mode)
    recording = mode is not None and mode._depth == 0 and mode.record
    pending = mode._recorder.encode_inputs(args, kwargs) if recording else None
    call = Call(func, f, args, kwargs, kargs, kkwargs, device, mode, tensors, pending)
    note = None
    try:
        try:
            if not tensors and not f.is_factory:  # Note [Wrapped numbers] in known.py
                out, stage, note = known.from_numbers(func, args, kwargs), "real", known.NOTE
            else:
                out, stage = _answer(call)
        except (DataDependentError, UnsupportedOpError) as e:
            # Inputs built from constants alone are answered from their real
            # values (Note [Known values] in known.py).  Else, under md.check
            # a top-level call no stage can answer is run for real instead;
            # nested calls let the outer call fall back whole.
            out = known.answer(func, f, tensors, args, kwargs, device, mode)
            if out is not None:
                stage, note = "real", known.NOTE
                if mode is not None and mode.assume is not None and not mode._depth and known.assumed(tensors):
                    note = mode.assume.follows(f.name, out)  # Note [Generating under declared assumptions]
            elif (
                mode is not None
                and not mode._depth
                and mode.assume is not None
                and (declared := mode.assume.read(f.name, device, args, kwargs))
            ):
                (out, note), stage = declared, "real"  # Note [Generating under declared assumptions]
            elif mode is None or mode.fallback is None or mode._depth:
                raise
            else:
                out, stage = mode.fallback(func, args, kwargs, device, e), "real"
        except _REFUSALS as e:
            # Under md.check, whatever else a meta kernel or fake impl raises
            # -- a dynamic output size, a dtype or an index device the real
            # kernel accepts -- is the real kernel's to judge (check.py).
            if mode is None or mode.fallback is None or mode._depth:
                if mode is None or not mode._depth:
                    explain_meta_refusal(e, f.name, sorted({str(t._md.device) for t in tensors}))
                raise
            out, stage = mode.fallback(func, args, kwargs, device, e), "real"
    except (MetaDispatchError, *_REFUSALS) as e:
        mark_call(e, f.name, user_frame())
        raise
    result = _wrap_outputs(f, out, args, kwargs, device)
    if mode is None or not mode._depth:
        if mode is not None and mode.assume is not None and f.name in mode.assume.ops and recording:
            note = mode.assume.tokens(f.name, result, args)  # Note [Generating under declared assumptions]
        hit.value_rules(func, f, args, kwargs, result, tensors, mode, note)  # bounds, known values
        if f.name == assume.FINITE_CHECK and recording and mode.fallback is not None:
            note = assume.finite_gradients(mode, args, kwargs)  # Note [GradScaler's found_inf] in values/assume.py
    if mode is not None and mode.world is not None and not mode._depth and inflight.issues(f.name):
        mode.world.in_flight.issue(f.name, args, kwargs, result)  # Note [A collective's buffers live until its wait]
    if recording:
        try:
            mode._recorder.record(func, f, pending, result, stage, note)
        except MetaDispatchError as e:  # a result a trace cannot hold
            mark_call(e, f.name, user_frame())
            raise
    return result


def _autograd_left_out(args) -> bool:
    """Whether the autograd keys were left out of this call (inference mode, inference
    tensors): only then does a composite reach the mode whole where eager runs its body
    (Note [Composites that reach the mode]).  Otherwise one that reaches it was called
    below autograd on purpose -- rms_norm's fused kernel from the logical GPU's autograd
    Function (gpu/gpu_composites.py), which a GPU runs as that kernel."""
    if torch.is_inference_mode_enabled():
        return True
    with _compat.no_torch_function_subclass():
        return any(isinstance(a, torch.Tensor) and a.is_inference() for a in args)


def _decompose(func, args, kwargs, mode):
    """Note [Composites that reach the mode]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A ``CompositeImplicitAutograd`` op (``linear``, SDPA, ``layer_norm``)
    runs its C++ body at the autograd key, so its calls, not it, reach the
    Python key -- except where the autograd keys are left out: under
    ``torch.inference_mode()``, or on inference tensors.  There eager runs
    the same body one key lower, at the backend, where the composite is
    the kernel: the CPU runs ``t`` and ``addmm`` for a ``linear``, and
    ``_scaled_dot_product_flash_attention_for_cpu`` (whose output has the
    query's transposed layout) for SDPA.  So the mode runs the body too, with
    itself pushed and still recording, and its calls are the trace's: the
    ops eager dispatches, with their metadata and their FLOPs (as
    ``FlopCounterMode`` decomposes such ops).  Recording the composite as one
    call answered by its meta decomposition gave the wrong strides and no
    FLOPs.  The body runs with the dispatch keys the backend would run it
    with (``_compat.as_at_the_backend``): under a Python mode's fallback a
    view of a parameter does not require grad, so ``matmul`` takes ``bmm``
    where eager folds to ``mm`` -- other ops, other bits.  (Every
    TorchDispatchMode, FakeTensorMode and FlopCounterMode included, sees
    that other path.)
    """
    if mode is None:  # MetaTensors outside a mode: their calls come back to __torch_dispatch__
        with _compat.as_at_the_backend():
            return func.decompose(*args, **kwargs)
    ambient = STATE.ambient
    _compat.push_mode(mode)
    try:
        with _compat.as_at_the_backend():
            return func.decompose(*args, **kwargs)
    finally:
        _compat.pop_mode()
        STATE.ambient = ambient


def _answer(call: Call):
    """Route the call, or rebuild its outputs from the mode's metadata cache."""
    mode, f, args, kwargs = call.mode, call.f, call.args, call.kwargs
    cache = mode.cache if mode is not None else None
    if cache is None or not f.cacheable:
        return route(call)
    ctx = context(mode, f)
    encoded = call.encoded
    if encoded is not None:
        key = cache.key_from_encoded(call.func, encoded[0], encoded[1], call.device, ctx, call.tensors)
    else:
        key = cache.key(call.func, args, kwargs, call.device, ctx)
    if key is None:
        cache.bypasses += 1
        return route(call)
    found = cache.entries.get(key)
    if found is not None:
        if found[0] is UNCACHABLE:
            cache.bypasses += 1
            return route(call)
        return cache.replay(found[0], call.tensors, call.device), found[1]
    before = _written_keys(f, args, kwargs) if f.mutates else None
    reads = value_reads()
    out, stage = route(call)
    cache.misses += 1
    if before is not None and before != _written_keys(f, args, kwargs):
        cache.store(key, UNCACHABLE, stage)  # it changed its argument's metadata
    elif value_reads() != reads:
        cache.store(key, UNCACHABLE, stage)  # computed from a value (Note [Known values])
    else:
        cache.remember(key, f, call.tensors, out, stage)
    return out, stage


def _written_keys(f, args, kwargs):
    return [
        MetaCache.key(None, (args[w] if isinstance(w, int) else kwargs[w],), None, None, None)
        for w in f.returns_write
        if w is not None
    ]


# Note [Wrapper subclasses dispatch first]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A dispatch mode sees a call before the tensor subclasses in it do.  A
# wrapper subclass with its own ``__torch_dispatch__`` -- DTensor, whose
# ``fully_shard`` and ``parallelize_module`` make parameters of it -- cannot
# be converted (it holds no storage of its own; its local tensor does): the
# mode answers NotImplemented, torch then runs the subclass's dispatch with
# the mode still active, and the subclass's calls on its local tensors (which
# the mode made, so MetaTensors) come back here and are recorded.
# FakeTensorMode does the same (``_check_for_subclass``).
class _Wrapped(Exception):
    """A wrapper subclass among the arguments (Note [Wrapper subclasses dispatch first])."""


def _convert(args, kwargs, convert):
    """Replace real tensors by MetaTensors; collect the tensor arguments.

    The common case -- every tensor already a MetaTensor -- copies nothing.
    None when a wrapper subclass is among them: it dispatches first.
    """
    tensors = []
    try:
        new_args = _convert_items(args, convert, tensors, nested=True)
    except _Wrapped:
        return None
    if new_args is not None:
        args = tuple(new_args)
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                if type(v) is not MetaTensor:
                    if is_wrapper_subclass(v):
                        return None
                    kwargs = dict(kwargs)
                    v = kwargs[k] = convert()(v)
                tensors.append(v)
    return args, kwargs, tensors


def _convert_items(items, convert, tensors: list, nested: bool):
    """A converted copy of ``items`` (and of lists in it, one level down when
    ``nested``), or None when nothing needed converting."""
    out = None
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor):
            if type(x) is MetaTensor:
                tensors.append(x)
                continue
            if is_wrapper_subclass(x):
                raise _Wrapped
            x = convert()(x)
            tensors.append(x)
        elif nested and type(x) in (list, tuple) and x:
            inner = _convert_items(x, convert, tensors, nested=False)
            if inner is None:
                continue
            x = type(x)(inner)
        else:
            continue
        if out is None:
            out = list(items)
        out[i] = x
    return out


class _Lazy:
    """The converter for real tensors reaching an op, made on first need (rare
    outside a mode): under a mode, they come from the user's scope."""

    __slots__ = ("mode", "made")

    def __init__(self, mode) -> None:
        self.mode = mode
        self.made = None

    def __call__(self):
        if self.made is None:
            self.made = self.mode.from_scope if self.mode is not None else Converter()
        return self.made


def _device(f, args, kwargs, tensors, mode):
    """The logical device of the outputs; the args as recorded (device made
    explicit) and as the kernel gets them (device on meta)."""
    kargs, kkwargs = args, kwargs
    device = None
    if f.device_arg is not None:
        pos, name = f.device_arg
        asked = kwargs.get(name) if name in kwargs else (args[pos] if pos < len(args) else None)
        if asked is not None:
            device = named = normalize_device(asked)
            if device.type == "meta" and not STATE.explicit_meta:
                # Note [Meta from options]
                device = (_common_device(f, tensors) if tensors else None) or STATE.ambient
            if f.is_factory and mode is not None and mode.device is not None and not _named(named, mode.device):
                device = mode.device  # Note [A factory's named device] in mode/devices.py
            if name in kwargs:
                kkwargs = dict(kwargs)
                kkwargs[name] = META
                kwargs = dict(kwargs)
                kwargs[name] = device  # what the trace records
            else:
                kargs = args[:pos] + (META,) + args[pos + 1 :]
                args = args[:pos] + (device,) + args[pos + 1 :]
        elif f.is_factory and mode is not None and mode.device is not None:
            device = mode.device
    if device is None:
        device = _common_device(f, tensors)
        if device is not None:
            STATE.ambient = device
    if device is None:
        device = mode.device if mode is not None and mode.device is not None else torch.device("cpu")
    return device, args, kwargs, kargs, kkwargs


def _named(device: torch.device, default: torch.device) -> bool:
    """Whether a factory keeps the device its torch call named (Note [A factory's named device] in mode/devices.py)."""
    return STATE.named_device and (device.type != "meta" or STATE.explicit_meta)


# Note [Meta from options]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# C++ code that builds a tensor "like" another one -- AccumulateGrad cloning a
# gradient, the autograd engine casting one, functorch materialising a zero
# tensor -- takes the device from the C++ tensor's options, which is meta
# (Note [Logical device]).  So an op with tensor inputs that is asked for
# device meta gets its inputs' logical device instead; only ``x.to("meta")``
# from Python (``STATE.explicit_meta``) really means meta.  A factory asked
# that way (``at::scalar_tensor(v, self.options())`` in a C++ composite) has no
# input to ask and gets the device of the tensors in flight (``STATE.ambient``):
# the first tensor argument of the innermost torch function the mode saw
# (``torch.corrcoef(y)`` sets it to ``y``'s device before its C++ body runs,
# so that body's factories follow ``y`` and not whatever ran before, as on a
# real device), else the device of the last op's tensors (the autograd
# engine calls no torch function).  Should one still come out on meta in
# backward, a logical-meta tensor gives way to any other device, as a CPU
# scalar does.
def _common_device(f, tensors):
    device = scalar = loose = None
    for t in tensors:
        d = t._md.device
        if d.type == "meta":
            # Built by C++ code from a MetaTensor's options, whose C++ device
            # is meta (Note [Meta from options]); it takes the device of the
            # tensors it meets.
            loose = d
        elif t.dim() == 0 and d.type == "cpu":
            scalar = scalar or d
        elif device is None:
            device = d
        elif d != device and f.name not in _CROSS_DEVICE:
            raise RuntimeError(
                f"{f.name}: expected all tensors to be on the same device, but found at "
                f"least two devices, {device} and {d}!"
            )
    if f.name in _CROSS_DEVICE and tensors:
        return tensors[0]._md.device
    return device or scalar or loose


def _wrap_outputs(f, out, args, kwargs, device):
    rw = f.returns_write
    if len(rw) == 1:
        return _wrap_one(out, rw[0], args, kwargs, device)
    if not rw:
        return out
    return tuple(_wrap_one(o, w, args, kwargs, device) for o, w in zip(out, rw))


def _wrap_one(o, write, args, kwargs, device):
    if write is not None:
        # In-place and out= ops return the very argument they mutated.
        return args[write] if isinstance(write, int) else kwargs[write]
    if isinstance(o, MetaTensor):
        return o
    if isinstance(o, torch.Tensor):
        if o.device.type != "meta":
            raise TypeError(f"a meta rule returned a real tensor on {o.device}; return MetaTensors or meta tensors")
        return wrap(o, device)
    if type(o) in (list, tuple):
        return type(o)(_wrap_one(x, None, args, kwargs, device) for x in o)
    return o
