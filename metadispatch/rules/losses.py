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

import functools
import math

import torch

from ..core.registry import builtin_rule
from .storages import on_storage_of

aten = torch.ops.aten


def _reduced_loss(func, x, target, *args, fallback, **kwargs):
    weight = (args[0] if args else kwargs.get("weight")) if func is _BCE else None
    shape = _kernel_shape(func, x, target, weight)
    if func is _BCE and _broadcast(tuple(x.shape), tuple(target.shape)) != tuple(x.shape):
        target = x  # the squeezed output resized: the loss is still the input's shape
    out = fallback(x, target, *args, **kwargs)
    if x.device.type != "cpu":
        return out
    return on_storage_of(out, max(math.prod(shape), 1))


_BCE = aten.binary_cross_entropy.default
for _op in (aten.mse_loss.default, aten.smooth_l1_loss.default, _BCE, aten.soft_margin_loss.default):
    builtin_rule([_op])(functools.partial(_reduced_loss, _op))


# Note [The shapes a loss kernel refuses]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's meta kernels broadcast input and target; the kernels do not.
# ``soft_margin_loss`` computes ``neg(input).mul_(target)`` in place, so a
# target that broadcasts to more than the input's shape is refused;
# ``binary_cross_entropy`` iterates over the squeezed input and target into
# ``empty_like(input)`` squeezed (``[1, 4]`` with ``[3, 1]`` is refused;
# ``[1, 4]`` with ``[2, 4]`` resizes the squeezed output, with torch's
# deprecation warning, and returns ``[1, 4]``), then multiplies the loss by
# its weight in place.  Measured against eager CPU (tests/rules/test_losses.py);
# a CUDA kernel is built the same way.  Refused with RuntimeError, as torch
# does, naming the op and the shapes.
def _kernel_shape(func, x, target, weight) -> tuple:
    """The unreduced loss's element shape the kernel computes over, or RuntimeError where it refuses."""
    xs, ts = tuple(x.shape), tuple(target.shape)
    if func is _BCE:
        sq = (tuple(d for d in xs if d != 1), tuple(d for d in ts if d != 1))
        fits = _broadcast(*sq) is not None and (weight is None or _broadcast(xs, weight.shape) == xs)
        shape = _broadcast(*sq) if fits else None
    else:
        shape = _broadcast(xs, ts)
        fits = func is not aten.soft_margin_loss.default or shape == xs
    if fits and shape is not None:
        return shape
    w = f", weight {list(weight.shape)}" if weight is not None else ""
    raise RuntimeError(
        f"{func}: input {list(xs)} and target {list(ts)}{w} are shapes its kernel refuses, as eager does "
        "(Note [The shapes a loss kernel refuses] in rules/losses.py)"
    )


def _broadcast(a, b):
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None
