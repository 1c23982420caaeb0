"""A module or container as it was before the trace, put back by identity when it ends.

What a traced step stores on the user's module (an attribute, a cache, a
buffer registered in forward, a lazy module's new class) or in a container
it was handed is put back when ``md.trace`` ends (Note [Everything a forward
can change]); the stand-ins (standins.py) take a snapshot of each module
and container before the step first touches it.
"""

from __future__ import annotations

from operator import is_

import torch
from torch import nn

from ..tensor.state import state_of
from ..tensor.tensor import MetaTensor

__all__ = ["ModuleState", "Contents", "uninitialized"]


def uninitialized(t) -> bool:
    # A lazy module's parameter before its first forward: it changes its own
    # class when materialised, which ModuleState puts back.
    return isinstance(t, nn.parameter.UninitializedTensorMixin)


class ModuleState:
    """One module as it was: its class, its attributes, and the contents of
    the containers among them (``_parameters``, ``_buffers``, ``_modules``,
    hook tables, and lists or dicts forward may cache tensors in), plus each
    real tensor's own attributes (``param.sequence_parallel``) and a lazy
    parameter's class.

    Note [Everything a forward can change]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Under a trace, whatever a forward stores on its module is a MetaTensor:
    an anchor cache on a plain attribute (torchvision's detection models), a
    buffer registered in forward, a rotary table re-assigned when the
    sequence grows, ``self.train(False)`` or ``.to()`` inside the step.  Left
    there, the next real forward silently computes with MetaTensors.  So
    the whole attribute dictionary is put back, by identity, and every
    container in it is refilled in place with what it held.  The real
    tensors themselves are never written (Note [Swap above autograd]): a
    ``.grad`` is put back only where a MetaTensor took its place, and their
    version counters, which another thread's eager steps move meanwhile
    (Note [Other threads see the real model]), are left alone.
    """

    def __init__(self, mod, token=None) -> None:
        self.mod = mod
        self.cls = type(mod)
        # Shallow copies, one object each: this runs for every module of
        # every traced model at every md.trace, and a list of
        # (key, id, value) tuples per container cost more than the copy.
        self.attrs = dict(mod.__dict__)
        self.containers: list = []
        _snapshot(self.attrs.values(), self.containers, 0)
        reals, self.records = _foreign_records(self.containers, token)  # one pass for both
        self.tensors = [(t, t.grad, type(t), t.data if uninitialized(t) else None, dict(t.__dict__)) for t in reals]

    def restore(self) -> None:
        mod = self.mod
        if type(mod) is not self.cls:
            mod.__class__ = self.cls  # a lazy module becomes its cls_to_become
        attrs, saved = mod.__dict__, self.attrs
        # Most modules come back untouched: tested with C loops first (the
        # loops below ran ~30 opcodes per attribute of every module a trace reached).
        if not (
            len(attrs) == len(saved) and all(map(is_, attrs.values(), saved.values())) and all(map(is_, attrs, saved))
        ):
            for key in [k for k in attrs if k not in saved]:
                del attrs[key]
            for key, value in saved.items():
                if attrs.get(key, _MISSING) is not value:
                    attrs[key] = value
        for container, copy in self.containers:
            if not _same(container, copy):
                _refill(container, copy)
        for t, grad, cls, data, own in self.tensors:
            if type(t) is not cls:
                t.__class__ = cls
                t.data = data
            if isinstance(t.grad, MetaTensor):
                t.grad = grad
            if not _same(t.__dict__, own):
                _refill(t.__dict__, own)
        for t, grad, record in self.records:
            st = t._md
            st.recorder, st.meta, st.call, st.name = record
            if t.is_leaf and t.grad is not grad:
                t.grad = grad


def _foreign_records(containers, token) -> tuple[list, list]:
    """Note [A MetaTensor from an earlier mode keeps its record]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A module built under one MetaMode (alone, or with accelerate's
    ``init_empty_weights``) and then traced by another (``md.tracer``)
    reaches the second with MetaTensors numbered by the first.  The second
    numbers and names them as its own leaves (core/record.py), which
    overwrote their record: ``md.materialize`` afterwards looked for their
    construction in the step's trace and refused, the step's input being
    data it holds no value for; and the step's gradients stayed on them.  So
    the record and ``.grad`` of each MetaTensor the tracing mode did not
    number are saved with the module and put back with it, as a real
    tensor's ``.grad`` is; one the tracing mode numbered itself (built, then
    stepped, in one mode) keeps what the step made of it.
    """
    reals, records, seen = [], [], set()  # the real tensors too: ModuleState saves their .grad and attributes
    for _, copy in containers:
        for v in copy.values() if isinstance(copy, dict) else copy:
            if not isinstance(v, torch.Tensor) or id(v) in seen:
                continue
            seen.add(id(v))
            if not isinstance(v, MetaTensor):
                reals.append(v)
                continue
            st = v._md
            if st is not None and st.recorder is not token:
                records.append((v, v.grad if v.is_leaf else None, (st.recorder, st.meta, st.call, st.name)))
    return reals, records


_MISSING = object()


class Contents:
    """One container as it was (Note [The user's containers])."""

    def __init__(self, container) -> None:
        self.container = container
        self.copy = dict(container.items()) if isinstance(container, dict) else list(container)

    def restore(self) -> None:
        if not _same(self.container, self.copy):
            _refill(self.container, self.copy)


def _snapshot(values, out: list, depth: int) -> None:
    """Append ``(container, shallow copy)`` for the lists, dicts and sets in
    ``values``, and for those nested in them up to three levels down."""
    for v in values:
        t = type(v)
        if t is dict or t is list or t is set or isinstance(v, dict):
            if not v:
                # Nothing to copy or look into: most of a module's tables (a
                # dozen hook dicts each).  _same and _refill read () as empty.
                out.append((v, ()))
                continue
            copy: dict | list = dict(v.items()) if isinstance(v, dict) else list(v)
            out.append((v, copy))
            if depth < 3:
                _snapshot(copy.values() if isinstance(copy, dict) else copy, out, depth + 1)


def _same(c, copy) -> bool:
    # by identity: values compared with ``is``, not ``==`` (tensors)
    if len(c) != len(copy):
        return False
    if not copy:
        return True  # both empty (an empty table's copy is ())
    if isinstance(c, dict):  # values by identity, keys by identity or equality, in order
        return all(map(is_, c.values(), copy.values())) and (all(map(is_, c, copy)) or list(c) == list(copy))
    return all(map(is_, c, copy))


def _refill(c, copy) -> None:
    c.clear()
    if isinstance(c, list):
        c.extend(copy)
    else:
        c.update(copy)  # a dict from the dict copy, a set from the list


def made_in(root, token) -> bool:
    """Note [A module the step makes]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A module built inside the step (a head made per call, a copy the step
    discards) has nothing to put back: it did not exist before.  Holding it
    -- as a root, or in a ModuleState -- kept its tensors alive to the
    trace's end, and ``md.memory`` counted a weight eager had freed when the
    step dropped the module (4 MB over eager's peak for a ``Linear(1000,
    1000)`` made, called and deleted under ``no_grad``).  Such a module is
    held weakly, and its gradients are the trace's if it is alive at the end
    (tests/standins/test_made_in_step.py).  It is one whose every parameter
    and buffer (it has one) a call of the trace ``token`` records made.
    """
    found = False
    for t in (*root.parameters(), *root.buffers()):
        st = state_of(t)
        if st is None or st.recorder is not token or st.call is None:
            return False
        found = True
    return found
