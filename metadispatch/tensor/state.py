"""What metadispatch keeps on a MetaTensor: one :class:`TensorState`.

Note [A MetaTensor's state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every MetaTensor carries one object, ``t._md``, made with it by ``wrap``.
It used to carry up to eight separate ``_md*`` attributes, set and tested
with ``"_md_name" in t.__dict__`` from a dozen modules; one object with
named fields says in one place what a MetaTensor knows, costs one slot
read where the recorder used to build a tuple per output, and is skipped
as a whole where a tensor's attributes are copied (``key.startswith("_md")``
in ``__deepcopy__`` and stand-in wiring).

* ``device``: the logical device (Note [Logical device] in tensor.py);
* ``recorder``, ``meta``, ``call``: the recorder that numbered it, its
  current ``TensorMeta`` and the index of the recorded call that last wrote
  it (None for a leaf) -- all None until a trace numbers it
  (core/record.py);
* ``name``: ``(kind, name)`` once ``md.trace`` or a stand-in names it
  (``("param", "fc.weight")``);
* ``known``: ``(value, cell)``, its real value (Note [Known values] in
  values/known.py); ``bounds`` and ``drawn``: what is known of its range
  (Note [Value bounds] in values/bounds.py);
* ``user_device``: the device of the user's tensor it stands in for, where
  that differs from the logical one (values/composites.py);
* ``pinned_by``: the factory that made it as a page-locked buffer, to be
  filled through its address (Note [A pinned buffer's address] in
  mode/swap.py).
"""

from __future__ import annotations

import torch

__all__ = ["TensorState", "state_of"]


class TensorState:
    __slots__ = ("device", "recorder", "meta", "call", "name", "known", "bounds", "drawn", "user_device", "pinned_by")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.recorder = None
        self.meta = None
        self.call = None
        self.name: tuple | None = None
        self.known: tuple | None = None
        self.bounds = None
        self.drawn: tuple | None = None
        self.user_device: torch.device | None = None
        self.pinned_by: str | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__ if getattr(self, k) is not None)
        return f"TensorState({fields})"


def state_of(t) -> TensorState | None:
    """``t``'s state if ``t`` is a MetaTensor (any object: real tensors and others have none)."""
    d = getattr(t, "__dict__", None)
    return d.get("_md") if d is not None else None
