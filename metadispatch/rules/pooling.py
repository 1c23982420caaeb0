"""Pooling ops whose decomposition lays out the output unlike the CPU kernel.

``max_unpool2d`` has no meta kernel; torch's decomposition builds a
contiguous output.  The CPU kernel keeps its input's layout
(``resize_(..., self.suggest_memory_format())`` in ``MaxUnpooling.cpp``), so a
channels-last input gives a channels-last output.  Other devices keep the
decomposition's answer.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core.registry import builtin_rule

aten = torch.ops.aten


@builtin_rule(aten.max_unpool2d.default)
def max_unpool2d(x, indices, output_size, *, fallback):
    out = fallback(x, indices, output_size)
    if x.device.type == "cpu" and x.dim() == 4 and _compat.suggest_memory_format(x) == torch.channels_last:
        return torch.empty_like(out, memory_format=torch.channels_last)
    return out
