"""``md.checkpoint.check``: does a checkpoint fit a model, read from headers only?

The model is built on ``meta`` or under ``md.MetaMode`` (a real model works
too: only shapes and dtypes are read).  Its state dict's keys are compared
with the checkpoint's (:func:`~metadispatch.checkpoint.index.inspect`):

- *missing*: in the model's state dict, not in the checkpoint -- except a
  tied alias whose tie has a member in the checkpoint (``save_pretrained``
  keeps one name of a tie; loading fills the others through the tie);
- *unexpected*: in the checkpoint, not in the model;
- *shape* mismatches (``load_state_dict`` raises on them) and *dtype*
  mismatches (``load_state_dict`` casts; ``assign=True`` takes the
  checkpoint's dtype);
- *stored twice*: a tie (one tensor under several names in the model)
  whose names the checkpoint holds as separate data: ``assign=True``
  unties them, a copying load keeps the last one silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .entries import Contents
from .index import inspect

__all__ = ["check", "Findings", "ties"]


@dataclass(frozen=True)
class Findings:
    """What :func:`check` found; ``ok`` when nothing."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    shape: tuple[tuple[str, tuple, tuple], ...]  # (name, model's shape, checkpoint's)
    dtype: tuple[tuple[str, object, object], ...]  # (name, model's dtype, checkpoint's)
    stored_twice: tuple[tuple[str, ...], ...]

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape or self.dtype or self.stored_twice)

    def lines(self) -> list[str]:
        """One line per finding, or ``["ok"]``."""
        out = [f"missing: {n}" for n in self.missing] + [f"unexpected: {n}" for n in self.unexpected]
        out += [f"shape: {n}: model {list(a)}, checkpoint {list(b)}" for n, a, b in self.shape]
        out += [f"dtype: {n}: model {a}, checkpoint {b}" for n, a, b in self.dtype]
        out += [f"stored twice: {', '.join(g)} (tied in the model)" for g in self.stored_twice]
        return out or ["ok"]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def ties(model: nn.Module) -> list[tuple[str, ...]]:
    """The model's state-dict names that hold one tensor, as groups of two or more."""
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    return [tuple(g) for g in groups.values() if len(g) > 1]


def check(model: nn.Module, checkpoint) -> Findings:
    """Compare ``model``'s state dict with a checkpoint's headers (a path or :class:`Contents`).

    >>> import tempfile, os, torch, metadispatch as md
    >>> path = os.path.join(tempfile.mkdtemp(), "m.pt")
    >>> torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(3, 4)
    >>> print(md.checkpoint.check(model, path))
    shape: weight: model [4, 3], checkpoint [2, 3]
    shape: bias: model [4], checkpoint [2]
    """
    contents = checkpoint if isinstance(checkpoint, Contents) else inspect(checkpoint)
    stored = contents.tensors
    state = model.state_dict(keep_vars=True)
    groups = ties(model)
    covered = {n for g in groups if any(m in stored for m in g) for n in g}
    missing = tuple(n for n in state if n not in stored and n not in covered)
    unexpected = tuple(n for n in stored if n not in state)
    shape, dtype = [], []
    for name, t in state.items():
        e = stored.get(name)
        if e is None:
            continue
        if tuple(t.shape) != e.shape:
            shape.append((name, tuple(t.shape), e.shape))
        elif t.dtype != e.dtype:
            dtype.append((name, t.dtype, e.dtype))
    twice = []
    for g in groups:
        present = [stored[n] for n in g if n in stored]
        if any(not present[0].same_data(e) for e in present[1:]):
            twice.append(tuple(e.name for e in present))
    return Findings(missing, unexpected, tuple(shape), tuple(dtype), tuple(twice))
