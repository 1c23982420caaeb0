"""Which module is running: torch's ModuleTracker, narrowed to the innermost.

``torch.utils.module_tracker.ModuleTracker`` follows the module hierarchy in
forward (we use only that half: see below) and exposes the set of
running modules, named ``Root.child.grandchild``.  We need the innermost one
for every aten call, relative to the root (``child.grandchild``, ``""`` at top
level), so we cache it between hook events.

Its hooks are process-global; calls from other threads are ignored so that
two threads can trace independently.  While entered it also notes when an
optimizer's ``step`` runs (torch's global optimizer hooks, as ``MemTracker``
uses), so that those calls get the phase ``"optimizer"``.
"""

from __future__ import annotations

import threading

from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.module_tracker import ModuleTracker

__all__ = ["ModuleStack"]


class ModuleStack(ModuleTracker):
    def __init__(self) -> None:
        super().__init__()
        self._thread = threading.get_ident()
        self._for: set | None = None  # the parents set the cache was computed from
        self._current = ""
        self.classes: dict = {}  # qualified name -> class name
        self.in_optimizer = False
        self._handles: list = []

    # Each handle is kept on the line that registers it, and removal is
    # idempotent: an interrupt anywhere leaves nothing that close() cannot
    # remove (Note [Interrupts in mode entry and exit] in mode.py).
    def __enter__(self):
        self._handles.append(register_module_forward_pre_hook(self._fw_pre_hook))
        self._handles.append(register_module_forward_hook(self._fw_post_hook))
        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        return self

    def __exit__(self, *args):
        self.close()

    def close(self) -> None:
        while self._handles:
            # fmt: off
            self._handles[-1].remove(); self._handles.pop()  # noqa: E702 (one line: see above)
            # fmt: on

    def _opt_pre(self, opt, args, kwargs):
        """Note [A closure passed to optimizer.step]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        ``optimizer.step(closure)`` runs the closure -- the forward and the
        backward -- inside ``step`` (LBFGS needs it; Lightning's automatic
        optimisation does it with every optimizer).  Marked by the step's
        hooks alone, the whole training step came out as ``optimizer``
        calls: no activations, and the backward's workspace missing.  So the
        closure is handed on wrapped (a global pre-hook may replace the
        arguments), and its calls keep the phase they would have outside.
        """
        if not self._mine():
            return None
        self.in_optimizer = True
        if "closure" in kwargs and callable(kwargs["closure"]):
            return args, dict(kwargs, closure=self._outside_step(kwargs["closure"]))
        if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer itself
            return (args[0], self._outside_step(args[1]), *args[2:]), kwargs
        return None

    def _outside_step(self, closure):
        def run(*a, **k):
            inside, self.in_optimizer = self.in_optimizer, False
            try:
                return closure(*a, **k)
            finally:
                self.in_optimizer = inside

        return run

    def _opt_post(self, *args):
        if self._mine():
            self.in_optimizer = False

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    # Only the forward half of ModuleTracker is used: backward calls are
    # attributed exactly through autograd sequence numbers (Note [Backward
    # attribution] in record.py), so the multi-grad hooks ModuleTracker would
    # register on every module's inputs and outputs are skipped; they cost
    # more per module call than everything else here.
    def _fw_pre_hook(self, mod, input):
        if self._mine():
            name = self._get_mod_name(mod)
            self.parents.add(name)
            self._for = None
            self.classes.setdefault(_strip(name), type(mod).__name__)

    def _fw_post_hook(self, mod, input, output):
        if self._mine():
            self.parents.discard(self._get_mod_name(mod))
            self._for = None

    def current(self) -> str:
        parents = self.parents
        if self._for is not parents:
            # Names grow by ".child" at each level, so the longest is innermost.
            self._current = _strip(max(parents, key=len))
            self._for = parents
        return self._current


def _strip(name: str) -> str:
    if name == "Global":
        return ""
    return name.partition(".")[2]
