"""Deferred initialisation: give a module built on meta its real weights.

Build a module under a recording :class:`~metadispatch.MetaMode` and every
construction op -- ``torch.empty``, ``normal_``, the arithmetic that computes
a rotary ``inv_freq`` -- is in the mode's trace, and every tensor it built
carries the id of its record in that trace.  ``md.materialize`` replays the
part of that trace the module's tensors depend on (``slicing.py``: the mode
may also have run a step on a real model) on a real device, starting the CPU
generator from the state it had when the mode was entered, and swaps each
MetaTensor the module holds for its real value: parameters, buffers, their ``.grad``, and tensors kept on plain
attributes (caches, tables), also inside lists, tuples and dicts.  So a
module built with seed *s* on meta equals, bit for bit, one built eagerly with
seed *s* -- non-persistent buffers included, which is where
``module.to_empty()`` leaves garbage.

Note [Materialise all or nothing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Materialising is the one documented effect on the user's module, so it must
be complete and must never invent data.  Before anything is replaced, every
MetaTensor reachable from the module is found (the walk of ``tracing/reach.py``,
as ``md.testing.snapshot`` does); it raises, naming each, when one sits
where it cannot be replaced (inside an object that is not a module, list,
tuple or dict), was not built under a recording mode (``md.to_meta``
copies hold no values), depends on data the trace did not keep (a real
tensor above the mode's ``const_limit`` copied in during construction, a
real step's input the module was trained on in the mode), or draws random
numbers after another model's random op the mode ran (Note [Slicing keeps
eager's random numbers] in ``slicing.py``).
Replay would otherwise fill such a leaf with made-up numbers.  The swap
itself is undone, by the inverse map, when anything (a ``KeyboardInterrupt``)
stops it part way.

Note [Materialise from a checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``checkpoint=path`` the state-dict entries the checkpoint holds are not
replayed: each is allocated empty (the module's dtype, shape and strides)
and filled by ``copy_`` from the checkpoint, one tensor at a time
(``checkpoint/stream.py``), in ``load_state_dict``'s order -- so casts, and a
tie the checkpoint stores twice (the last copy wins), come out as
``load_state_dict`` on an eagerly built module gives them.  Everything else
(non-persistent buffers, caches on attributes, and with ``strict=False`` the
missing entries) is replayed from the construction trace as before, so a
rotary ``inv_freq`` is what eager construction computes.  A module built on
plain ``meta`` has no trace: every meta tensor it holds must then come from
the checkpoint, or it raises naming the rest before anything is loaded.

Limits: bit-exactness needs the same kernels, so materialise on the CPU (a
CUDA generator draws different numbers).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..binding.leaves import bind_leaves
from ..checkpoint.stream import plan, stream
from ..errors import MetaDispatchError
from ..tensor.tensor import MetaTensor, normalize_device
from ..tracing.reach import walk
from .replay import execute
from .slicing import SliceError, slice_for

__all__ = ["materialize", "construct"]


def materialize(module: nn.Module, device="cpu", *, checkpoint=None, strict: bool = True) -> nn.Module:
    """Replace every MetaTensor ``module`` holds by its real value, in place.

    With ``checkpoint`` (a path ``md.checkpoint.inspect`` reads) the
    state-dict entries come from the checkpoint, streamed tensor by tensor,
    the rest from the construction trace (Note [Materialise from a
    checkpoint]); ``strict`` as in ``load_state_dict``.

    >>> import torch, metadispatch as md
    >>> _ = torch.manual_seed(0)
    >>> with md.MetaMode():
    ...     lin = torch.nn.Linear(3, 2)
    >>> md.materialize(lin).weight.device
    device(type='cpu')
    >>> _ = torch.manual_seed(0)
    >>> torch.equal(lin.weight, torch.nn.Linear(3, 2).weight)
    True
    """
    device = normalize_device(device)
    reachable = _reachable_metas(module)
    replaceable = {id(t) for t in _swap_all(module, lambda t: t)}
    stuck = [path for path, t in reachable.items() if id(t) not in replaceable]
    if stuck:
        raise MetaDispatchError(
            "materialize: MetaTensors held where materialize cannot replace them (only "
            "modules, lists, tuples and dicts are rewritten): " + ", ".join(stuck)
        )
    loads: list = []
    if checkpoint is None and (plain := list(_on_meta(module))):
        # accelerate's init_empty_weights, torch.device("meta"): no construction was recorded,
        # so leaving them on meta would return a module that fails at its first real call
        raise MetaDispatchError(
            f"materialize: {', '.join(plain[:8])} lie on 'meta': nothing says their values "
            f"({_WHY_META}; build the module under md.MetaMode alone to have them computed as eager "
            "construction does, or give checkpoint=PATH)"
        )
    if checkpoint is not None:
        contents, loads = plan(module, checkpoint, strict)
        loaded = {id(t) for _, t in loads}
        plain = [path for path, t in _on_meta(module).items() if id(t) not in loaded]
        if plain:
            raise MetaDispatchError(
                f"materialize: {', '.join(plain[:8])} lie on 'meta' and are not in {contents.path}: "
                f"nothing says their values ({_WHY_META}; build the module under md.MetaMode alone to "
                "have them computed as eager construction does)"
            )
        reachable = {path: t for path, t in reachable.items() if id(t) not in loaded}
    real = construct(reachable, device)  # id(MetaTensor) -> real tensor: tied tensors stay tied
    if loads:
        _load(loads, contents, real, device)
    # Note [Materialise all or nothing]: an interrupt part way through the
    # swap puts back what was swapped, by the inverse map.
    try:
        _swap_all(module, lambda t: real.get(id(t), t))
    except BaseException:
        metas = {id(t): t for t in reachable.values()} | {id(t): t for _, t in loads}
        back = {id(value): metas[i] for i, value in real.items()}
        _swap_all(module, lambda t: back.get(id(t), t))
        raise
    return module


def construct(reachable: dict, device) -> dict:
    """id(MetaTensor) -> its real value, for ``reachable`` (path -> MetaTensor), replaying only what built them."""
    device = normalize_device(device)
    names = {id(t): path for path, t in reachable.items()}
    real: dict = {}
    for rec, metas in _by_recorder(reachable, names).items():
        try:  # only what built these tensors: the mode may have run other work
            trace = slice_for(rec.trace, [t._md.meta for t in metas])
        except SliceError as e:
            raise MetaDispatchError(f"materialize: cannot replay what built {names[id(metas[0])]}: {e}") from None
        _refuse_outside_data(trace, metas, names)
        env, _, _ = execute(
            trace, lambda trace=trace: bind_leaves(trace, (), None, None, device, 0), device, check=False, keep_all=True
        )
        for t in metas:
            value = env[t._md.meta.id]
            real[id(t)] = (
                nn.Parameter(value, requires_grad=t.requires_grad)
                if isinstance(t, nn.Parameter) or getattr(t, "_is_param", False)
                else value
            )
    return real


def _load(loads: list, contents, real: dict, device) -> None:
    """Fill ``real`` from the checkpoint (Note [Materialise from a checkpoint])."""
    targets = dict(loads)
    for name, value in stream(contents, [n for n, _ in loads]):
        t = targets[name]
        dest = real.get(id(t))
        if dest is None:
            dest = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if isinstance(t, nn.Parameter) or getattr(t, "_is_param", False):
                dest = nn.Parameter(dest, requires_grad=t.requires_grad)
            real[id(t)] = dest
        with torch.no_grad():
            dest.copy_(value)
        del value  # one checkpoint tensor at a time


_WHY_META = "built on the meta device, or moved there while built, as accelerate's init_empty_weights does"


def _on_meta(module: nn.Module) -> dict:
    """path -> tensor on ``meta`` among the module's parameters and buffers.

    A plain meta tensor (``torch.device("meta")``) has no construction to
    replay; a MetaTensor whose logical device is meta was moved there while
    built (``init_empty_weights`` under a MetaMode): replaying its record
    gives what eager gives, a tensor on meta, with the initialiser's values
    thrown away.  Either must come from the checkpoint.
    """
    found: dict = {}
    for kind in (module.named_parameters, module.named_buffers):
        for path, t in kind(remove_duplicate=False):
            if t.is_meta:  # a MetaTensor answers for its logical device
                found.setdefault(path, t)
    return found


def _reachable_metas(module: nn.Module) -> dict:
    """path -> MetaTensor, for each MetaTensor reachable from ``module`` (first path only)."""
    # Tensors reached only through a function (its globals, closure,
    # defaults) are not the module's to hold: another model in a global.
    return {
        _attribute_path(path): obj
        for path, obj, first in walk({"module": module})
        if first is None and isinstance(obj, MetaTensor) and not _through_function(path)
    }


def _attribute_path(path: str) -> str:
    """``module._modules['fc']._parameters['weight']`` -> ``fc.weight``."""
    path = re.sub(r"\._(?:parameters|buffers|modules)\['([^']*)'\]", r".\1", path)
    return path.removeprefix("module.") if path != "module" else path


def _through_function(path: str) -> bool:
    return any(
        s in path
        for s in (".<global ", ".<closure ", ".__defaults__", ".__kwdefaults__", ".__func__", ".func", ".keywords")
    )


def _by_recorder(reachable: dict, names: dict) -> dict:
    groups: dict = {}
    for t in reachable.values():
        rec = t._md.recorder
        if rec is None or rec.trace is None:
            raise MetaDispatchError(
                f"materialize: {names[id(t)]} was not built under a recording MetaMode, so "
                "there is no construction to replay (md.to_meta copies hold no values; use "
                "load_state_dict instead)"
            )
        groups.setdefault(rec, []).append(t)
    return groups


def _refuse_outside_data(trace, metas, names) -> None:
    """Raise if the mode's trace read tensors it holds no values for."""
    outside = [leaf for leaf in trace.leaves.values() if leaf.value is None]
    if outside:
        what = ", ".join(f"${leaf.meta.id}: {leaf.meta.type_str()} {leaf.describe()}" for leaf in outside[:8])
        raise MetaDispatchError(
            f"materialize: {names[id(metas[0])]} (or another of the module's tensors) was "
            f"computed from real tensors from outside its mode that the trace keeps no values "
            f"for ({what}): a real module's parameters and buffers, the arguments of a step "
            "run on it in the mode, or constants larger than the mode's const_limit. Replaying "
            "would fill them with made-up numbers. Raise MetaMode(const_limit=...), or load "
            "them with load_state_dict after materialising"
        )


# -- finding and replacing every tensor a module holds


def _swap_all(module: nn.Module, new) -> list:
    """Replace each tensor ``t`` in ``module``'s modules by ``new(t)``; return the MetaTensors met.

    With ``new`` the identity this only lists what would be replaced.
    """
    met: list = []
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                table[key] = _swap(t, new, met, 0)
        for key, v in list(vars(mod).items()):
            if key not in ("_parameters", "_buffers", "_modules"):
                swapped = _swap(v, new, met, 0)
                if swapped is not v:
                    object.__setattr__(mod, key, swapped)
    return met


def _swap(v, new, met: list, depth: int):
    if isinstance(v, MetaTensor):
        met.append(v)
        grad, out = _meta_grad(v), new(v)
        if grad is not None:
            met.append(grad)
            real_grad = new(grad)
            if out is not v:
                out.grad = real_grad
        return out
    if isinstance(v, torch.Tensor):  # a real tensor: only the undo of an interrupted swap maps these
        return new(v)
    if depth > 16:
        return v
    if isinstance(v, list):
        for i, x in enumerate(v):
            v[i] = _swap(x, new, met, depth + 1)
        return v
    if isinstance(v, dict):
        for k, x in list(v.items()):
            v[k] = _swap(x, new, met, depth + 1)
        return v
    if isinstance(v, tuple) and not hasattr(v, "__dict__"):
        items = [_swap(x, new, met, depth + 1) for x in v]
        if all(a is b for a, b in zip(items, v)):
            return v
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    return v


def _meta_grad(t: MetaTensor):
    g = t.grad if t.is_leaf else None
    return g if isinstance(g, MetaTensor) else None
