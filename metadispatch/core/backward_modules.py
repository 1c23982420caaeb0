"""Which module a backward call belongs to: the recorder's attribution of backward to forward."""

from __future__ import annotations

import bisect

from .. import _compat
from ..tensor.state import state_of

__all__ = ["BackwardModules"]


class BackwardModules:
    """Which module a backward call belongs to, from autograd sequence numbers.

    Note [Backward attribution]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Every autograd node gets a sequence number when the forward op that
    creates it runs, and the numbers only grow.  So we note, as forward runs,
    the sequence number at which each module starts issuing ops; in backward,
    the node being executed (``torch._C._current_autograd_node()``) names the
    forward op it came from, and a binary search names that op's module.
    This is how torch's profiler links backward to forward; it is exact where
    module hooks on tensors (torch's ModuleTracker) guess -- those only see
    gradients arrive at a module's outputs and inputs, and misattribute ops
    of modules whose inputs need no grad (an embedding's backward).
    AccumulateGrad nodes have no sequence number; their calls belong to the
    module owning the parameter.
    """

    __slots__ = ("seqs", "modules", "last", "_next")

    def __init__(self) -> None:
        self.seqs: list = []  # first sequence number of each run of nodes...
        self.modules: list = []  # ...and the module whose forward ops made them
        self.last: str | None = None
        self._next = _compat.next_sequence_nr()

    def note(self, module: str) -> None:
        """After a forward call: nodes it created belong to ``module``."""
        nxt = _compat.next_sequence_nr()
        if nxt > self._next:
            if module != self.last:
                self.seqs.append(self._next)
                self.modules.append(module)
                self.last = module
            self._next = nxt

    def module_of_current_node(self, default: str) -> str:
        node = _compat.current_autograd_node()
        if node is None:
            return default
        seq = node._sequence_nr()
        if seq >= _SEQ_NONE:
            # AccumulateGrad: the gradient of a parameter, whose name says
            # which module owns it.
            st = state_of(getattr(node, "variable", None))
            named = st.name if st is not None else None
            return named[1].rpartition(".")[0] if named and named[0] == "param" else default
        i = bisect.bisect_right(self.seqs, seq) - 1
        return self.modules[i] if i >= 0 else default


_SEQ_NONE = 2**63  # AccumulateGrad and other nodes without a forward op
