"""Random streams as trace data: generator references and RNG state events.

A traced run draws no random numbers (meta kernels do not), yet replay must
draw exactly the numbers eager drew.  Eager's numbers follow from three
things, which the trace records (``core/rngstate.py`` records them):

* the state each *default* generator starts from (``trace.rng_state`` for
  the CPU one, ``trace.rng_cuda`` for CUDA ones where a real CUDA exists);
* the state of every *explicit* ``torch.Generator`` at its first use:
  ``trace.generators[k]``, named in a call's arguments by
  :class:`GeneratorRef` ``k``;
* reads and writes of the default generators' states by torch utilities
  (``torch.get_rng_state``/``set_rng_state``, which activation checkpointing
  and ``torch.random.fork_rng`` call to redraw the same dropout mask):
  :class:`RngEvent` records, ordered by the call they precede.

Replay sets the generators to the recorded states and performs the events at
the same points between calls, so the random ops draw what eager drew.  A
state saved by the traced run is a *slot* (its bytes are meaningless: no
number was drawn while tracing); replay fills the slot with the real state
at that point.  A state set from outside (a tensor the user built) is kept
as bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["GeneratorRef", "RngEvent", "is_generator", "OLD_GENERATOR"]


class GeneratorRef:
    """An explicit ``torch.Generator`` argument: index into ``trace.generators``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __eq__(self, other) -> bool:
        return type(other) is GeneratorRef and other.index == self.index

    def __hash__(self) -> int:
        return hash((GeneratorRef, self.index))

    def __repr__(self) -> str:
        return f"<generator {self.index}>"


class RngEvent(NamedTuple):
    """A read or write of a generator's state, before call ``at``.

    ``action`` is ``"save"`` (the state goes into ``slot``), ``"load"``
    (the state comes from ``slot``, or from ``state`` when that is set), or
    ``"seed"`` (slot -1, no state), a seed from the operating system
    (``torch.seed()``) that replay cannot repeat (Note [States that change
    unseen] in ``core/rngstate.py``).  ``stream`` is ``"cpu"``, ``"cuda:N"`` or
    ``"generator K"`` (``trace.generators[K]``).
    """

    at: int
    action: str
    stream: str
    slot: int
    state: torch.Tensor | None = None


# Traces of format 3 and earlier wrote every explicit generator as this
# string, without its state: replay cannot know what it drew.
OLD_GENERATOR = "<generator>"


def is_generator(x) -> bool:
    """An explicit generator argument, recorded now or by an older version."""
    return type(x) is GeneratorRef or (type(x) is str and x == OLD_GENERATOR)
