"""Activations whose kernels differ between devices in what they return.

``log_sigmoid_forward`` returns the output and a ``buffer`` for backward.
The CPU kernel makes both contiguous, the size of the input; CUDA's
(``log_sigmoid_forward_cuda``) keeps the input's layout for the output and
returns an empty buffer: it computes the gradient from the input alone.
torch's meta answer is neither (the input's layout, a full buffer), so a
logical GPU's ``F.logsigmoid`` (DPO-style losses) recorded and saved a
buffer the GPU never allocates, and a logical CPU's had the wrong strides
for a transposed input.
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule

aten = torch.ops.aten


@builtin_rule(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(x, *, fallback):
    if x.device.type == "cpu":
        return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(
            x.shape, dtype=x.dtype, device=x.device
        )
    out, buffer = fallback(x)
    if x.device.type != "cuda":
        return out, buffer
    return out, torch.empty((0,), dtype=x.dtype, device=x.device)
