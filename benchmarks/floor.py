"""The Python floor of a recording tracer: the cheapest one built as metadispatch is.

A ``_make_subclass`` of a meta tensor with CPU backend keys (``prim.device``
answered in Python, Meta in the TLS include set while a kernel runs), a dict
cache of output metadata, and a compact tuple recorded per call -- floor
"(e)" of ``../shared/perf/floors.py`` (issue 30), reduced to that one variant
so ``bench_trace.py`` can print it beside ``md.trace`` and FakeTensorMode in
every run.  It records less than a trace (no storage numbering, modules,
phases or deaths), so it bounds from below what ``md.trace`` can cost in
Python; ``md/floor`` is the gap.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

META = torch.device("meta")
CPU = torch.device("cpu")
PRIM_DEVICE = torch.ops.prim.device.default
_no_dispatch = torch._C._DisableTorchDispatch
_meta_inc = torch._C._meta_in_tls_dispatch_include
_set_meta_inc = torch._C._set_meta_in_tls_dispatch_include
_make_subclass = torch.Tensor._make_subclass
_IN_KERNEL = [False]


def _storage_key(t):
    return t.untyped_storage()._cdata


class FloorTensor(torch.Tensor):
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE:
            return META if _IN_KERNEL[0] else CPU
        raise RuntimeError(f"FloorTensor outside FloorMode: {func}")


def _wrap(t):
    return _make_subclass(FloorTensor, t, False, dispatch_device=True, device_for_backend_keys=CPU)


class FloorMode(TorchDispatchMode):
    """Cache and compact record (floor "(e)"); ``cache`` may be shared across modes."""

    def __init__(self, cache: dict | None = None) -> None:
        super().__init__()
        self.cache = {} if cache is None else cache
        self.trace: list = []
        self._ids: dict = {}

    @classmethod
    def _should_skip_dynamo(cls):
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE:
            return META if _IN_KERNEL[0] else CPU
        if kwargs and kwargs.get("device") is not None:
            kwargs = dict(kwargs, device=META)
        kwargs = kwargs or {}
        key = _key(func, args, kwargs)
        recipe = self.cache.get(key) if key is not None else None
        if recipe is not None:
            out = _build(recipe, args)
        else:
            out = self._run(func, args, kwargs)
            if key is not None:
                recipe = _recipe(out, args)
                if recipe is not None:
                    self.cache[key] = recipe
        self._record(func, args, kwargs, out)
        return out

    def _run(self, func, args, kwargs):
        _IN_KERNEL[0] = True
        prev = _meta_inc()
        _set_meta_inc(True)
        try:
            with _no_dispatch():
                out = func(*args, **kwargs)
        finally:
            _set_meta_inc(prev)
            _IN_KERNEL[0] = False
        return _wrap_out(out)

    def _record(self, func, args, kwargs, out):
        ids = self._ids
        enc = []
        for a in args:
            if isinstance(a, torch.Tensor):
                i = ids.get(id(a))
                if i is None:
                    i = ids[id(a)] = len(ids)
                enc.append(i)
            elif type(a) in (list, tuple):
                enc.append(tuple(ids.setdefault(id(x), len(ids)) if isinstance(x, torch.Tensor) else x for x in a))
            else:
                enc.append(a)
        oenc = []
        for o in out if type(out) in (tuple, list) else (out,):
            if isinstance(o, torch.Tensor):
                i = ids[id(o)] = len(ids)
                oenc.append((i, tuple(o.shape), o.dtype, o.stride()))
            else:
                oenc.append(o)
        self.trace.append((func, tuple(enc), kwargs or None, tuple(oenc)))


def _wrap_out(out):
    t = type(out)
    if t is torch.Tensor:
        return _wrap(out)
    if t is tuple or t is list:
        return t(_wrap_out(o) for o in out)
    return out


def _tensor_key(a):
    return (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.requires_grad)


def _key(func, args, kwargs):
    parts: list = [func]
    storages: list = []
    for a in args:
        t = type(a)
        if t is FloorTensor:
            storages.append(_storage_key(a))
            parts.append(_tensor_key(a))
        elif t is list or t is tuple:
            sub = []
            for x in a:
                if type(x) is FloorTensor:
                    storages.append(_storage_key(x))
                    sub.append(_tensor_key(x))
                elif isinstance(x, torch.Tensor):
                    return None
                else:
                    sub.append((type(x), x))
            parts.append(tuple(sub))
        elif isinstance(a, torch.Tensor):
            return None
        else:
            parts.append((t, a))
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            if type(v) is not FloorTensor:
                return None
            storages.append(_storage_key(v))
            v = _tensor_key(v)
        parts.append(k)
        parts.append((type(v), v))
    if len(storages) > 1 and len(set(storages)) < len(storages):
        first: dict = {}
        parts.append(tuple(first.setdefault(s, i) for i, s in enumerate(storages)))
    parts.append(torch.is_grad_enabled())
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _inputs(args):
    for a in args:
        if type(a) is FloorTensor:
            yield a
        elif type(a) in (list, tuple):
            for x in a:
                if type(x) is FloorTensor:
                    yield x


def _recipe_one(o, inputs):
    if type(o) is FloorTensor:
        for i, t in enumerate(inputs):
            if o is t:
                return ("same", i)
        sk = _storage_key(o)
        for i, t in enumerate(inputs):
            if _storage_key(t) == sk:
                return ("view", i, tuple(o.shape), o.stride(), o.storage_offset())
        return ("fresh", tuple(o.shape), o.stride(), o.storage_offset(), o.dtype)
    if isinstance(o, torch.Tensor):
        return None
    return ("value", o)


def _recipe(out, args):
    inputs = list(_inputs(args))
    if type(out) in (tuple, list):
        parts = tuple(_recipe_one(o, inputs) for o in out)
        return None if any(p is None for p in parts) else ("tuple", type(out), parts)
    return _recipe_one(out, inputs)


def _build_one(r, inputs):
    kind = r[0]
    if kind == "fresh":
        _, shape, stride, offset, dtype = r
        with _no_dispatch():
            e = torch.empty_strided(shape, stride, dtype=dtype, device=META)
            if offset:
                e = e.as_strided(shape, stride, offset)
        return _wrap(e)
    if kind == "view":
        _, i, shape, stride, offset = r
        _IN_KERNEL[0] = True
        prev = _meta_inc()
        _set_meta_inc(True)
        try:
            with _no_dispatch():
                e = torch.as_strided(inputs[i], shape, stride, offset)
        finally:
            _set_meta_inc(prev)
            _IN_KERNEL[0] = False
        return _wrap(e) if type(e) is torch.Tensor else e
    if kind == "same":
        return inputs[r[1]]
    return r[1]


def _build(recipe, args):
    inputs = list(_inputs(args))
    if recipe[0] == "tuple":
        return recipe[1](_build_one(r, inputs) for r in recipe[2])
    return _build_one(recipe, inputs)
