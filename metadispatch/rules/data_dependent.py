"""Ops whose output shape depends on data only for some arguments.

Ops that always depend on data are found from torch's schema tags
(``dynamic_output_shape``, ``data_dependent_output``; see ``schema.py``).
``index.Tensor`` carries the tag but depends on data only when an index is a
boolean mask (``x[mask]``); integer indexing has a fine meta kernel.  A mask
with a known value (``x[:, [True, False, True]]``: a literal; Note [Known
values]) is answered as the CPU kernel does it, by replacing the mask with
the indices of its true elements; ``masked_select`` with a known mask
likewise, as many elements as the broadcast mask has true ones.  Integer
indices with a known value are checked against the indexed size (Note
[Known indices out of range]).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core.registry import builtin_rule
from ..tensor.describe import data_dependent_error
from ..tensor.tensor import read_value, wrap
from ..values import known

aten = torch.ops.aten
_CPU = torch.device("cpu")


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


# Note [Known indices out of range]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A meta kernel checks shapes, not index values: ``x[torch.tensor([0, 5])]``
# on a 3-row ``x`` was answered ``f32[2, ...]`` where every device raises
# IndexError -- a trace of a program nobody can run.  Where an integer index
# has a known value (a literal, a small tensor from the user's scope), it is
# checked as the CPU kernel checks it, with its message.  The read is counted
# (``read_value``), so the cache never answers such a call without the check.
def _check_range(op: str, index, size: int, dim: int, negative: bool = True) -> None:
    """``negative``: whether ``-size <= i < 0`` counts from the end (indexing
    does; ``index_select`` and ``embedding`` refuse it)."""
    if index is None or _is_mask(index) or index.numel() == 0:
        return
    value = read_value(index)
    if value is None:
        return
    with _compat.no_python_dispatch():  # the real value, outside every mode
        lo, hi = int(value.min()), int(value.max())
    bad = hi if hi >= size else lo if lo < (-size if negative else 0) else None
    if bad is not None:
        raise IndexError(f"{op}: index {bad} is out of bounds for dimension {dim} with size {size}")


@builtin_rule(aten.index.Tensor)
def index_tensor(self, indices, *, fallback):
    dim = 0
    for i in indices:
        if dim < self.dim():
            _check_range("aten.index.Tensor", i, self.shape[dim], dim)
        dim += i.dim() if _is_mask(i) else 1  # a mask spans as many dimensions as it has
    if any(_is_mask(i) for i in indices):
        expanded = _without_masks(indices)
        if expanded is None:
            raise data_dependent_error("aten.index.Tensor (boolean-mask indexing)", (self, indices), {})
        indices = expanded
    return fallback(self, indices)


@builtin_rule(aten.index_select.default)
def index_select(self, dim, index, *, fallback):
    d = dim % max(self.dim(), 1)
    _check_range("aten.index_select.default", index, self.shape[d] if self.dim() else 1, d, negative=False)
    return fallback(self, dim, index)


@builtin_rule(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, *, fallback):
    _check_range("aten.embedding.default", indices, weight.shape[0], 0, negative=False)
    return fallback(weight, indices, padding_idx, scale_grad_by_freq, sparse)


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


# Note [Packing with known lengths]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``pack_padded_sequence`` hands ``_pack_padded_sequence`` its lengths as a
# CPU int64 tensor, whose values decide the output's size (their sum) and
# the ``batch_sizes`` the RNN then walks.  torch's meta kernel read the
# stand-in's storage and refused "a 1D meta Long tensor" -- blaming the user's
# CPU tensor for a device it never had.  Lengths with a known value (a list,
# a literal, a tensor from the user's scope) are answered by the CPU kernel
# itself on an input of one element per step, so its checks (positive,
# sorted, one per sequence) and its ``batch_sizes`` are the real ones, known
# in turn; unknown lengths (``md.trace``'s arguments are data) are a
# DataDependentError naming them.  (What the RNN then does with the known
# ``batch_sizes``: Note [Packed sequences] in values/composites.py.)
@builtin_rule(aten._pack_padded_sequence.default)
def pack_padded_sequence(input, lengths, batch_first):
    value = read_value(lengths)  # counted: the cache keeps no answer read from a value
    if value is None:
        raise data_dependent_error(
            "aten._pack_padded_sequence.default (the values of `lengths`)", (input, lengths, batch_first), {}
        )
    steps, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
    with _compat.no_python_dispatch():  # the real kernel on a one-element payload: its checks, its batch_sizes
        probe = torch.zeros((steps, batch, 1))
        data, batch_sizes = aten._pack_padded_sequence.default(probe, value, False)
        sizes = wrap(torch.empty(batch_sizes.shape, dtype=torch.int64, device="meta"), _CPU)  # the CPU's, always
    known.know(sizes, batch_sizes, None)
    return input.new_empty((data.shape[0], *input.shape[2:])), sizes
