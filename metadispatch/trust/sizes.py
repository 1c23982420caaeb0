"""Output sizes replay must know before a call runs, where a meta kernel cannot say.

Note [Sizes known before running]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The budget runs each call of a file's trace on the ``meta`` device to learn
what its kernel will allocate (Note [Budgets] in budget.py).  Three kinds of
call escape that, and a file can aim each at the machine:

- *list returns*: ``unbind`` of a zero-stride tensor of 2**22 rows returns
  2**22 tensors, on meta as for real, before anything can compare them with
  the one the file recorded (6 s and 650 MB spent by the budget check
  itself).  :func:`list_count` works the number out from the arguments
  first, per op family; a call that would return more tensors than the
  trace records is refused, and an op returning a list this module does not
  know is refused too -- unless the list has one entry per entry of a list
  argument (``_foreach_*``, ``broadcast_tensors``), which the file bounds.
- *data-dependent sizes* bounded by what the call reads (``nonzero``,
  ``unique``, ``masked_select``): :func:`read_bound` is the most they can
  return, and the budget counts that.
- *sizes read from values* (``bincount``, ``repeat_interleave``,
  ``one_hot`` without a class count): :func:`value_sized` computes the bytes
  from the input values, which replay reads just before the call and
  refuses it if they exceed what the trace recorded (fences.py).
"""

from __future__ import annotations

import math

import torch

from ..spec.schema import schema_of

__all__ = ["list_count", "read_bound", "value_sized", "bind"]


def bind(func, args, kwargs) -> dict:
    """The call's arguments by schema name (positional ones first)."""
    out = {a.name: a.default_value if a.has_default_value() else None for a in schema_of(func).arguments}
    out.update(zip((a.name for a in schema_of(func).arguments), args))
    out.update(kwargs)
    return out


def _dim(a: dict, name: str = "self") -> int:
    t = a[name]
    d = a.get("dim") or 0
    return t.shape[d] if t.dim() else 1


def _split(a: dict) -> int:
    n, size = _dim(a), a["split_size"]
    return 1 if n == 0 or size <= 0 else -(-n // size)


def _chunk(a: dict) -> int:
    n, chunks = _dim(a), a["chunks"]
    if n == 0:  # torch splits nothing into ``chunks`` empty pieces
        return chunks
    size = -(-n // max(chunks, 1))
    return -(-n // size)


def _tensor_split(a: dict) -> int | None:
    t = a["tensor_indices_or_sections"]
    return t.numel() + 1 if t.dim() == 1 else None  # 0-d: a number of sections, read from data


def _ndim(a: dict) -> int:
    t = a["self"] if "self" in a else a["condition"]
    return max(t.dim(), 1)


def _gradient(a: dict) -> int:
    dim = a.get("dim")
    return len(dim) if isinstance(dim, (list, tuple)) else (1 if dim is not None else _ndim(a))


def _bins(a: dict) -> int:
    bins = a.get("bins")
    return len(bins) if isinstance(bins, (list, tuple)) else a["self"].shape[-1]


# Op base name -> number of tensors the list return holds, from the arguments.
_LIST_COUNTS = {
    "unbind": _dim,
    "unbind_copy": _dim,
    "split": lambda a: len(a["split_size"]) if isinstance(a["split_size"], (list, tuple)) else _split(a),
    "split_copy": _split,
    "unsafe_split": _split,
    "split_with_sizes": lambda a: len(a["split_sizes"]),
    "split_with_sizes_copy": lambda a: len(a["split_sizes"]),
    "unsafe_split_with_sizes": lambda a: len(a["split_sizes"]),
    "chunk": _chunk,
    "unsafe_chunk": _chunk,
    "tensor_split": lambda a: (
        a["sections"] if "sections" in a else len(a["indices"]) + 1 if "indices" in a else _tensor_split(a)
    ),
    "hsplit": lambda a: a["sections"] if "sections" in a else len(a["indices"]) + 1,
    "vsplit": lambda a: a["sections"] if "sections" in a else len(a["indices"]) + 1,
    "dsplit": lambda a: a["sections"] if "sections" in a else len(a["indices"]) + 1,
    "where": _ndim,
    "nonzero_numpy": _ndim,
    "gradient": _gradient,
    "histogramdd": _bins,
    "_histogramdd_bin_edges": _bins,
}


def _returns_list(func) -> bool:
    return any("List" in str(r.type) for r in schema_of(func).returns)


def _list_argument(func) -> bool:
    return any(
        "List[Tensor]" in str(a.type) or "List[Optional[Tensor]]" in str(a.type) for a in schema_of(func).arguments
    )


def list_count(func, args, kwargs) -> int | None:
    """How many tensors ``func``'s list return will hold, from meta arguments.

    None where the op returns no list, or one entry per entry of a list
    argument; raises LookupError for a list-returning op it cannot count, and
    ValueError where the count is read from data.
    """
    if not _returns_list(func) or _list_argument(func):
        return None
    count = _LIST_COUNTS.get(func.name().partition("::")[2].partition(".")[0])
    if count is None:
        raise LookupError(func.name())
    n = count(bind(func, args, kwargs))
    if n is None:
        raise ValueError("the number of outputs is read from a tensor's values")
    return n


def read_bound(inputs: list, outputs: list) -> list:
    """Bytes each output of a data-dependent call may take: at most one entry
    per element read, with one index per dimension (``nonzero``), in 8 bytes."""
    elements = sum(t.numel() for t in inputs)
    ndim = max((t.dim() for t in inputs), default=1)
    return [elements * max(ndim, 1) * 8 for _ in outputs]


def _max_plus_one(t: torch.Tensor) -> int:
    return int(t.max()) + 1 if t.numel() else 0


def _repeat_interleave(a: dict) -> int:
    """``repeat_interleave(repeats)`` gives ``sum(repeats)`` indices; with ``self``
    that many slices of it along ``dim`` (of the flattened tensor without one)."""
    repeats, t = a["repeats"], a.get("self")
    along = 1 if t is None else (t.numel() if a.get("dim") is None else t.shape[a["dim"]])
    if a.get("output_size") is not None:
        total = a["output_size"]
    elif repeats.numel() == 1 and t is not None:
        total = int(repeats) * along
    else:
        total = int(repeats.sum())
    if t is None:
        return total * 8
    return total * (t.numel() // max(along, 1)) * t.element_size() + total * 8


def _ctc_loss(a: dict) -> int:
    """``log_alpha`` is batch x time x (2 * longest target + 1)."""
    lengths, log_probs = a["target_lengths"], a["log_probs"]
    longest = int(max(lengths)) if len(lengths) else 0
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    return batch * log_probs.shape[0] * (2 * longest + 1) * log_probs.element_size()


def _pad_packed(a: dict) -> int:
    """Padded to ``batch_sizes[0]`` sequences of the longest length."""
    sizes, data = a["batch_sizes"], a["data"]
    steps = max(a.get("total_length") or 0, sizes.numel())
    return steps * (int(sizes[0]) if sizes.numel() else 0) * math.prod(data.shape[1:]) * data.element_size()


def _one_hot(a: dict) -> int:
    classes = a.get("num_classes")
    return a["self"].numel() * (classes if classes is not None and classes >= 0 else _max_plus_one(a["self"])) * 8


# Overload (``.out`` forms included) -> bytes its outputs take, from its
# arguments' real values.
_VALUE_SIZED = {
    "aten::bincount": lambda a: max(a.get("minlength") or 0, _max_plus_one(a["self"])) * 8,
    "aten::repeat_interleave.Tensor": _repeat_interleave,
    "aten::repeat_interleave.self_Tensor": _repeat_interleave,
    "aten::one_hot": _one_hot,
    "aten::_ctc_loss": _ctc_loss,
    "aten::_ctc_loss.Tensor": _ctc_loss,
    "aten::_pad_packed_sequence": _pad_packed,
    # A 0-d tensor holds the number of sections: that many views.
    "aten::tensor_split.tensor_indices_or_sections": lambda a: (
        (int(a["tensor_indices_or_sections"]) + 1) * _OUTPUT_BYTES if a["tensor_indices_or_sections"].dim() == 0 else 0
    ),
}
_OUTPUT_BYTES = 256  # a tensor object (TensorImpl and its Python wrapper): what a view costs


def value_sized(func):
    """``size(arguments) -> bytes`` for an op whose output size is read from
    its inputs' values (Note [Sizes known before running]), else None."""
    name = func.name()
    for suffix in ("_out", ".out"):
        if name.endswith(suffix):
            name = name.removesuffix(suffix)
    return _VALUE_SIZED.get(name)
