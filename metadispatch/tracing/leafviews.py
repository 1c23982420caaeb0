"""Note [Views of leaves] in core/record.py, second half: once a trace is done, its
unnamed leaves on a named tensor's storage become views of that tensor."""

from __future__ import annotations

from .. import _compat
from ..core.record import is_leaf_named
from ..ir.trace import Leaf

__all__ = ["bind_views"]


def bind_views(rec, named) -> None:
    """Note [Views of leaves], second half: unnamed leaves on a named tensor's storage.

    A view of a parameter made outside the traced code (a closure's
    ``w.t()``, a module attribute ``self.wt = lin.weight.detach().t()``)
    may reach an op before the parameter does, or the parameter may never
    reach one; it was then recorded as a constant (a copy of its value) or
    an anonymous input.  Neither is right once the parameter changes in
    place, or replay is given another module: it is that parameter's
    data.  Once the trace is done, each such leaf becomes a ``view`` leaf
    naming its base, whatever the order; replay binds it as the same view
    of the tensor it binds to that base.  ``named`` are the stand-ins
    ``md.trace`` named (parameters, buffers, arguments, gradients).
    """
    unnamed: dict = {}
    for tid, leaf in rec.trace.leaves.items():
        if leaf.kind in ("const", "input"):
            unnamed.setdefault(leaf.meta.storage, []).append(tid)
    if not unnamed:
        return
    bases: dict = {}  # storage number -> "kind name" of the first named tensor on it
    for t in named:
        hit = rec._live.get(_compat.storage_key(t))
        if hit is None or hit[0] not in unnamed or hit[0] in bases:
            continue
        st = t._md
        kind, name = st.name
        if st.recorder is rec.token and not is_leaf_named(rec.trace, st.meta.id, kind, name):
            continue  # its data was swapped for another's (Note [Data swapped into a named tensor])
        if not any(leaf.kind == kind and leaf.name == name for leaf in rec.trace.leaves.values()):
            rec.meta_of(t)  # a base the traced code never read itself: a leaf replay binds
        bases[hit[0]] = f"{kind} {name}"
    for storage, base in bases.items():
        for tid in unnamed[storage]:
            rec.trace.leaves[tid] = Leaf(rec.trace.leaves[tid].meta, "view", base)
