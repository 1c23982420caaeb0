"""Embedding bags on the CPU: the auxiliary outputs its kernel returns, on the storages it allocates.

Note [Embedding-bag storages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``_embedding_bag``'s CPU kernel (``make_offset2bag_out`` in
``EmbeddingBag.cpp``) resizes ``offset2bag`` to one element more than there
are indices, fills it, and resizes it back: the tensor it returns has
``len(indices)`` elements on a storage of ``len(indices) + 1``.  Its
``bag_size`` is allocated like ``offsets`` (``make_bag_size_out``) and, where
the bag sizes are computed, resized to the number of bags: one fewer with
``include_last_offset``.  torch's meta function returns tensors exactly as
large as their shapes, so ``md.memory`` was 8 bytes short of the real run on
``nn.EmbeddingBag`` (docs/model-conformance.md); for
``_embedding_bag_forward_only`` (a bag without gradients) it also differs in
shape, where the sizes are computed by mode and by the fast path, which on
the CPU takes bfloat16 too.  So on a logical CPU the auxiliary outputs are
made here as ``_embedding_bag_cpu_impl`` makes them, each piece named by the
C++ function it follows, on the storages the kernel leaves them on (Note
[Storages larger than their tensors] in core/record.py); other devices keep
torch's meta answer, asked for their device (Note [Device-hinted meta
kernels] in device_hinted.py).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core.registry import builtin_rule
from .storages import on_storage_of

aten = torch.ops.aten

_SUM, _MEAN, _MAX = 0, 1, 2
_FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fast_sum(weight, per_sample_weights, output, padding_idx) -> bool:
    """``is_fast_path`` in EmbeddingBag.cpp: the sum mode then computes no ``offset2bag``."""
    index_select = weight.dtype in _FAST_DTYPES and weight.stride(1) == 1 and output.stride(1) == 1 and padding_idx < 0
    return index_select and (per_sample_weights is None or per_sample_weights.stride(0) == 1)


def _cpu(out, weight, indices, offsets, args, forward_only: bool):
    """The auxiliary outputs ``_embedding_bag_cpu_impl`` returns, on the storages it allocates.

    torch's meta function differs from the CPU kernel for
    ``_embedding_bag_forward_only`` beyond the storages: it takes bfloat16
    off the fast path, and its ``bag_size``/``max_indices`` follow the grad
    op's in the mean and max modes, and with ``include_last_offset`` in the
    sum mode.
    """
    mode, per_sample_weights, last, padding_idx = _options(args)
    output = out[0]
    if mode == _SUM and _fast_sum(weight, per_sample_weights, output, padding_idx):
        offset2bag = offsets.new_empty((0,))
    else:  # make_offset2bag_out: sized len(indices) + 1, filled, resized back
        offset2bag = on_storage_of(offsets.new_empty((indices.shape[0],)), indices.shape[0] + 1)
    # make_bag_size_out: allocated like offsets, resized to the bags where
    # the sizes are computed (always on the grad op)
    bags = offsets.shape[0] - (1 if last else 0)
    if not forward_only or mode in (_MEAN, _MAX):
        bag_size = on_storage_of(offsets.new_empty((bags,)), offsets.shape[0])
    else:
        bag_size = offsets.new_empty(offsets.shape)
    # make_max_indices_out
    max_indices = offsets.new_empty((bags, weight.shape[1]) if mode == _MAX else bag_size.shape)
    return output, offset2bag, bag_size, max_indices


def _options(args) -> tuple:
    """``mode``, ``per_sample_weights``, ``include_last_offset``, ``padding_idx`` from the arguments after ``offsets``."""
    # scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset, padding_idx
    defaults = (False, 0, False, None, False, -1)
    full = tuple(args) + defaults[len(args) :]
    return full[1], full[3], full[4], full[5]


def _rule(op, meta_fn, forward_only: bool):
    def rule(weight, indices, offsets, *args):
        # torch's meta function, asked for the logical device (Note
        # [Device-hinted meta kernels] in device_hinted.py): CPU's auxiliary
        # outputs differ from CUDA's.
        out = meta_fn(weight, indices, offsets, *args)
        return out if weight.device.type != "cpu" else _cpu(out, weight, indices, offsets, args, forward_only)

    rule.__name__ = rule.__qualname__ = f"embedding_bag_{op.name().partition('::')[2]}"
    return rule


for _op, _forward_only in ((aten._embedding_bag.default, False), (aten._embedding_bag_forward_only.default, True)):
    _fn = _compat.python_meta_kernel(_op)
    if _fn is not None:  # (a later torch may drop it: the native stage answers)
        builtin_rule(_op)(_rule(_op, _fn, _forward_only))
