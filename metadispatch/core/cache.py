"""A cache of output metadata, so repeated calls skip the meta kernel.

Models repeat themselves: layer 7 runs the same ops on the same shapes as
layer 0.  A meta kernel costs tens of microseconds of Python (most of torch's
are Python references); rebuilding its outputs from remembered metadata costs
a few.  The cache maps a *key* -- the op, every input's metadata, every
non-tensor argument, the logical device of the outputs, the mode's device
and the rule registry's version -- to a *recipe* for the outputs.

Note [What the key must hold]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The cache may make a call faster; it may never change its answer.  So the
key holds everything that can change the answer, or the call is not cached:

* each tensor argument's shape, strides, storage offset, dtype, logical
  device, conj/neg bits and ``requires_grad`` (attention backends look at
  it), and which tensor arguments share a storage (in-place overlap checks
  and view recipes depend on it);
* every non-tensor argument by value, the device arguments as resolved --
  also those that arrive as meta from C++ ``options()``
  (Note [Meta from options] in dispatch.py) -- and the logical device of
  the outputs;
* :func:`context`: what answers and under which global state -- the torch
  version, the rule registry's version (user and built-in rules), the mode's
  device, its GPU profile (``gpu=``: SDPA's backend differs by GPU), its
  known-value limit (a nested data-dependent call may be answered from a
  known value or raise), the default dtype (factories without a dtype), grad
  mode, inference mode and the autocast state, plus the global switches C++
  reads to choose a backend, for the ops whose rules ask it
  (``OpFacts.switches``: attention's scaled-dot-product switches and
  deterministic flags; convolution's oneDNN and NNPACK switches).

The entries are shared by every MetaMode in the process, as FakeTensorMode's
are, so tracing a model a second time (the next test, the next step) runs no
meta kernel at all; because the key holds all of the above, one mode is never
served what another computed differently.  Rules must be pure functions of
their arguments -- ``MetaMode(cache=False)`` for those that are not.  At most
:data:`LIMIT` entries and about :data:`LIMIT_BYTES` bytes of keys and recipes
are kept, the oldest dropped first: a key holds every non-tensor argument, so
one call with a long list (``cat`` of thousands of tensors, a shape list from
data) weighs as much as thousands of ordinary ones, and an entry count alone
would not bound the memory.  An entry heavier than an eighth of the byte
limit is not kept at all.  Note [What an entry weighs] says how the bytes
are counted and kept small.

Not cached at all: ops whose output depends on data (they raise, or are
answered by a real kernel under ``md.check``), ops that change their
argument's metadata in place (``resize_``, ``t_``; tag ``inplace_view``),
views that change dtype, calls with a ``torch.Generator`` argument or any
argument we cannot hash, calls whose answer was computed from a known value
(a rule or decomposition read it: ``value_reads()`` moved; calls on known
inputs that read none are cached as any other), calls with an output whose
conj or neg bit a recipe would not rebuild (Note [Conjugate and negative
bits]), and calls whose fresh outputs share a storage with each other.

Nothing in an entry belongs to the call that filled it: a recipe names its
inputs by position, its outputs' devices are a function of the key, and
plain values are immutable.

Note [Conjugate and negative bits]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``x.conj()`` on a complex tensor and ``torch._neg_view(x)`` on any tensor
return views with a bit set that no shape, stride or dtype shows, and that
views of them inherit.  A recipe rebuilds a fresh output with
``empty_strided``, which has no bit, and a view with ``as_strided`` of its
input, which has the input's: so a recipe is kept only where that gives the
output's own bits (``_neg_view(x)`` served from the cache came back without
its bit, and so did every view of it; ``x.mH.mH`` with its input's).  The bits of the inputs are in the key too: the
views of an input pass its bit on, and a rule may read it.  ``_tensor_key``
has them; a TensorMeta record does not, so ``key_from_encoded`` adds them
from the MetaTensors (two C calls per argument; nothing is added for the
many that have no bit).

Note [What an entry weighs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
An entry's bytes are what it alone keeps alive, as tracemalloc sees them
(``tests/core/test_cache_bounds.py`` compares the two): each tuple once, ints
beyond CPython's small-int cache, floats, strings other than names (kwarg
names and identifier-like literals are interned by CPython), and the dict
slot and value tuple that hold it -- not the op, dtype, device and type
objects that every entry shares.  ``sys.getsizeof`` summed over everything counted those
again and gave about 3 KB an entry where 1.1 KB were resident, so the byte
bound never bit.  Three things keep entries small, all on the miss path only
(a hit reads a key built as before):

* the context tuple (:func:`context`) is built afresh by every call; the one
  stored is shared by every entry with an equal context (``_CONTEXTS``);
* a recipe's shapes and strides are the key's own tuples where equal (an
  elementwise op's output has its input's shape and strides);
* an int argument is its own key part, where other values are tagged with
  their type: ``1``, ``1.0`` and ``True`` hash and compare equal, so a float
  or bool must carry its type, but no other part of a key equals an int.
  (Building the key also gets cheaper: no tuple per int.)

The weight is not stored: it is a function of the entry's objects, computed
again when the entry is evicted.
"""

from __future__ import annotations

import sys
import threading

import torch

from .. import _compat
from ..ir.records import PLAIN_TYPES
from ..ir.trace import TensorMeta
from ..tensor.tensor import MetaTensor
from . import registry
from .recipe import UNCACHABLE, build, recipe_of

__all__ = [
    "MetaCache",
    "UNCACHABLE",
    "clear",
    "context",
    "view_bits",
    "LIMIT",
    "LIMIT_BYTES",
    "cached_bytes",
    "entry_weight",
]

LIMIT = 16384  # entries in the shared cache, several hundred bytes each: ~150 per model
LIMIT_BYTES = 8 << 20  # what the entries keep alive (Note [What an entry weighs])
_SHARED: dict = {}  # key -> (recipe, stage), for every mode in the process
_TOTAL = [0]  # bytes of every entry in _SHARED
_CONTEXTS: dict = {}  # context tuple -> the one every stored key shares
_SLOT = 8 + 3 * 8 * 2 + sys.getsizeof((None, None))  # a dict slot (a table 1/3 to 2/3 full) and the value tuple
_STORE_LOCK = threading.Lock()
_HASHABLE = PLAIN_TYPES


_TORCH = torch.__version__


def _op_key(func):
    """A key's op: the overload's C++ handle, hashed in C (``OpOverload.__hash__`` is Python, per call)."""
    return getattr(func, "_op", func)


def context(mode, f) -> tuple:
    """What, besides the call's arguments, can change its answer (Note [What the key must hold])."""
    state: tuple = (
        _TORCH,
        registry._version[0],  # (registry.version() without its frame: read per call)
        mode.device,
        mode.device_profile,
        mode.known_limit,
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        _compat.autocast_state() if _compat.any_autocast() else None,
    )
    if f.switches is not None:
        state += f.switches()
    return state


def clear() -> None:
    """Forget every cached answer (the next call of each op runs its rule again)."""
    with _STORE_LOCK:
        _SHARED.clear()
        _CONTEXTS.clear()
        _TOTAL[0] = 0


def cached_bytes() -> int:
    """Bytes the shared entries keep alive now (Note [What an entry weighs])."""
    return _TOTAL[0]


class MetaCache:
    """One mode's view of the shared entries, with its own counters."""

    def __init__(self) -> None:
        self.entries = _SHARED
        self.hits = 0
        self.misses = 0
        self.bypasses = 0

    # -- keys
    @staticmethod
    def key(func, args, kwargs, device, ctx):
        """The key from the call's own arguments (MetaTensors)."""
        return _call_key(func, args, kwargs, device, ctx, _tensor_key)

    @staticmethod
    def key_from_encoded(func, enc_args, enc_kwargs, device, ctx, tensors):
        """The same key, from the TensorMeta records the recorder already made;
        ``tensors`` (the call's MetaTensors) for the bits a record lacks."""
        key = _call_key(func, enc_args, enc_kwargs, device, ctx, _meta_key)
        if key is not None:
            bits = view_bits(tensors)
            if bits:
                key += (bits,)
        return key

    # -- recipes
    def remember(self, key, f, tensors, result, stage) -> None:
        """``tensors``: the call's tensor arguments, in dispatch order."""
        self.store(key, recipe_of(f, tensors, result), stage)  # Note [Recipes] in recipe.py

    def store(self, key, recipe, stage) -> None:
        # Only misses get here; the lock keeps two tracing threads from
        # evicting at once (iterating a dict another thread resizes raises).
        with _STORE_LOCK:
            entries = self.entries
            if key in entries:  # two threads missed on the same key
                return
            key, recipe = _compact(key, recipe)
            weight = entry_weight(key, recipe)
            if weight > LIMIT_BYTES // 8:
                return
            while entries and (len(entries) >= LIMIT or _TOTAL[0] + weight > LIMIT_BYTES):
                old = next(iter(entries))  # dicts keep insertion order
                _TOTAL[0] -= entry_weight(old, entries.pop(old)[0])
            entries[key] = (recipe, stage)
            _TOTAL[0] += weight

    def replay(self, recipe, tensors, device):
        self.hits += 1
        if recipe[0] == "tuple":
            return tuple(build(r, tensors, device) for r in recipe[1])
        return build(recipe, tensors, device)


def _compact(key, recipe):
    """The key and recipe to store, sharing what they can (Note [What an entry weighs])."""
    ctx = key[2]
    shared = _CONTEXTS.get(ctx)
    if shared is None:
        if len(_CONTEXTS) >= 256:  # contexts come and go with registry versions
            _CONTEXTS.clear()
        _CONTEXTS[ctx] = shared = ctx
    if shared is not ctx:
        key = key[:2] + (shared,) + key[3:]
    if type(recipe) is tuple:
        pool: dict = {}
        _pool_ints(key, pool, 0)
        recipe = _shared_ints(recipe, pool, 0)
    return key, recipe


def _pool_ints(obj, pool: dict, depth: int) -> None:
    """Every tuple of ints inside ``obj`` (shapes and strides), by value."""
    if type(obj) is tuple and depth < 8:
        if obj and all(type(x) is int for x in obj):
            pool.setdefault(obj, obj)
        else:
            for x in obj:
                _pool_ints(x, pool, depth + 1)


def _shared_ints(obj, pool: dict, depth: int):
    """``obj`` with each tuple of ints replaced by the equal one in ``pool``."""
    if type(obj) is not tuple or depth >= 8 or not obj:
        return obj
    hit = pool.get(obj) if all(type(x) is int for x in obj) else None
    if hit is not None:
        return hit
    return tuple([_shared_ints(x, pool, depth + 1) for x in obj])


_SHARED_ATOMS = (type(None), bool, type, torch.dtype, torch.device, torch.layout, torch.memory_format)


def entry_weight(key, recipe) -> int:
    """What an entry alone keeps alive (Note [What an entry weighs])."""
    seen: set = {id(key[0]), id(key[2]), id(UNCACHABLE)}  # the op; the context, shared through _CONTEXTS
    return _SLOT + _weight(key, seen, 0) + _weight(recipe, seen, 0)


def _weight(obj, seen: set, depth: int) -> int:
    if id(obj) in seen or isinstance(obj, _SHARED_ATOMS):
        return 0
    if type(obj) is int and -5 <= obj <= 256:
        return 0  # CPython's small-int cache
    if type(obj) is str and obj.isidentifier():
        return 0  # a name or a literal from code (a kwarg, "mean", "fresh"): CPython interns those
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if type(obj) in (tuple, list) and depth < 32:
        size += sum(_weight(x, seen, depth + 1) for x in obj)
    return size


def _call_key(func, args, kwargs, device, ctx, tensor_key):
    storages: list = []  # one per tensor argument, in order: for the aliasing pattern
    parts = [_op_key(func), device, ctx]
    for a in args:
        k = _value_key(a, tensor_key, storages)
        if k is UNCACHABLE:
            return None
        parts.append(k)
    if kwargs:
        for name, v in kwargs.items():
            k = _value_key(v, tensor_key, storages)
            if k is UNCACHABLE:
                return None
            parts.append(name)
            parts.append(k)
    if len(storages) > 1 and len(set(storages)) < len(storages):
        first: dict = {}
        parts.append(("aliasing", tuple([first.setdefault(s, i) for i, s in enumerate(storages)])))
    return tuple(parts)


def _value_key(a, tensor_key, storages):
    t = type(a)
    if t is int:
        return a  # untagged: Note [What an entry weighs]
    if t in _PLAIN:  # most other arguments: floats, None, dtypes
        return (t, a)
    k = tensor_key(a, storages)
    if k is not None:
        return k
    if isinstance(a, _HASHABLE):
        return (t, a)
    if t is list or t is tuple:
        parts = []
        for x in a:
            k = _value_key(x, tensor_key, storages)
            if k is UNCACHABLE:
                return UNCACHABLE
            parts.append(k)
        return (t, tuple(parts))
    return UNCACHABLE


_PLAIN = frozenset(_HASHABLE)


def _tensor_key(a, storages):
    """A MetaTensor's metadata, or None for anything else."""
    if isinstance(a, MetaTensor):
        storages.append(_compat.storage_key(a))
        return (
            tuple(a.shape),
            a.stride(),
            a.storage_offset(),
            a.dtype,
            a._md.device,
            a.requires_grad,
            a.is_conj(),
            a.is_neg(),
        )
    return None


def _meta_key(a, storages):
    """A TensorMeta's metadata, or None for anything else."""
    if type(a) is TensorMeta:
        storages.append(a.storage)
        return a[1:7]  # shape, dtype, stride, offset, device, requires_grad
    return None


def view_bits(tensors):
    """The conj/neg bits of the tensor arguments, which no TensorMeta holds
    (Note [Conjugate and negative bits]); None when no argument has one."""
    marked = None
    for i, t in enumerate(tensors):
        if t.is_conj() or t.is_neg():
            marked = (marked or ("bits",)) + ((i, t.is_conj(), t.is_neg()),)
    return marked
