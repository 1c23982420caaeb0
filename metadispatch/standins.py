"""Standing in for a user's real module state while ``md.trace`` runs.

Note [Swap above autograd]
~~~~~~~~~~~~~~~~~~~~~~~~~~
If a real parameter reached the dispatch mode and were converted there --
below autograd -- autograd would already have recorded the *real* parameter
as a leaf, and backward would try to accumulate a meta gradient into its
``.grad``.  So before a module's forward runs (a global forward pre-hook, and
up front for modules passed to ``md.trace``), each real parameter and buffer
in its tree is swapped for a MetaTensor stand-in; autograd then only ever sees
stand-ins.  The swap writes to the modules' ``_parameters``/``_buffers``
dicts and is undone on exit, also on exceptions, so the user's module ends
exactly as it began: same tensors, no ``.grad``, buffers unchanged (in-place
buffer updates such as batch-norm statistics hit the stand-ins).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from .tensor import MetaTensor

__all__ = ["StandIns"]


class StandIns:
    def __init__(self, mode) -> None:
        self.mode = mode
        self.roots: list[nn.Module] = []
        self._swapped: set = set()  # ids of modules already handled
        self._undo: list = []
        self._depth = 0
        self._thread = threading.get_ident()
        self._handles: list = []

    def __enter__(self):
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for table, key, original in reversed(self._undo):
            table[key] = original
        self._undo.clear()

    def _pre(self, mod, args):
        if threading.get_ident() != self._thread:
            return
        if self._depth == 0:
            self.add_root(mod)
        self._depth += 1

    def _post(self, mod, args, output):
        if threading.get_ident() == self._thread:
            self._depth = max(0, self._depth - 1)

    def add_root(self, root: nn.Module) -> None:
        if id(root) in self._swapped:
            return
        if all(r is not root for r in self.roots):
            self.roots.append(root)
        names = {}
        for name, p in root.named_parameters():
            names.setdefault(id(p), ("param", name))
        for name, b in root.named_buffers():
            names.setdefault(id(b), ("buffer", name))
        for mod in root.modules():
            if id(mod) in self._swapped:
                continue
            self._swapped.add(id(mod))
            for table in (mod._parameters, mod._buffers):
                for key, t in list(table.items()):
                    if t is None:
                        continue
                    if isinstance(t, MetaTensor):
                        if "_md_name" not in t.__dict__ and id(t) in names:
                            t._md_name = names[id(t)]
                        continue
                    stand = self.mode.from_tensor(t)
                    if id(t) in names and "_md_name" not in stand.__dict__:
                        stand._md_name = names[id(t)]
                    self._undo.append((table, key, t))
                    table[key] = stand

    def grads(self, meta_of) -> dict:
        """Parameter name -> TensorMeta of its gradient, for every root that ran."""
        out = {}
        for root in self.roots:
            for name, p in root.named_parameters():
                g = p.grad
                if isinstance(g, torch.Tensor) and name not in out:
                    out[name] = meta_of(g)
        return out
