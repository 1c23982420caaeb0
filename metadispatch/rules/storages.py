"""Outputs a CPU kernel leaves on storages larger than their shapes need.

Note [Storages larger than their tensors] in core/record.py says why the
allocator's size matters to ``md.memory``; a rule that knows the kernel
allocates more than it returns makes its output with :func:`on_storage_of`,
and the recorder notes the storage's bytes.
"""

from __future__ import annotations

import torch

__all__ = ["on_storage_of"]


def on_storage_of(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t``'s shape and strides on a fresh storage of ``elements`` elements (``t`` itself if it needs as many)."""
    if elements <= t.numel():
        return t
    return t.new_empty((elements,)).as_strided(t.shape, t.stride(), 0)
