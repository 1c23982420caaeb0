"""Activations whose kernels differ between devices in what they return.

``log_sigmoid_forward`` returns the output and a ``buffer`` for backward.
The CPU kernel fills a buffer the size of the input; CUDA's
(``log_sigmoid_forward_cuda`` in Activation.cu) computes the gradient from
the input alone and returns an empty one.  torch's meta answer is the
CPU's, so a logical GPU's ``F.logsigmoid`` (DPO-style losses, ``F.silu``-free
gates) recorded and saved a buffer the GPU never allocates.
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule

aten = torch.ops.aten


@builtin_rule(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(x, *, fallback):
    out, buffer = fallback(x)
    if x.device.type != "cuda":
        return out, buffer
    return out, torch.empty((0,), dtype=x.dtype, device=x.device)
