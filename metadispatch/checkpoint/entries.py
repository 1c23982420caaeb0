"""What a checkpoint holds, as records: one :class:`Entry` per tensor, one :class:`Contents` per checkpoint.

The readers (``safetensors_file.py``, ``torch_zip.py``, ``index.py``) build
these from the files' headers alone; nothing here reads tensor data.
:func:`refuse` is the one way a reader names a fault: the file and the
entry, in a :class:`~metadispatch.errors.CheckpointFormatError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from ..errors import CheckpointFormatError

__all__ = ["Entry", "Contents", "refuse", "byte_size", "MAX_HEADER"]

# An untrusted header is read into memory whole: safetensors itself refuses
# headers above 100 MB, and a 70B model's pickle is ~100 KB.
MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: its name, shape, dtype and bytes, and where it lies.

    ``storage`` names the bytes it views (a ``torch.save`` storage key, or the
    safetensors byte range): two entries with the same ``storage``,
    ``offset`` and ``stride`` are one tensor stored once.  ``offset`` is in
    elements for ``torch.save`` and in bytes for safetensors.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    stride: tuple[int, ...]
    offset: int
    storage: str
    storage_nbytes: int

    @property
    def nbytes(self) -> int:
        """The tensor's own bytes (numel x element size), not its storage's."""
        return math.prod(self.shape) * self.dtype.itemsize

    def same_data(self, other: Entry) -> bool:
        """Whether ``other`` is this tensor stored once under another name."""
        key = (self.file, self.storage, self.offset, self.stride, self.shape, self.dtype)
        return key == (other.file, other.storage, other.offset, other.stride, other.shape, other.dtype)


@dataclass(frozen=True)
class Contents:
    """The tensors of a checkpoint, by name (``md.checkpoint.inspect``'s answer).

    ``format`` is ``"safetensors"`` or ``"torch"``; ``files`` the files read
    (one, or an index's shards); ``metadata`` the safetensors
    ``__metadata__`` strings (merged over shards) or an index's ``metadata``.
    """

    path: str
    format: str
    tensors: dict[str, Entry]
    files: tuple[str, ...]
    metadata: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data, each storage counted once."""
        return sum({(e.file, e.storage): e.storage_nbytes for e in self.tensors.values()}.values())

    def lines(self) -> list[str]:
        """One line per tensor: ``name: torch.bfloat16[4096, 4096] 33554432 bytes (file)``."""
        return [f"{e.name}: {e.dtype}{list(e.shape)} {e.nbytes} bytes ({e.file})" for e in self.tensors.values()]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def byte_size(path: str, entry: str, shape, dtype: torch.dtype) -> int:
    """numel x itemsize, refusing shapes that are not lists of non-negative ints."""
    if not isinstance(shape, (list, tuple)) or len(shape) > 64:
        refuse(path, entry, f"shape {shape!r} is not a list of at most 64 sizes")
    if not all(type(d) is int and 0 <= d < 2**63 for d in shape):
        refuse(path, entry, f"shape {list(shape)!r} holds something other than non-negative ints")
    return math.prod(shape) * dtype.itemsize


def refuse(path: str, entry: str, why: str) -> NoReturn:
    """Raise the typed error for a bad checkpoint, naming the file and the entry."""
    where = f"{path}: {entry!r}: " if entry else f"{path}: "
    raise CheckpointFormatError(f"checkpoint {where}{why}", path=path, entry=entry)
