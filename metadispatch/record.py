"""The recorder: turns dispatched calls into :class:`~metadispatch.trace.OpCall`.

Each MetaTensor that takes part in a trace carries ``_md = (recorder, meta)``:
the recorder that numbered it and its current :class:`TensorMeta`.  An input
without this recorder's token came from outside and becomes a named leaf.
Outputs get fresh ids; in-place outputs keep the id of the tensor they
mutated, with new metadata.  Storage numbers follow aliasing: a view shares
its base's storage number, a fresh output gets a new one.
"""

from __future__ import annotations

import torch

from . import _compat
from .source import user_frame
from .tensor import MetaTensor
from .trace import Leaf, OpCall, TensorMeta, Trace

__all__ = ["Recorder"]

_GENERATOR = "<generator>"


class Recorder:
    def __init__(self, trace: Trace, *, stack: bool = False, const_limit: int = 4096) -> None:
        self.trace = trace
        self.stack = stack
        self.const_limit = const_limit
        # Tensors carry ``_md = (recorder, meta)``: the recorder (and through
        # it the trace) that numbered them, e.g. so md.materialize can find
        # how a parameter was built.
        self.token = self
        self.modules = None  # a ModuleStack while a mode is entered
        self._next_id = 0
        self._next_storage = 0
        self._leaf_storages: dict = {}  # storage key -> number, for leaves
        self.real_of: dict = {}  # id(meta) -> real tensor, for constants

    # -- tensor metadata
    def _meta(self, t: torch.Tensor, tid: int, storage: int) -> TensorMeta:
        return TensorMeta(tid, tuple(t.shape), t.dtype, t.stride(), t.storage_offset(),
                          t._md_device, t.requires_grad, storage)

    def meta_of(self, t: MetaTensor) -> TensorMeta:
        """The current TensorMeta of an input, registering it as a leaf if new."""
        md = t.__dict__.get("_md")
        if md is not None and md[0] is self.token:
            m = md[1]
            if m.requires_grad != t.requires_grad:
                m = m._replace(requires_grad=t.requires_grad)
                t._md = (self.token, m)
            return m
        return self._leaf(t)

    def _leaf(self, t: MetaTensor) -> TensorMeta:
        key = _compat.storage_key(t)
        storage = self._leaf_storages.get(key)
        if storage is None:
            storage = self._leaf_storages[key] = self._new_storage()
        m = self._meta(t, self._new_id(), storage)
        t._md = (self.token, m)
        kind, name = t.__dict__.get("_md_name") or ("input", "")
        value = None
        real = self.real_of.get(id(t))
        if real is not None and kind == "input":
            kind = "const"
            if real.numel() <= self.const_limit:
                value = real.detach().clone()
        self.trace.leaves[m.id] = Leaf(m, kind, name, value)
        return m

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _new_storage(self) -> int:
        self._next_storage += 1
        return self._next_storage - 1

    # -- calls
    def encode(self, x):
        """Arguments with tensors replaced by their TensorMeta."""
        if isinstance(x, torch.Tensor):
            return self.meta_of(x)
        if type(x) in (list, tuple):
            return tuple(self.encode(y) for y in x)
        if isinstance(x, torch.Generator):
            return _GENERATOR
        return x

    def encode_inputs(self, args: tuple, kwargs: dict):
        enc_args = tuple(self.encode(a) for a in args)
        enc_kwargs = {k: self.encode(v) for k, v in kwargs.items()} if kwargs else None
        return enc_args, enc_kwargs

    def _out(self, o, f, enc_args, base_storage):
        if isinstance(o, torch.Tensor):
            md = o.__dict__.get("_md")
            if md is not None and md[0] is self.token:
                # In-place or out=: same object, same id, maybe new metadata.
                old = md[1]
                m = self._meta(o, old.id, old.storage)
            else:
                storage = base_storage if base_storage is not None else self._new_storage()
                m = self._meta(o, self._new_id(), storage)
            o._md = (self.token, m)
            return m
        if type(o) in (list, tuple):
            return tuple(self._out(x, f, enc_args, base_storage) for x in o)
        return o

    def record(self, func, f, pending, result, stage: str) -> OpCall:
        enc_args, enc_kwargs = pending
        base_storage = None
        if f.view_of is not None and f.view_of < len(enc_args):
            base = enc_args[f.view_of]
            base_storage = base.storage if isinstance(base, TensorMeta) else None
        if len(f.returns_write) == 1:
            outputs = (self._out(result, f, enc_args, base_storage),)
        elif f.returns_write:
            outputs = tuple(self._out(o, f, enc_args, base_storage) for o in result)
        else:
            outputs = ()
        module, phase, note = ("", "forward", None)
        if self.modules is not None:
            module = self.modules.current()
        if _compat.in_backward():
            phase = "backward"
            if _compat.in_checkpoint_recompute():
                note = "recompute"  # Note [Checkpoint recompute] in _compat
        source = user_frame() if self.stack else None
        call = OpCall(len(self.trace.calls), func, f.name, enc_args, enc_kwargs, outputs,
                      module, phase, stage, source, note)
        self.trace.calls.append(call)
        return call
