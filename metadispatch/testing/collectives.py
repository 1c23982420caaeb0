"""The collectives of a real distributed run, as ``md.comms`` lists a trace's.

Ground truth for traces made in a logical world: run the same code in a
real process group (``gloo`` on CPU) under :class:`CollectiveLog` and compare
its ``calls`` with ``md.comms(trace).calls`` -- same records, built by the
same function (``timing/comms.py``), so a difference is the trace's.
"""

from __future__ import annotations

import torch

from .. import _compat
from .._compat import pytree
from ..ir.records import Group
from ..spec.schema import schema_of
from ..tensor.tensor import is_wrapper_subclass
from ..timing.comms import COLLECTIVE_NAMESPACES, collective
from ..world import world

__all__ = ["CollectiveLog"]


class CollectiveLog(_compat.TorchDispatchMode):
    """Log every collective a real run calls, as :class:`md.comms` records.

    Module and phase are not known on a real run and are left empty; compare
    ``(op, kind, tensors, bytes)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_wrapper_subclass(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            return NotImplemented  # DTensor's dispatch runs next, with this mode on
        out = func(*args, **kwargs)
        if func.namespace in COLLECTIVE_NAMESPACES:
            self._log(func, args, kwargs, out)
        return out

    def _log(self, func, args, kwargs, out) -> None:
        schema = schema_of(func)
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
        inputs: list = []
        group = None
        ids: set = set()
        for a, v in zip(schema.arguments, values):
            if isinstance(v, torch.ScriptObject):
                described = world.describe(v)
                group = described if isinstance(described, Group) else group
            elif a.name == "group_name" and isinstance(v, str):
                group = world.group_named(v)
            else:
                ts = [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]
                ids.update(id(t) for t in ts)
                inputs.append((a.name, [(t.dtype, tuple(t.shape)) for t in ts]))
        fresh = [
            (t.dtype, tuple(t.shape))
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and id(t) not in ids
        ]
        c = collective(str(func), inputs, fresh, group, module="", phase="")
        if c is not None:
            self.calls.append(c)
