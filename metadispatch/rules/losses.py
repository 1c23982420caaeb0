"""Pointwise losses whose CPU kernels reduce on the storage of the unreduced loss.

Note [Reduced losses keep the loss's storage]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``mse_loss``, ``smooth_l1_loss``, ``binary_cross_entropy`` and
``soft_margin_loss`` with ``reduction="mean"`` or ``"sum"`` return a 0-d
tensor whose storage, on the CPU, is the unreduced loss's: one element of
the result dtype per element of the broadcast input and target (at least
one).  ``F.mse_loss`` of a ``[6, 4]`` float batch returns 4 bytes on a
96-byte storage, live for as long as the loss is (measured with
``untyped_storage().nbytes()`` on torch 2.13 and 2.14; ``l1_loss``,
``huber_loss``, ``nll_loss`` and ``binary_cross_entropy_with_logits`` give
4 bytes and are not listed).  torch's meta kernel returns exactly 4 bytes,
so ``md.memory`` of every step with such a loss was short by the loss's size
less 4 (92 B per batch in the zoo's ``nn.dataloader_epoch``,
docs/model-conformance.md).  On a logical CPU the output is made on the
storage the kernel leaves it on (Note [Storages larger than their tensors]
in core/record.py); other devices keep torch's answer, not measured.
"""

from __future__ import annotations

import math

import torch

from ..core.registry import builtin_rule
from .storages import on_storage_of

aten = torch.ops.aten


@builtin_rule(
    [
        aten.mse_loss.default,
        aten.smooth_l1_loss.default,
        aten.binary_cross_entropy.default,
        aten.soft_margin_loss.default,
    ]
)
def reduced_loss(x, target, *args, fallback, **kwargs):
    out = fallback(x, target, *args, **kwargs)
    if x.device.type != "cpu":
        return out
    return on_storage_of(out, max(math.prod(torch.broadcast_shapes(x.shape, target.shape)), 1))
