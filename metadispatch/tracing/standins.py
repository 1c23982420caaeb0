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

Note [Optimizers built outside the trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An optimizer made before ``md.trace`` holds the real parameters, whose
``.grad`` stays None while the stand-ins get the gradients: its ``step``
would silently do nothing.  So on an optimizer's first ``step`` in the trace
(torch's global step pre-hook), its param groups are pointed at the
stand-ins and its ``state`` is replaced by MetaTensor copies (Adam's
moments after real steps, say); both are put back on exit.  Its ``zero_grad``
before that first step reaches the real parameters: setting ``.grad`` to
None is undone on exit, and an in-place ``zero_()`` of a real gradient is an
aten call, which the mode applies to a MetaTensor copy.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _compat
from ..core import known
from ..core.tensor import MetaTensor

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
        self._stand_of: dict = {}  # id(real tensor) -> its stand-in
        self._grads: list = []  # (real parameter, its .grad before the trace)
        self._optimizers: dict = {}  # id(optimizer) -> (optimizer, its groups' lists, state)

    def __enter__(self):
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post, always_call=True),
            register_optimizer_step_pre_hook(self._step_pre),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for table, key, original in reversed(self._undo):
            table[key] = original
        self._undo.clear()
        for opt, params, state in self._optimizers.values():
            for group, original in zip(opt.param_groups, params):
                group["params"] = original
            opt.state = state
        self._optimizers.clear()
        for p, grad in self._grads:
            if p.grad is not grad:
                p.grad = grad  # zero_grad(set_to_none=True) reached a real parameter
        self._grads.clear()
        self._stand_of.clear()

    def _step_pre(self, opt, args, kwargs) -> None:
        """Note [Optimizers built outside the trace]."""
        if threading.get_ident() != self._thread or id(opt) in self._optimizers:
            return
        self._optimizers[id(opt)] = (opt, [g["params"] for g in opt.param_groups], opt.state)
        for group in opt.param_groups:
            group["params"] = [self._stand_of.get(id(p), p) for p in group["params"]]
        state = defaultdict(dict)
        for p, entry in opt.state.items():
            stand = self._stand_of.get(id(p))
            if stand is None:
                state[p] = entry
            else:
                owner = stand.__dict__.get("_md_name", ("", "?"))[1]
                state[stand] = {k: self._state_copy(v, f"{owner}.{k}") for k, v in entry.items()}
        opt.state = state

    def _state_copy(self, v, name: str):
        if not isinstance(v, torch.Tensor):
            return v
        meta = self.mode.from_tensor(v)
        meta._md_name = ("input", f"optimizer state {name}")
        # Recorded as a constant (its value kept up to the mode's limit, for
        # replay), and a step count read with .item() (Adam without
        # capturable) is a known value, as it would be had the optimizer been
        # made in the trace.
        self.mode._recorder.real_of[id(meta)] = v
        known.know(meta, v, self.mode)
        return meta

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
                    if _compat.is_functorch_wrapped(t):
                        # swapped in by functional_call under grad/vmap: a
                        # value of the traced program, not a parameter to stand in for
                        continue
                    stand = self.mode.from_tensor(t)
                    if id(t) in names and "_md_name" not in stand.__dict__:
                        stand._md_name = names[id(t)]
                    self._undo.append((table, key, t))
                    table[key] = stand
                    self._stand_of[id(t)] = stand
                    if table is mod._parameters:
                        self._grads.append((t, t.grad))

    def grads(self, meta_of) -> dict:
        """Parameter name -> TensorMeta of its gradient, for every root that ran."""
        out = {}
        for root in self.roots:
            for name, p in root.named_parameters():
                g = p.grad
                if isinstance(g, torch.Tensor) and name not in out:
                    out[name] = meta_of(g)
        return out
