"""FSDP2's storage frees, made visible to dispatch.

Note [FSDP frees by resizing storage]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FSDP2 keeps one tensor per unsharded parameter for the life of the module
and frees its memory after forward (``reshard_after_forward``) and after
backward by resizing its storage to 0 bytes, re-allocating it by resizing
it back before the next all-gather (``free_storage``/``alloc_storage`` in
``_fsdp_param.py``).  A storage resize is no aten call: neither a trace nor
``md.LiveStorages`` would see the memory come and go, and every unsharded
parameter would look live from its first all-gather to the end.  While a
logical world or ``LiveStorages`` is entered, the two functions resize
through ``inductor::resize_storage_bytes_`` -- the op torch.compile's FSDP
uses for the same thing, with the same effect -- so the resize is a call:
recorded with its tensor and size, and read by ``md.memory``.
"""

from __future__ import annotations

import torch

from .. import _compat

__all__ = ["PATCHES", "RESIZE_OP"]

RESIZE_OP = "inductor.resize_storage_bytes_.default"


def _alloc_storage(tensor: torch.Tensor) -> None:
    size = tensor.numel() * tensor.itemsize
    if tensor.untyped_storage().size() != size:
        _compat.resize_storage_bytes(tensor, size)


def _free_storage(tensor: torch.Tensor) -> None:
    if tensor.untyped_storage().size() != 0:
        _compat.resize_storage_bytes(tensor, 0)


# (owner, attribute, make, why): the ledger's rows (mode/ledger.py), with world.py's.
PATCHES = [
    (_compat.fsdp_param_module, "alloc_storage", lambda below: _alloc_storage, "FSDP2's storage resizes, dispatched"),
    (_compat.fsdp_param_module, "free_storage", lambda below: _free_storage, "FSDP2's storage frees, dispatched"),
]
