"""When each of a trace's tensors is last used: the points replay frees them.

The generated program (execution/program.py) frees each id after the last
call that reads or returns it (Note [Freeing early] in execution/program.py),
and replay's budget (trust/costs.py) counts a storage's bytes until the same
point, so both read this one walk.
"""

from __future__ import annotations

from .._compat import pytree
from .records import TensorMeta, tensor_metas
from .trace import Trace

__all__ = ["free_points"]


def free_points(trace: Trace) -> dict:
    """Call index -> ids whose last use is that call (Note [Freeing early] in execution/program.py)."""
    keep = {
        m.id for m in tensor_metas(pytree.tree_leaves(trace.output_meta, is_leaf=lambda x: isinstance(x, TensorMeta)))
    }
    keep.update(m.id for m in trace.grads.values())
    keep.update(tid for tid, leaf in trace.leaves.items() if leaf.kind == "buffer")
    last: dict = {}
    storage: dict = {}
    for call in trace.calls:
        for m in call.inputs + call.output_metas:
            last[m.id] = call.index
            storage[m.id] = m.storage
    deaths = trace.deaths or {}
    n = len(trace.calls)
    out: dict = {}
    for tid, i in last.items():
        if tid in keep:
            continue
        if deaths:
            # Free where the traced run freed the storage (the first call
            # after its death), not earlier: following eager's allocation
            # pattern lets the allocator reuse blocks instead of faulting in
            # fresh pages.  A storage that outlived the trace is kept.
            d = deaths.get(storage[tid])
            if d is None or d >= n:
                continue
            i = max(i, d - 1)
        out.setdefault(i, []).append(tid)
    return out
