"""``torch._scaled_mm`` (float8 matmul) on a logical GPU: accepted where that SM runs it.

CUDA's kernel (``_scaled_mm_out_cuda`` in Blas.cpp) first checks
``_scaled_mm_allowed_device()``: compute capability 9.0 or newer, or exactly
8.9 (Ada: L4, L40).  torch's meta kernel knows no device, so a logical A100
traced a float8 matmul its GPU refuses -- a plan for fp8 training on a card
without fp8.  On a logical GPU the rule asks the profile first, with the
kernel's words; the output is torch's meta answer.  Other devices keep
torch's meta kernel.
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule
from ..mode.mode import active_profile

aten = torch.ops.aten


@builtin_rule(aten._scaled_mm.default)
def scaled_mm(mat_a, mat_b, *args, fallback, **kwargs):
    if mat_a.device.type == "cuda":
        major, minor = active_profile().compute_capability
        torch._check(
            major >= 9 or (major, minor) == (8, 9),
            lambda: (
                "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, "
                f"or ROCm MI300+ (the logical GPU is sm{major}{minor}: {active_profile().name})"
            ),
        )
    return fallback(mat_a, mat_b, *args, **kwargs)
