"""A cache entry's recipe: how to rebuild a call's outputs from its inputs without its rule.

Note [Recipes]
~~~~~~~~~~~~~~
Per output: a fresh tensor (``empty_strided`` on meta, or on a storage of
the recorded size where the answer's storage was larger than its extent), a
view of input ``i`` (``as_strided`` on that input's storage, so storage
sharing and offsets are exact), the very input object ``i`` (in-place,
``out=``, ``lift_fresh``), or a plain value (``_fused_sdp_choice`` returns an
int).  Fresh tensors and views record their logical device where the answer
put them somewhere other than the call's device (a rule returning a CPU
seed for a CUDA call).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..ir.records import PLAIN_TYPES
from ..tensor.tensor import META, MetaTensor, wrap

__all__ = ["UNCACHABLE", "recipe_of", "build"]

UNCACHABLE = object()  # a call whose answer no recipe can rebuild
_HASHABLE = PLAIN_TYPES


def recipe_of(f, inputs, result):
    """How to rebuild ``f``'s answer ``result`` from the call's tensor ``inputs`` (Note [Recipes]), or UNCACHABLE."""
    fresh: list = []  # storages of the fresh outputs so far
    if len(f.returns_write) == 1:
        return _recipe_one(result, inputs, fresh)
    if not f.returns_write:
        return ("value", result)
    parts = tuple(_recipe_one(r, inputs, fresh) for r in result)
    if any(p is UNCACHABLE for p in parts):
        return UNCACHABLE
    return ("tuple", parts)


def _storage_key(t):
    """``_compat.storage_key``, or None for a tensor with no storage (sparse).
    (Caught, not asked: ``t.layout`` on a MetaTensor is a torch-function call.)"""
    try:
        return _compat.storage_key(t)
    except NotImplementedError:
        return None


def _recipe_one(out, inputs, fresh):
    if isinstance(out, torch.Tensor):
        for i, t in enumerate(inputs):
            if out is t:
                return ("same", i)
        key = _storage_key(out)
        if key is None:
            return UNCACHABLE  # a sparse result has no storage to rebuild it from
        bits = (out.is_conj(), out.is_neg())
        # None: the call's device (a native kernel's plain meta output).
        device = out._md.device if isinstance(out, MetaTensor) else None
        meta = (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype, device)
        for i, t in enumerate(inputs):
            if _storage_key(t) == key:
                if t.dtype != out.dtype or bits != (t.is_conj(), t.is_neg()):
                    return UNCACHABLE  # Note [Conjugate and negative bits] in cache.py
                return ("view", i) + meta
        if bits != (False, False):
            return UNCACHABLE  # Note [Conjugate and negative bits] in cache.py
        if key in fresh:
            return UNCACHABLE  # two outputs sharing a new storage: rare, and not worth a recipe
        fresh.append(key)
        nbytes = out.untyped_storage().nbytes()
        return ("fresh",) + meta + (None if nbytes == _strided_nbytes(out) else nbytes,)
    if type(out) in (list, tuple):
        parts = tuple(_recipe_one(o, inputs, fresh) for o in out)
        if any(p is UNCACHABLE for p in parts):
            return UNCACHABLE
        return ("list", type(out), parts)
    if isinstance(out, _HASHABLE):
        return ("value", out)
    return UNCACHABLE


def _strided_nbytes(t) -> int:
    """The storage ``empty_strided`` gives a tensor of ``t``'s shape and strides."""
    if 0 in t.shape:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()


def build(recipe, inputs, device):
    """The outputs ``recipe`` describes, made afresh for a call on ``inputs`` (Note [Recipes])."""
    kind = recipe[0]
    if kind == "fresh":
        # No mode is on the stack while a dispatch handler runs, and no
        # MetaTensor is involved: a plain meta factory call.
        _, shape, stride, offset, dtype, where, nbytes = recipe
        if nbytes is None:
            elem = torch.empty_strided(shape, stride, dtype=dtype, device=META)
            if offset:
                elem = elem.as_strided(shape, stride, offset)
        else:
            elem = torch.empty(0, dtype=dtype, device=META)
            elem.set_(torch.UntypedStorage(nbytes, device=META), offset, shape, stride)
        return wrap(elem, where or device)
    if kind == "view":
        _, i, shape, stride, offset, dtype, where = recipe
        with _compat.no_python_dispatch():  # the base is a MetaTensor
            elem = torch.as_strided(inputs[i], shape, stride, offset)
        return wrap(elem, where or device)
    if kind == "same":
        return inputs[recipe[1]]
    if kind == "list":
        return recipe[1](build(r, inputs, device) for r in recipe[2])
    return recipe[1]
