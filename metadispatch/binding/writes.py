"""What replay may write: the leaves a trace writes, and a guard for the rest.

Note [Replay never writes its inputs] (execution/replay.py) promises that tensors
handed to replay come out unchanged.  Two halves keep it, neither trusting
what a trace (perhaps a file anyone wrote) says about storages:

- Before running, :func:`written_leaves` follows the trace's own variables
  -- the ids the generated program binds -- through every call, with what
  each op writes and aliases taken from its schema (Note [What an op writes
  and aliases] in schema.py).  A leaf is written if some call writes a
  variable that may share its memory (Note [Which leaves a trace writes]).  ``bind_leaves`` copies those, and
  with them every leaf whose *real* tensor shares a storage with one.
- While running, :func:`write_guard` checks the tensors a writing call is
  handed against the storages of the caller's tensors, and refuses the call
  before it runs if one is the caller's.  It catches what the schema does
  not say (a composite that returns its input itself); a trace recorded by
  ``md.trace`` never trips it.

Storage numbers and argument positions in the trace are never consulted.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

from .. import _compat
from ..errors import ReplayError
from ..ir.records import tensor_metas
from ..ir.trace import Trace
from ..spec.schema import arg_value, facts

__all__ = ["written_leaves", "write_guard", "written_args"]

_WRITTEN: WeakKeyDictionary = WeakKeyDictionary()  # trace -> (number of calls, written leaf ids)
_NONE: frozenset = frozenset()


def written_leaves(trace: Trace) -> frozenset:
    """Ids of the leaves whose memory some call in ``trace`` may write."""
    n, out = _WRITTEN.get(trace, (None, None))
    if n != len(trace.calls):  # a trace still recording may have grown
        out = _written_leaves(trace)
        _WRITTEN[trace] = (len(trace.calls), out)
    return out


def _written_leaves(trace: Trace) -> frozenset:
    """Note [Which leaves a trace writes]."""
    groups = _Groups()
    node = {tid: groups.new() for tid in trace.leaves}  # id -> its variable's group, now
    leaves = dict(node)

    def of(value) -> list:
        return [node[m.id] if m.id in node else groups.new() for m in tensor_metas(value)]

    for call in trace.calls:
        f = facts(call.func)
        for arg in f.writes:
            for g in of(arg_value(call, arg)):
                groups.mark(g)
        for target, source in f.joins:  # set_data: target's variable is source's memory now
            for m, g in zip(tensor_metas(arg_value(call, target)), of(arg_value(call, source))):
                node[m.id] = g
        for k, out in enumerate(call.outputs):
            shared = [g for a in (f.aliases[k] if k < len(f.aliases) else ()) for g in of(arg_value(call, a))]
            for m in tensor_metas(out):
                g = groups.new()
                for h in shared:
                    groups.union(g, h)
                node[m.id] = g
    return frozenset(tid for tid, g in leaves.items() if groups.marked(g))


class _Groups:
    """Union-find over "may share memory", each group marked once written.

    Note [Which leaves a trace writes]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Every output of a call starts a group, joined with the groups of the
    arguments it may alias (views, in-place results, what ``set_`` points
    at); a leaf is written if a call writes any variable of its group.
    Groups only ever merge, so a write before two variables came to share
    memory counts for both: more copies than needed, never fewer.  Sets of
    leaves per variable, as this was first written, made a chain of
    ``set_`` calls quadratic (32k leaves: 8 s); union-find keeps the walk
    linear.
    """

    def __init__(self) -> None:
        self.parent: list = []
        self.written: list = []

    def new(self) -> int:
        self.parent.append(len(self.parent))
        self.written.append(False)
        return len(self.parent) - 1

    def find(self, g: int) -> int:
        parent = self.parent
        root = g
        while parent[root] != root:
            root = parent[root]
        while parent[g] != root:  # path compression
            parent[g], g = root, parent[g]
        return root

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a
            self.written[a] = self.written[a] or self.written[b]

    def mark(self, g: int) -> None:
        self.written[self.find(g)] = True

    def marked(self, g: int) -> bool:
        return self.written[self.find(g)]


def written_args(call) -> list:
    """The tensor records ``call`` passes where its op writes."""
    return [m for arg in facts(call.func).writes for m in tensor_metas(arg_value(call, arg))]


def write_guard(protected, calls: list):
    """``guard(n, *tensors)``: refuse call ``n`` if it would write a protected tensor.

    ``protected`` holds the caller's tensors; their storages are looked up
    at the first write, so a trace that writes nothing pays nothing.  A
    sparse tensor is the memory of its indices and values (a file can build
    one over the caller's tensor, and the schema says its result is fresh); a
    tensor whose memory replay cannot name (MKL-DNN, nested) is refused where
    it would be written.
    """
    keys: set | None = None  # the storages of ``protected``, found at the first write (most traces write none)

    def guard(n: int, *tensors) -> None:
        nonlocal keys
        if keys is None:
            keys = set()
            for t in protected:
                keys.update(_keys(t) or ())
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            mine = _keys(t)
            if mine is None or not keys.isdisjoint(mine):
                call = calls[n]
                raise ReplayError(
                    f"replay refused call #{call.index} {call.op}: it would write memory of a "
                    "tensor you passed in (an argument, parameter, buffer or the trace's "
                    "constant), which replay never changes"
                    + ("" if mine is not None else f", or memory of a {t.layout} tensor replay cannot place"),
                    call=call.index,
                )

    return guard


_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def _keys(t) -> tuple | None:
    """Storage keys of the memory ``t`` holds; None where replay cannot tell."""
    if not isinstance(t, torch.Tensor):
        return ()
    try:
        if t.layout == torch.strided and not t.is_nested:
            return (_compat.storage_key(t),)
        if t.layout == torch.sparse_coo:
            return (_compat.storage_key(t._indices()), _compat.storage_key(t._values()))
        if t.layout in _COMPRESSED:
            parts = [getattr(t, name)() for name in _COMPRESSED[t.layout]] + [t.values()]
            return tuple(_compat.storage_key(p) for p in parts)
    except (RuntimeError, NotImplementedError):
        pass
    return None
