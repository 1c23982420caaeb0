"""A cache of output metadata, so repeated calls skip the meta kernel.

Models repeat themselves: layer 7 runs the same ops on the same shapes as
layer 0.  A meta kernel costs tens of microseconds of Python (most of torch's
are Python references); rebuilding its outputs from remembered metadata costs
a few.  The cache maps a *key* -- the op, every input's metadata, every
non-tensor argument, the logical device of the outputs, the mode's device
and the rule registry's version -- to a *recipe* for the outputs.

Note [What the key must hold]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Everything that can change the answer: a user rule registered between two
calls (registry version), the mode's device override, the logical device
(a device-specific rule may answer differently), each tensor's shape,
strides, storage offset, dtype, logical device and conj/neg bits, and the
non-tensor arguments by value.  The entries are shared by every MetaMode in
the process, as FakeTensorMode's are, so tracing a model a second time (the
next test, the next step) runs no meta kernel at all; unlike FakeTensorMode's,
the key holds the mode option that changes answers (its device), so one mode
is never served what another computed differently.  Autocast needs no place
in the key: it acts above Python dispatch (its casts are calls of their own,
and a call reaches us with its inputs already cast), and torch turns it off
while a dispatch mode or subclass handles a call, so no answer here can
depend on it (``test_cache_autocast_and_plain_steps_share_the_cache``).  Rules must be pure
functions of their arguments -- ``MetaMode(cache=False)`` for those that are
not.  At most :data:`LIMIT` entries are kept, the oldest dropped first.

Not cached at all: ops whose output depends on data (they raise, or are
answered by a real kernel under ``md.check``), ops that change their
argument's metadata in place (``resize_``, ``t_``; tag ``inplace_view``),
views that change dtype, calls with a ``torch.Generator`` argument or any
argument we cannot hash, and calls whose inputs carry known values.

Note [Recipes]
~~~~~~~~~~~~~~
Per output: a fresh tensor (``empty_strided`` on meta), a view of input
``i`` (``as_strided`` on that input's storage, so storage sharing and
offsets are exact), the very input object ``i`` (in-place, ``out=``,
``lift_fresh``), or a plain value (``_fused_sdp_choice`` returns an int).
"""

from __future__ import annotations

import threading

import torch

from .. import _compat
from .tensor import META, MetaTensor, wrap
from ..ir.trace import TensorMeta

__all__ = ["MetaCache", "UNCACHABLE", "clear", "LIMIT"]

UNCACHABLE = object()
LIMIT = 16384  # entries in the shared cache, a few hundred bytes each: ~150 per model
_SHARED: dict = {}  # key -> (recipe, stage), for every mode in the process
_STORE_LOCK = threading.Lock()
_HASHABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
             torch.memory_format)


def clear() -> None:
    """Forget every cached answer (the next call of each op runs its rule again)."""
    _SHARED.clear()


class MetaCache:
    """One mode's view of the shared entries, with its own counters."""

    def __init__(self) -> None:
        self.entries = _SHARED
        self.hits = 0
        self.misses = 0
        self.bypasses = 0

    # -- keys
    @staticmethod
    def key(func, args, kwargs, device, extra):
        """The key from the call's own arguments (MetaTensors)."""
        return _call_key(func, args, kwargs, device, extra, _tensor_key)

    @staticmethod
    def key_from_encoded(func, enc_args, enc_kwargs, device, extra):
        """The same key, from the TensorMeta records the recorder already made."""
        return _call_key(func, enc_args, enc_kwargs, device, extra, _meta_key)

    # -- recipes
    def remember(self, key, f, tensors, result, stage) -> None:
        """``tensors``: the call's tensor arguments, in dispatch order."""
        self.store(key, _recipe(f, tensors, result), stage)

    def store(self, key, recipe, stage) -> None:
        # Only misses get here; the lock keeps two tracing threads from
        # evicting at once (iterating a dict another thread resizes raises).
        with _STORE_LOCK:
            entries = self.entries
            while len(entries) >= LIMIT:
                del entries[next(iter(entries))]  # dicts keep insertion order
            entries[key] = (recipe, stage)

    def replay(self, recipe, tensors, device):
        self.hits += 1
        if recipe[0] == "tuple":
            return tuple(_build(r, tensors, device) for r in recipe[1])
        return _build(recipe, tensors, device)


def _call_key(func, args, kwargs, device, extra, tensor_key):
    parts = [func, device, extra]
    for a in args:
        k = _value_key(a, tensor_key)
        if k is UNCACHABLE:
            return None
        parts.append(k)
    if kwargs:
        for name, v in kwargs.items():
            k = _value_key(v, tensor_key)
            if k is UNCACHABLE:
                return None
            parts.append(name)
            parts.append(k)
    return tuple(parts)


def _value_key(a, tensor_key):
    k = tensor_key(a)
    if k is not None:
        return k
    if isinstance(a, _HASHABLE):
        return (type(a), a)
    if type(a) in (list, tuple):
        parts = []
        for x in a:
            k = _value_key(x, tensor_key)
            if k is UNCACHABLE:
                return UNCACHABLE
            parts.append(k)
        return (type(a), tuple(parts))
    return UNCACHABLE


def _tensor_key(a):
    """A MetaTensor's metadata, or None for anything else."""
    if isinstance(a, MetaTensor):
        return (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a._md_device,
                a.is_conj(), a.is_neg())
    return None


def _meta_key(a):
    """A TensorMeta's metadata, or None for anything else."""
    if type(a) is TensorMeta:
        # shape, dtype, stride, offset, device; conj/neg bits are not in a
        # TensorMeta, and only complex tensors can have them.
        return UNCACHABLE if a.dtype.is_complex else a[1:6]
    return None


def _recipe(f, inputs, result):
    if len(f.returns_write) == 1:
        return _recipe_one(result, inputs)
    if not f.returns_write:
        return ("value", result)
    parts = tuple(_recipe_one(r, inputs) for r in result)
    if any(p is UNCACHABLE for p in parts):
        return UNCACHABLE
    return ("tuple", parts)


def _recipe_one(out, inputs):
    if isinstance(out, torch.Tensor):
        for i, t in enumerate(inputs):
            if out is t:
                return ("same", i)
        meta = (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype)
        key = _compat.storage_key(out)
        for i, t in enumerate(inputs):
            if _compat.storage_key(t) == key:
                if t.dtype != out.dtype:
                    return UNCACHABLE
                return ("view", i) + meta
        return ("fresh",) + meta
    if type(out) in (list, tuple):
        parts = tuple(_recipe_one(o, inputs) for o in out)
        if any(p is UNCACHABLE for p in parts):
            return UNCACHABLE
        return ("list", type(out), parts)
    if isinstance(out, _HASHABLE):
        return ("value", out)
    return UNCACHABLE


def _build(recipe, inputs, device):
    kind = recipe[0]
    if kind == "fresh":
        # No mode is on the stack while a dispatch handler runs, and no
        # MetaTensor is involved: a plain meta factory call.
        _, shape, stride, offset, dtype = recipe
        elem = torch.empty_strided(shape, stride, dtype=dtype, device=META)
        if offset:
            elem = elem.as_strided(shape, stride, offset)
        return wrap(elem, device)
    if kind == "view":
        _, i, shape, stride, offset, dtype = recipe
        with _compat.no_python_dispatch():  # the base is a MetaTensor
            elem = torch.as_strided(inputs[i], shape, stride, offset)
        return wrap(elem, device)
    if kind == "same":
        return inputs[recipe[1]]
    if kind == "list":
        return recipe[1](_build(r, inputs, device) for r in recipe[2])
    return recipe[1]
