"""A recording MetaMode that answers data-dependent reads as ``md.check`` does.

For steps whose memory does not depend on the values they read: Adafactor
scales its update by ``param.norm().item()`` (torch/optim/_adafactor.py),
a number that changes no shape and no allocation.  ``md.tracer(mode_factory=
lambda: guessing_mode(...))`` traces it; each read is answered with a
made-up value (Note [Made-up values under md.check] in check.py) and kept
as an assumption in ``mode.guesses.assumptions``.  Limits: a step whose
shapes follow such a value (``nonzero``, a loop on ``.item()``) is traced
for the made-up value, which ``md.check`` reports.
"""

from __future__ import annotations

from ..mode.mode import MetaMode
from .check import DEFAULT_LIMIT, _policy, _State

__all__ = ["guessing_mode"]


def guessing_mode(
    device=None, *, gpu=None, world_size: int | None = None, rank: int = 0, limit=DEFAULT_LIMIT, values=None
) -> MetaMode:
    """A MetaMode whose ``.item()`` and other data-dependent calls run on made-up values.

    >>> import torch, metadispatch as md
    >>> from metadispatch.debug.guessing import guessing_mode
    >>> t = md.tracer(mode_factory=guessing_mode)(lambda x: x * float(x.sum()), torch.ones(3))
    >>> [c.op for c in t]
    ['aten.sum.default', 'aten._local_scalar_dense.default', 'aten.mul.Tensor']
    """
    mode = MetaMode(device=device, gpu=gpu, world_size=world_size, rank=rank)
    state = _State(mode, limit, _policy(values))
    mode.fallback, mode.read_fallback = state.fallback, state.read
    mode.guesses = state  # type: ignore[attr-defined]  (its assumptions, as md.check reports them)
    return mode
