"""Indexing ops whose meta kernel gives other strides than the CPU kernel.

``nonzero_static``: the meta kernel returns a column-major ``(size, ndim)``
tensor (CUDA's layout); the CPU kernel returns it row-major.
"""

from __future__ import annotations

import torch

from ..registry import builtin_rule

aten = torch.ops.aten


@builtin_rule(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1, fallback):
    out = fallback(x, size=size, fill_value=fill_value)
    if x.device.type == "cpu":
        return torch.empty(out.shape, dtype=out.dtype, device=x.device)
    return out
