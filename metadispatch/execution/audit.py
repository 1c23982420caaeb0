"""``md.audit``: after a model was loaded (any way), what is still not right.

Loading a meta-built model goes wrong silently: ``load_state_dict(assign=True)``
gives a tied head its own tensor, ``to_empty`` leaves non-persistent buffers
(a rotary ``inv_freq``) holding whatever memory held, a key the checkpoint
lacked stays on ``meta``.  The audit reports:

- *on meta*: parameters and buffers still on ``meta`` (plain or MetaTensors);
- *broken ties*: names meant to share one tensor that no longer do.  The
  ties meant are the ``reference``'s (a copy built the same way under
  ``md.MetaMode``, whose tied names hold one MetaTensor), else what the model
  declares: a transformers model's ``get_expanded_tied_weights_keys()``,
  which reads its config's ``tie_word_embeddings``;
- *uninitialised buffers*: where it is knowable, that is with a
  ``reference``: each non-persistent buffer is computed from the reference's
  construction trace (only the calls it needs) and compared, bit for bit,
  with the model's.  Persistent entries are the checkpoint's business:
  ``md.checkpoint.check`` says which the checkpoint holds.

Note [A tie is one object]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``load_state_dict(assign=True)`` of a ``torch.save`` file that stored a tie
once gives each name its own ``Parameter`` over the one storage: the
values agree, but ``parameters()`` lists both, so an optimizer keeps two
states and applies two updates to the same memory.  So tied parameters
count as tied only when they are one object; buffers (never optimised)
when they view the same memory the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint.check import ties
from ..tensor.tensor import MetaTensor
from .materialize import construct

__all__ = ["audit", "Audit"]


@dataclass(frozen=True)
class Audit:
    """What :func:`audit` found; ``ok`` when nothing."""

    on_meta: tuple[str, ...]
    uninitialised: tuple[str, ...]
    broken_ties: tuple[tuple[str, ...], ...]

    @property
    def ok(self) -> bool:
        return not (self.on_meta or self.uninitialised or self.broken_ties)

    def lines(self) -> list[str]:
        """One line per finding, or ``["ok"]``."""
        out = [f"on meta: {n}" for n in self.on_meta]
        out += [f"uninitialised: {n} (differs from what construction computes)" for n in self.uninitialised]
        out += [f"broken tie: {', '.join(g)}" for g in self.broken_ties]
        return out or ["ok"]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def audit(model: nn.Module, reference: nn.Module | None = None) -> Audit:
    """Parameters and buffers left on meta, broken ties and (with ``reference``) uninitialised buffers.

    >>> import torch, metadispatch as md
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(3, 2)
    >>> model.load_state_dict({"weight": torch.ones(2, 3)}, strict=False, assign=True)
    _IncompatibleKeys(missing_keys=['bias'], unexpected_keys=[])
    >>> print(md.audit(model))
    on meta: bias
    """
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **_buffers(model)}
    on_meta = tuple(n for n, t in tensors.items() if t.is_meta or isinstance(t, MetaTensor))
    groups = ties(reference) if reference is not None else _declared_ties(model)
    broken = tuple(g for g in groups if all(n in tensors for n in g) and not _shared(tensors, g))
    return Audit(on_meta, _uninitialised(model, reference, set(on_meta)) if reference else (), broken)


def _buffers(model: nn.Module) -> dict:
    return dict(model.named_buffers(remove_duplicate=False))


def _declared_ties(model: nn.Module) -> list[tuple[str, ...]]:
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    declared = expand() if callable(expand) else {}
    return [(source, target) for target, source in (declared or {}).items()]


def _shared(tensors: dict, group: tuple) -> bool:
    first = tensors[group[0]]
    return all(_same(first, tensors[n]) for n in group[1:])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if isinstance(a, nn.Parameter) or isinstance(b, nn.Parameter):
        return False  # two Parameters over one storage: an optimizer updates each (Note [A tie is one object])
    if a.is_meta or b.is_meta or isinstance(a, MetaTensor) or isinstance(b, MetaTensor):
        return False  # distinct meta tensors share nothing
    key = (a.device, a.untyped_storage().data_ptr(), a.storage_offset(), a.shape, a.stride(), a.dtype)
    return key == (b.device, b.untyped_storage().data_ptr(), b.storage_offset(), b.shape, b.stride(), b.dtype)


def _uninitialised(model: nn.Module, reference: nn.Module, on_meta: set) -> tuple[str, ...]:
    state = set(model.state_dict(keep_vars=True))
    wanted = {
        n: t
        for n, t in _buffers(reference).items()
        if n not in state and isinstance(t, MetaTensor) and n not in on_meta
    }
    real = construct(wanted, "cpu")
    mine = _buffers(model)
    found = []
    for n, t in wanted.items():
        have = mine.get(n)
        value = real[id(t)]
        if have is None or have.shape != value.shape or not torch.equal(have.detach().cpu(), value):
            found.append(n)
    return tuple(found)
