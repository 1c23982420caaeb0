"""One mode entry as an undo ledger, and which MetaMode holds a thread's dispatch slot.

``MetaMode.__enter__`` records each change it makes as an undo step in an
:class:`Entry`, before the change; ``activate`` puts the mode in torch's
FAKE dispatch-mode slot and the per-thread swap (swap.py) on the function
stack; ``deactivate`` hands the slot to the newest mode still entered.
"""

from __future__ import annotations

import threading

from .. import _compat
from ..gpu import autocast
from .modules import ModuleStack
from .swap import SWAP

__all__ = ["Entry", "ACTIVE", "activate", "deactivate"]


# Note [Interrupts in mode entry and exit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A KeyboardInterrupt can land between any two statements of __enter__ or
# __exit__, and whatever entering installed -- the mode slot, torch's mode
# flags, the gc threshold, the lift flag, hooks, the function mode -- must not
# outlive the mode.  So each change is preceded by an undo step that is safe
# to run whether or not the change happened, and safe to run twice:
# __enter__ undoes its entry if anything escapes; __exit__ marks the entry as
# leaving and runs its steps, and its ``finally`` runs whatever an interrupt
# cut short.  The exit's ``try`` and its body share a line: Python raises an
# interrupt at a line's first instruction, and a ``try:`` line of its own is
# outside the protected range.  Statements that must not be separated share
# a line for the same reason, and locks are taken with ``_compat.call_locked``
# (a ``with lock:`` can be interrupted between its body and the release).
#
# Which MetaMode holds the slot is derived, not saved: a per-thread list of
# active entries, in entry order.  Leaving one removes it wherever it is and
# hands the slot to the newest remaining, so two modes left out of order
# (two generators) leave nothing installed, as with torch's own modes.
class Entry:
    """What one ``__enter__`` changed, as undo steps run newest first."""

    def __init__(self) -> None:
        self.steps: list = []
        self.leaving = False
        self.tracker: ModuleStack | None = None  # the ModuleStack this entry installed
        self.generators: dict = {}  # id -> (generator, state before its first use)

    def undo(self) -> None:
        while self.steps:
            # fmt: off
            self.steps[-1](); self.steps.pop()  # noqa: E702 (one line: Note above)
            # fmt: on

    def restore_generators(self) -> None:
        for generator, state in self.generators.values():
            generator.set_state(state)


class _Active(threading.local):
    def __init__(self) -> None:
        self.entries: list = []  # (mode, entry), oldest first
        self.before: tuple | None = None  # what the first entry found: torch's flags, the lift flag, the gc threshold


ACTIVE = _Active()


def activate(mode, entry: Entry) -> None:
    active = ACTIVE
    if not active.entries and active.before is None:
        flags, lift, heap = _compat.dispatch_mode_flags(), _compat.only_lift_cpu_tensors(), _compat.deferred_full_gc()
        active.before = (flags, lift, heap)
        if mode.record:
            heap.__enter__()  # Note [Garbage collection during tracing]
        # torch.tensor(..., device="cuda") builds on CPU first and then moves,
        # so that no CUDA is needed; FakeTensorMode does the same.
        _compat.set_only_lift_cpu_tensors(True)
        _compat.push_function_mode(SWAP)
    active.entries.append((mode, entry))
    _compat.set_dispatch_mode_flags(
        (
            True,
            active.before[0][1] or not mode.is_infra_mode(),
            active.before[0][2] or not mode.ignore_compile_internals(),
        )
    )
    # fmt: off
    _compat.unset_infra_mode(_compat.mode_key); _compat.set_infra_mode(mode)  # noqa: E702
    # fmt: on


def deactivate(entry: Entry) -> None:
    active = ACTIVE
    active.entries[:] = [(m, e) for m, e in active.entries if e is not entry]
    if active.entries:
        # Out of order: the newest remaining entry holds the slot.
        # fmt: off
        _compat.unset_infra_mode(_compat.mode_key); _compat.set_infra_mode(active.entries[-1][0])  # noqa: E702
        # fmt: on
        return
    _compat.unset_infra_mode(_compat.mode_key)
    if active.before is not None:
        flags, lift, heap = active.before
        _compat.remove_function_mode(SWAP)
        _compat.set_only_lift_cpu_tensors(lift)
        _compat.set_dispatch_mode_flags(flags)
        heap.__exit__(None, None, None)
        active.before = None
        autocast.clear_cache()  # Note [Autocast on a logical GPU] in autocast.py
