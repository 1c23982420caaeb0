"""Ops whose output shape depends on data only for some arguments.

Ops that always depend on data are found from torch's schema tags
(``dynamic_output_shape``, ``data_dependent_output``; see ``schema.py``).
``index.Tensor`` carries the tag but depends on data only when an index is a
boolean mask (``x[mask]``); integer indexing has a fine meta kernel.  A mask
with a known value (``x[:, [True, False, True]]``: a literal; Note [Known
values]) is answered as the CPU kernel does it, by replacing the mask with
the indices of its true elements; ``masked_select`` with a known mask
likewise, as many elements as the broadcast mask has true ones.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core.registry import builtin_rule
from ..core.router import data_dependent_error
from ..core.tensor import read_value

aten = torch.ops.aten


def _is_mask(i) -> bool:
    return i is not None and i.dtype in (torch.bool, torch.uint8)


def _without_masks(indices):
    """``indices`` with each known mask replaced by one long index per mask
    dimension (``expandTensors`` in ATen); None if a mask's value is unknown."""
    out = []
    for i in indices:
        if not _is_mask(i):
            out.append(i)
            continue
        value = read_value(i)  # counted: the cache keeps no answer read from a value
        if value is None:
            return None
        with _compat.no_python_dispatch():  # the real value, outside every mode
            n = int(value.count_nonzero())
        out.extend(i.new_empty((n,), dtype=torch.long) for _ in range(i.dim()))
    return out


@builtin_rule(aten.index.Tensor)
def index_tensor(self, indices, *, fallback):
    if any(_is_mask(i) for i in indices):
        expanded = _without_masks(indices)
        if expanded is None:
            raise data_dependent_error("aten.index.Tensor (boolean-mask indexing)", (self, indices), {})
        indices = expanded
    return fallback(self, indices)


@builtin_rule(aten.masked_select.default)
def masked_select(self, mask):
    torch._check(mask.dtype == torch.bool, lambda: "masked_select: expected BoolTensor for mask")
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    value = read_value(mask)  # counted, as above
    if value is None:
        raise data_dependent_error("aten.masked_select.default (the mask's values)", (self, mask), {})
    with _compat.no_python_dispatch():
        n = int(value.expand(shape).count_nonzero())
    return self.new_empty((n,))
