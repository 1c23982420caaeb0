"""FSDP2's chunks of a parameter: in a logical world, only the ones a rank reads.

Note [A rank's chunks, not the world's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``fully_shard`` shards a parameter by splitting it into one chunk per rank
(``_chunk_with_empty``: ``torch.chunk``, one ``aten.split`` with N views,
padded with empty tensors) and keeps two: this rank's, and chunk 0, whose
size is the padded shard's.  On a real rank N views cost nothing; traced,
each is a recorded tensor, and at world 1,024 LLaMA-7B's 291 parameters
make 300,000 of them -- about 12 s of one core for views nobody reads.

While a logical world is entered, ``_chunk_with_empty`` returns a sequence
whose chunk ``k`` is made when read, as ``narrow`` over the same extent
``torch.chunk`` gives it (``ceil(d / N)`` rows each, the last shorter),
and as FSDP's ``new_empty(0)`` past the end.  The trace then holds an
``aten.slice`` where a real run has one ``aten.split``: the same view
(shape, strides, offset, storage), no memory, so nothing ``md.memory``,
``md.comms`` or replay reads differs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import _compat

__all__ = ["PATCHES"]


class _Chunks(Sequence):
    """``_chunk_with_empty(tensor, n, dim)``, each chunk made when read."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int) -> None:
        self.tensor, self.n, self.dim = tensor, n, dim
        d = tensor.size(dim)
        self.size, self.step = d, -(-d // n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k):  # ints only: FSDP reads [rank] and [0]
        if not isinstance(k, int):
            raise TypeError(f"chunk index {k!r}: an int")
        if k < 0:
            k += self.n
        if not 0 <= k < self.n:
            raise IndexError(k)
        start = k * self.step
        if start < self.size:
            return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))
        return self[0].new_empty(0)


def _chunk_with_empty(original, tensor: torch.Tensor, num_chunks: int, dim: int):
    if tensor.size(dim) == 0:  # torch.chunk's own answer for an empty dimension
        return original(tensor, num_chunks, dim)
    return _Chunks(tensor, num_chunks, dim)


# (owner, attribute, make, why): the ledger's row (mode/ledger.py), with world.py's.
PATCHES = [
    (
        _compat.fsdp_param_module,
        "_chunk_with_empty",
        lambda below: functools.partial(_chunk_with_empty, below),
        "FSDP2's chunks, made lazily (Note [A rank's chunks, not the world's])",
    )
]
