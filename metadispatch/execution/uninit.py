"""Memory a trace reads before any call wrote it: values replay cannot claim are eager's.

Note [Uninitialised memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.empty`` -- and ``empty_like``, ``new_empty``, ``empty_strided``,
``empty_permuted``, a ``resize_`` that grows -- hands out memory as the
allocator left it.  Eager's values there are whatever an earlier tensor of
eager's held, replay's whatever an earlier tensor of replay's held, and
every call's metadata matches all the same: replay said ok on
``torch.empty(3).sum()``.  So before running, :func:`uninitialised_reads`
follows each such allocation through the calls, by the trace's storage
numbers:

- a call that only writes an argument -- ``fill_``, ``zero_``, ``copy_``, the
  in-place random ops, an ``out=`` argument, a collective's output, the
  shard FSDP copies into its all-gather buffer -- initialises the elements
  it writes, when they are one contiguous range (the whole tensor, a row, a
  transposed whole);
- a call that reads elements not yet written, and a result of the trace
  (output, gradient, buffer) that holds some, is listed in
  ``Replay.made_up`` -- once per allocation -- as made-up inputs are: its
  values are not eager's, and the replay is not ok unless the caller
  allows made-up values.

It errs one way only: a write through a strided view (a column, half of
the last dimension) marks the bytes it addresses, exactly (Note [Strided
writes]), but past a size limit initialises nothing here, so reading what
such writes filled in is listed although eager's values are defined; a
write it cannot place never hides a read.  One
partial write is proved to cover its target without values: ``inv[perm] =
v`` into a 1-D ``inv`` of ``n`` elements where ``perm`` is the indices of a
sort of ``n`` elements, a permutation (Qwen3-MoE's experts invert their
routing so).  Making a view or a ``*_like`` tensor reads no values.  A trace
file can hide a read by forging storage numbers, as it can by replacing
``empty`` with ``zeros``: replay proves a trace's program, not its origin.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

from .._compat import pytree
from ..binding.streams import MadeUp
from ..ir.records import TensorMeta, tensor_metas
from ..ir.trace import Trace
from ..spec.schema import arg_value, facts, schema_of

__all__ = ["uninitialised_reads"]

_ALLOCATES = {
    "aten::empty",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::empty_strided",
    "aten::empty_permuted",
}
_GROWS = {"aten::resize_", "aten::resize_as_"}
# Ops that write an argument without reading it, by name: all of it (the
# in-place random ops draw, ``bernoulli_(p)`` reads ``p``, not ``self``; a
# collective's output is every rank's data)...
_OVERWRITES = {
    **dict.fromkeys(
        (
            "aten::fill_",
            "aten::zero_",
            "aten::copy_",
            "aten::normal_",
            "aten::uniform_",
            "aten::bernoulli_",
            "aten::random_",
            "aten::exponential_",
            "aten::geometric_",
            "aten::log_normal_",
            "aten::cauchy_",
        ),
        "self",
    ),
    "metadispatch::trunc_normal_": "tensor",  # nn.init.trunc_normal_ as one op (spec/ownops.py)
    # Their schemas mark nothing written (Note [What an op writes and aliases]).
    "c10d::_allgather_base_": "output_tensor",
    "c10d::allgather_": "output_tensors",
    "c10d::_reduce_scatter_base_": "output_tensor",
    "c10d::reduce_scatter_": "output_tensors",
}
# ... or some of it, at positions its other arguments choose...
_WRITES_SOME = dict.fromkeys(
    ("aten::index_put_", "aten::index_copy_", "aten::index_fill_", "aten::scatter_", "aten::masked_fill_"), "self"
)
# ... or the part of it that its result ``k`` views: FSDP copies this rank's
# shard into the all-gather buffer and returns that slice.
_WRITES_RESULT = {"fsdp::all_gather_copy_in": ("all_gather_output", 0)}
# Ops that read only an argument's metadata (besides the allocations and views).
_METADATA_ONLY = {
    "aten::zeros_like",
    "aten::ones_like",
    "aten::full_like",
    "aten::rand_like",
    "aten::randn_like",
    "aten::randint_like",
    "aten::new_zeros",
    "aten::new_ones",
    "aten::new_full",
    "aten::set_",
    *_ALLOCATES,
    *_GROWS,
}
_PERMUTES = {"aten.sort.default": 1, "aten.sort.stable": 1, "aten.argsort.default": 0, "aten.argsort.stable": 0}

_FOUND: WeakKeyDictionary = WeakKeyDictionary()  # trace -> (number of calls, reads found)


def uninitialised_reads(trace: Trace) -> list:
    """A :class:`MadeUp` for each allocation whose unwritten memory the trace reads."""
    n, found = _FOUND.get(trace, (None, None))
    if n != len(trace.calls):
        found = _Walk(trace).run()
        _FOUND[trace] = (len(trace.calls), found)
    return list(found)


class _Walk:
    """Note [Uninitialised memory]: one pass over the calls."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.pending: dict = {}  # storage number -> [allocating call, its output, written byte ranges]
        self.moved: dict = {}  # id -> the storage it is memory of, where not its recorded one
        self.permutations: dict = {}  # id -> number of elements it permutes
        self.found: list = []

    def run(self) -> list:
        for call in self.trace.calls:
            self._call(call)
        ends = pytree.tree_leaves(self.trace.output_meta, is_leaf=lambda x: isinstance(x, TensorMeta))
        ends += list(self.trace.grads.values())
        ends += [leaf.meta for leaf in self.trace.leaves.values() if leaf.kind == "buffer"]
        for m in tensor_metas(ends):
            self._read(m, None)
        return self.found

    def _call(self, call) -> None:
        packet = call.func.name().partition(".")[0]
        f = facts(call.func)
        named = {a.name: (i, a.name) for i, a in enumerate(schema_of(call.func).arguments)}
        unread: dict = {}  # id -> (argument written without being read, all of it?)
        for arg in [named[a.name] for a in schema_of(call.func).arguments if a.is_out]:
            unread.update((id(m), (m, True)) for m in tensor_metas(arg_value(call, arg)))
        name = _OVERWRITES.get(packet)
        if name in named:
            unread.update((id(m), (m, True)) for m in tensor_metas(arg_value(call, named[name])))
        name = _WRITES_SOME.get(packet)
        if name in named and not _accumulates(call, named):
            unread.update((id(m), (m, False)) for m in tensor_metas(arg_value(call, named[name])))
        name, k = _WRITES_RESULT.get(packet, (None, 0))
        if name in named and k < len(call.output_metas):
            unread.update((id(m), (m, False)) for m in tensor_metas(arg_value(call, named[name])))
            self._write(call.output_metas[k])
        if not f.is_view and packet not in _METADATA_ONLY:
            for m in call.inputs:
                if id(m) not in unread:
                    self._read(m, call.index)
        after = {o.id: o for o in call.output_metas}  # an ``out=`` argument as resized to fit
        for m, whole in unread.values():
            if whole or self._covers(call, m):
                self._write(after.get(m.id, m))
        self._follow(call, f)
        self._allocate(call, packet)

    def _storage(self, m: TensorMeta) -> int:
        return self.moved.get(m.id, m.storage)

    def _follow(self, call, f) -> None:
        """Outputs that alias an argument are its memory; ``set_`` moves its target to its source's."""
        for target, source in f.joins:
            for m, s in zip(tensor_metas(arg_value(call, target)), tensor_metas(arg_value(call, source))):
                self.moved[m.id] = self._storage(s)
        for k, out in enumerate(call.outputs):
            shared = [m for a in (f.aliases[k] if k < len(f.aliases) else ()) for m in tensor_metas(arg_value(call, a))]
            for m in tensor_metas(out):
                if shared and self._storage(shared[0]) != m.storage:
                    self.moved[m.id] = self._storage(shared[0])
                else:
                    self.moved.pop(m.id, None)

    def _allocate(self, call, packet: str) -> None:
        outs = call.output_metas
        if packet in _ALLOCATES and outs:
            self.pending[self._storage(outs[0])] = [call, outs[0], []]
        elif packet in _GROWS and outs and call.inputs:
            before, after = _end(call.inputs[0]), _end(outs[0])  # resize_ keeps the dtype
            if after > before and self._storage(outs[0]) not in self.pending:
                self.pending[self._storage(outs[0])] = [call, outs[0], [(0, before)]]
        elif call.op in _PERMUTES and len(outs) > _PERMUTES[call.op]:
            m = outs[_PERMUTES[call.op]]
            if len(m.shape) == 1 and call.inputs and call.inputs[0].numel == m.numel:
                self.permutations[m.id] = m.numel

    def _covers(self, call, target: TensorMeta) -> bool:
        """``index_put_(target, [perm], v)``: a permutation of all of a 1-D target's elements."""
        if call.op != "aten.index_put_.default" or len(target.shape) != 1:
            return False
        indices = call.args[1] if len(call.args) > 1 else ()
        return (
            isinstance(indices, tuple)
            and len(indices) == 1
            and isinstance(indices[0], TensorMeta)
            and self.permutations.get(indices[0].id) == target.numel
        )

    def _write(self, m: TensorMeta) -> None:
        entry = self.pending.get(self._storage(m))
        if entry is None:
            return
        span = _dense_range(m)
        if span is not None:
            entry[2] = _merge(entry[2] + [span])
        if span is None or len(entry) > 3:
            _written_bytes(entry, m)

    def _read(self, m: TensorMeta, at: int | None) -> None:
        storage = self._storage(m)
        entry = self.pending.get(storage)
        if entry is None or m.numel == 0:
            return
        lo, hi = m.storage_offset * m.dtype.itemsize, _end(m)
        if any(a <= lo and hi <= b for a, b in entry[2]):
            return
        if len(entry) > 3 and entry[3] is not None and bool(_bytes_of(entry[3], m).all()):
            return
        call, out = entry[0], entry[1]
        del self.pending[storage]  # one entry per allocation
        where = f"call #{at} reads" if at is not None else "a result of the trace holds"
        self.found.append(
            MadeUp(
                f"uninitialised ${out.id}",
                at,
                f"{call.op} (call #{call.index}) allocated it and no call wrote the elements {where}: "
                "eager's values there are whatever its allocator left (Note [Uninitialised memory])",
            )
        )


# Note [Strided writes]
# ~~~~~~~~~~~~~~~~~~~~~
# An allocation's bytes are followed one by one, in a mask, once a write is
# not one contiguous range (DeepSeek-V3 fills a query's halves,
# ``q[..., :8] = a; q[..., 8:] = b``), up to this many bytes; a larger one
# keeps the ranges alone and may list a read its strided writes covered.
_MASK_LIMIT = 1 << 26


def _written_bytes(entry: list, m: TensorMeta) -> None:
    """Mark the bytes ``m`` addresses as written in ``entry``'s mask (made on first need)."""
    if len(entry) == 3:
        size = _end(entry[1])
        mask = torch.zeros(size, dtype=torch.bool) if size <= _MASK_LIMIT else None
        if mask is not None:
            for a, b in entry[2]:
                mask[a:b] = True
        entry.append(mask)
    if entry[3] is not None and _end(m) <= entry[3].numel():
        _bytes_of(entry[3], m).fill_(True)


def _bytes_of(mask, m: TensorMeta):
    """The bytes of ``mask`` that ``m``'s elements occupy, as a view."""
    k = m.dtype.itemsize
    if _end(m) > mask.numel():
        return mask.new_zeros(1)  # beyond the allocation: not written
    return mask.as_strided((*m.shape, k), (*(st * k for st in m.stride), 1), m.storage_offset * k)


def _accumulates(call, named: dict) -> bool:
    """``index_put_(accumulate=True)`` and ``scatter_(reduce=...)`` read what they write into."""
    accumulate = arg_value(call, named["accumulate"]) if "accumulate" in named else False
    return bool(accumulate) or ("reduce" in named and arg_value(call, named["reduce"]) is not None)


def _end(m: TensorMeta) -> int:
    """One past the last byte ``m`` addresses in its storage (views of another dtype share it)."""
    last = (
        m.storage_offset
        if m.numel == 0
        else m.storage_offset + 1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride))
    )
    return last * m.dtype.itemsize


def _dense_range(m: TensorMeta) -> tuple | None:
    """``(first, end)`` bytes when ``m``'s elements are exactly one contiguous range, else None."""
    dims = sorted((st, s) for s, st in zip(m.shape, m.stride) if s != 1)
    expected = 1
    for st, s in dims:
        if st != expected:
            return None
        expected *= s
    return (m.storage_offset * m.dtype.itemsize, (m.storage_offset + m.numel) * m.dtype.itemsize)


def _merge(ranges: list) -> list:
    out: list = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
