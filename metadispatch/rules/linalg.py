"""Linear-algebra ops with no meta kernel.

``geqrf``: ``a`` holds R and the Householder vectors in LAPACK's
column-major (Fortran) layout and ``tau`` the scalar factors, one per
reflector.  The layout is set by ``geqrf_out`` in ATen's device-generic
code (``resize_as_(input.mT())`` then ``transpose_``), so every device
gets the same answer.
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule

aten = torch.ops.aten


@builtin_rule(aten.geqrf.default)
def geqrf(x):
    torch._check(x.dim() >= 2, lambda: "torch.geqrf: input must have at least 2 dimensions.")
    torch._check(
        x.is_floating_point() or x.is_complex(),
        lambda: f"torch.geqrf: Expected a floating point or complex tensor as input. Got {x.dtype}",
    )
    m, n = x.shape[-2:]
    strides, step = [1, max(m, 1)], max(m, 1) * max(n, 1)  # column-major matrices
    for size in reversed(x.shape[:-2]):
        strides.insert(0, step)
        step *= max(size, 1)
    a = x.new_empty_strided(x.shape, strides)
    tau = x.new_empty(x.shape[:-2] + (min(m, n),))
    return a, tau
