"""The real CPU kernel as the reference: materialise inputs, run, compare.

Used by ``md.check`` (answering ops no rule can, re-checking every call),
``md.verify_rule`` and the op_db conformance test.  Three pieces:

* ``materialize``: real CPU tensors with the metadata of MetaTensors (shape,
  dtype, strides, storage offset; inputs that share a storage share one real
  storage), filled with made-up data -- or with the real value when the
  tensor has a known value (see ``known.py``).  Bounded by a byte limit.
* ``run_real``: call an op on materialised arguments, devices moved to CPU.
* comparing what was recorded with a real output is ``ir/compare.py``'s job.

Note [Made-up data]
~~~~~~~~~~~~~~~~~~~
Floating inputs are filled with seeded normal values and booleans with True.
Integers get ``ints``: 1 when answering a data-dependent op (with True
masks, every element selected: an upper bound for the sizes that follow),
0 when re-checking (always a valid index, so gathers and embeddings run even
on dimensions of size 1).  A tensor whose values have known bounds gets data
inside them (Note [Value bounds] in bounds.py).  Any size that depends on
these values is an assumption, and callers say so.
"""

from __future__ import annotations

import torch

from .. import _compat
from .._compat import pytree
from ..errors import MaterializeLimitError
from ..ir.trace import TensorMeta
from ..tensor.tensor import META, in_kernel, wrap
from ..tensor.tensor import value_of as known_value
from .bounds import bounds_of, fill_within

__all__ = [
    "materialize",
    "run_real",
    "map_args",
    "flat",
    "meta_like",
    "to_meta_outputs",
    "nbytes",
    "alias_pattern",
    "DEFAULT_LIMIT",
]

DEFAULT_LIMIT = 1 << 30  # bytes of real inputs md.check may allocate for one call
CPU = torch.device("cpu")


def _extent(shape, stride, offset) -> int:
    """Elements of storage a tensor with this geometry needs."""
    if any(s == 0 for s in shape):
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def nbytes(args, kwargs=None) -> int:
    """Bytes a real copy of the tensors in ``args``/``kwargs`` would take."""
    total = 0
    for t in pytree.tree_leaves((args, kwargs or {}), is_leaf=lambda x: isinstance(x, TensorMeta)):
        if isinstance(t, (torch.Tensor, TensorMeta)):
            _, shape, stride, offset = _geometry(t)
            total += _extent(shape, stride, offset) * t.dtype.itemsize
    return total


def _fill(base: torch.Tensor, gen: torch.Generator, ints: int) -> torch.Tensor:
    if base.dtype.is_floating_point or base.dtype.is_complex:
        return base.normal_(generator=gen) if base.dtype != torch.complex32 else base.zero_()
    return base.fill_(True if base.dtype == torch.bool else ints)


def _geometry(t):
    """(key, shape, stride, offset) of a tensor, MetaTensor or TensorMeta."""
    if isinstance(t, TensorMeta):
        return t.storage, t.shape, t.stride, t.storage_offset
    return _compat.storage_key(t), tuple(t.shape), t.stride(), t.storage_offset()


def _stands_in(x) -> bool:
    return isinstance(x, TensorMeta) or (isinstance(x, torch.Tensor) and _is_meta(x))


def materialize(args, kwargs=None, *, limit: int | None = DEFAULT_LIMIT, seed: int = 0, ints: int = 1, value_of=None):
    """Real CPU copies of the MetaTensors (or TensorMetas) in ``(args, kwargs)``.

    See Note [Made-up data]; ``value_of(t)`` gives a tensor's real value when
    known (default: its known value, ``known.py``).  Raises
    :class:`MaterializeLimitError` when the copies would take more than
    ``limit`` bytes (``None``: no limit).
    """
    if value_of is None:
        value_of = known_value
    need = nbytes(args, kwargs)
    if limit is not None and need > limit:
        raise MaterializeLimitError(
            f"running it for real needs {need:,} bytes of inputs, above the limit of "
            f"{limit:,}; raise it with md.checker(limit=BYTES)",
            need=need,
            limit=limit,
        )
    gen = torch.Generator().manual_seed(seed)
    bases: dict = {}  # storage key -> real flat storage tensor

    def one(t):
        if not _stands_in(t):
            return t
        key, shape, stride, offset = _geometry(t)
        size = _extent(shape, stride, offset)
        base = bases.get(key)
        if base is None or base.numel() < size or base.dtype != t.dtype:
            base = bases[key] = _fill(torch.empty(max(size, 1), dtype=t.dtype), gen, ints)
        real = base.as_strided(shape, stride, offset)
        value = value_of(t)
        if value is not None:
            real.copy_(value)
        elif bounds_of(t) is not None:
            fill_within(real, bounds_of(t), gen, ints)  # Note [Value bounds]
        return real

    with torch.no_grad(), _compat.no_python_dispatch():
        return pytree.tree_map(one, (args, kwargs or {}), is_leaf=lambda x: isinstance(x, TensorMeta))


def _is_meta(t) -> bool:
    return t.untyped_storage().device.type == "meta"


def _cpu(x):
    if isinstance(x, torch.device):
        return CPU
    if isinstance(x, str) and x.split(":")[0] in ("cuda", "xpu", "mps", "meta"):
        return "cpu"
    return x


def map_args(fn, args, kwargs):
    """``fn`` applied to every argument and list element.

    An aten schema nests arguments at most one list deep (``Tensor[]``,
    ``int[]``), and pytree's general walk costs ten times this per call.
    """

    def one(x):
        return type(x)(fn(y) for y in x) if type(x) in (list, tuple) else fn(x)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def flat(out) -> list:
    """The leaves of an op's result: lists and tuples flattened, to any depth."""
    if type(out) not in (list, tuple):
        return [out]
    return [leaf for o in out for leaf in flat(o)]


def run_real(func, args, kwargs):
    """Call ``func`` on real CPU arguments; device arguments are moved to CPU."""
    args, kwargs = map_args(_cpu, args, kwargs)
    if func is torch.ops.aten._pin_memory.default:
        # Its value is a copy, and the host may have no accelerator to pin
        # with (Note [Pinned memory on a logical host] in rules/pinned.py).
        x = args[0]
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)
    if kwargs.get("pin_memory"):
        kwargs = dict(kwargs, pin_memory=False)
    with torch.no_grad(), _compat.no_python_dispatch():
        return func(*args, **kwargs)


def meta_like(real: torch.Tensor) -> torch.Tensor:
    """A plain meta tensor with ``real``'s shape, dtype, strides and offset."""
    with in_kernel():
        size = _extent(real.shape, real.stride(), real.storage_offset())
        base = torch.empty(size, dtype=real.dtype, device=META)
        return base.as_strided(real.shape, real.stride(), real.storage_offset())


def to_meta_outputs(out, device):
    """Real outputs -> MetaTensors on the logical ``device`` (plain values pass)."""
    return pytree.tree_map(lambda o: wrap(meta_like(o), device) if isinstance(o, torch.Tensor) else o, out)


def alias_pattern(outputs, inputs, key) -> tuple:
    """For each output tensor, the index of the input whose storage it shares, or None."""
    keys = [key(t) if isinstance(t, torch.Tensor) else None for t in inputs]
    return tuple(
        next((i for i, k in enumerate(keys) if k is not None and k == key(o)), None)
        for o in outputs
        if isinstance(o, torch.Tensor)
    )
