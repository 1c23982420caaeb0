"""C++ composites that read the C++ device, overridden while a MetaMode is entered.

Note [Composite overrides]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``CompositeImplicitAutograd`` op (``tensor_split`` with a tensor of
indices) runs its C++ body above the Python dispatch key, so no rule can
see it; only the ops it calls reach us.  When that body checks the C++
device it finds ``meta`` (Note [Logical device]) and fails where the real
device would not: ``tensor_split expected tensor_indices_or_sections to be
on cpu, but it's on meta``.

For such ops a Python kernel is registered at the ``AutogradMeta`` key, the
slot the composite fills for meta tensors, while at least one MetaMode is
entered (reference-counted, removed on the last exit, also on exceptions).
It answers for MetaTensors and hands anything else to the composite
(``OpOverload.decompose``).  Nothing is registered at import time.

Limits: MetaTensors used without a mode, and calls under
``torch.inference_mode()`` (which skips autograd keys; torch refuses a Meta
kernel for a composite), still run the C++ body.
"""

from __future__ import annotations

import threading

import torch

from . import _compat
from .router import data_dependent_error
from .tensor import MetaTensor

__all__ = ["acquire", "release"]

aten = torch.ops.aten


def _tensor_split(self, indices, dim=0):
    op = aten.tensor_split.tensor_indices_or_sections
    if not isinstance(indices, MetaTensor):
        return op.decompose(self, indices, dim)
    torch._check(indices.device.type == "cpu", lambda: (
        f"tensor_split expected tensor_indices_or_sections to be on cpu, but it's on {indices.device}"))
    torch._check(indices.dtype == torch.long, lambda: (
        f"tensor_split expected tensor_indices_or_sections to have dtype of long, "
        f"but got {indices.dtype}"))
    torch._check(indices.dim() in (0, 1), lambda: (
        f"tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
        f"one-dimensional tensor, but got a tensor with {indices.dim()} dims"))
    if indices.dim() == 0:
        return torch.tensor_split(self, indices.item(), dim)  # item() as in the C++ body
    from .known import value_of

    value = value_of(indices)  # Note [Known values]
    if value is None:
        raise data_dependent_error(f"{op} (tensor indices)", (self, indices), {})
    return torch.tensor_split(self, value.tolist(), dim)


OVERRIDES = {"tensor_split.tensor_indices_or_sections": _tensor_split}

_LOCK = threading.Lock()
_STATE = {"count": 0, "lib": None}


def acquire() -> None:
    """Register the overrides (first MetaMode entered)."""
    with _LOCK:
        if _STATE["count"] == 0:
            lib = _compat.library("aten", "IMPL")
            for name, fn in OVERRIDES.items():
                lib.impl(name, fn, "AutogradMeta")
            _STATE["lib"] = lib
        _STATE["count"] += 1


def release() -> None:
    """Remove them again (last MetaMode left)."""
    with _LOCK:
        _STATE["count"] -= 1
        if _STATE["count"] == 0:
            _STATE.pop("lib")._destroy()
            _STATE["lib"] = None
