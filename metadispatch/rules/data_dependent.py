"""Ops whose output shape depends on data only for some arguments.

Ops that always depend on data are found from torch's schema tags
(``dynamic_output_shape``, ``data_dependent_output``; see ``schema.py``).
``index.Tensor`` carries the tag but depends on data only when an index is a
boolean mask (``x[mask]``); integer indexing has a fine meta kernel.
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule
from ..core.router import data_dependent_error

aten = torch.ops.aten


@builtin_rule(aten.index.Tensor)
def index_tensor(self, indices, *, fallback):
    if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        raise data_dependent_error("aten.index.Tensor (boolean-mask indexing)", (self, indices), {})
    return fallback(self, indices)
