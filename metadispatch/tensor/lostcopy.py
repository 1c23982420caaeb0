"""A real tensor's values copied into a MetaTensor outside any mode: kept by nothing, said so.

Note [Copying real values into a MetaTensor outside a mode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A model built under a MetaMode holds MetaTensors, which hold no data; once
the mode has exited, nothing records what is done to them.  So
``model.load_state_dict(checkpoint)`` -- ``param.copy_(real)`` for each key
-- copied nothing, reported "All keys matched", and ``md.materialize`` then
gave the random initialisation.  torch's ``meta`` device warns for this very
call; a MetaTensor answers ``is_meta`` False (its device is the logical one),
so torch's check never fires.  ``aten.copy_`` of a real tensor into a
MetaTensor with no mode entered therefore warns, with torch's words and key
when ``load_state_dict`` is the caller, and says what keeps the values:
``assign=True`` (the module then holds the checkpoint's tensors), or loading
inside the mode (Note [torch.load inside a MetaMode] in mode/realcode.py).
Under ``-W error`` the warning is an exception inside ``load_state_dict``'s
copy, which torch reports as an error in loading the state dict.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

import torch

from .tensor import MetaTensor

__all__ = ["warn_if_lost"]

_COPY = torch.ops.aten.copy_.default
_LOADER = "_load_from_state_dict"


def warn_if_lost(func, args) -> None:
    """Warn when ``func`` is ``copy_`` of a real tensor's values into a MetaTensor (no mode entered)."""
    if func is not _COPY or len(args) < 2:
        return
    dst, src = args[0], args[1]
    if not isinstance(dst, MetaTensor) or not isinstance(src, torch.Tensor) or isinstance(src, MetaTensor):
        return
    if src.is_meta:
        return  # nothing to lose
    key = _state_dict_key()
    where = (
        f"for {key}: copying from a non-meta parameter in the checkpoint to" if key else "copying a real tensor into"
    )
    warnings.warn(
        f"{where} a MetaTensor ({dst.dtype} {list(dst.shape)} on {dst._md.device}) outside a MetaMode, "
        "which is a no-op: a MetaTensor holds no data and nothing records the copy, so md.materialize "
        "will not give these values (Note [Copying real values into a MetaTensor outside a mode]). "
        "Did you mean to pass `assign=True` to load_state_dict, or to load inside the MetaMode?",
        UserWarning,
        stacklevel=_user_level(),
    )


def _state_dict_key() -> str | None:
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):  # Module._load_from_state_dict is a few frames above the dispatch
        if frame is None:
            return None
        if frame.f_code.co_name == _LOADER and isinstance(frame.f_locals.get("key"), str):
            return frame.f_locals["key"]
        frame = frame.f_back
    return None


def _user_level() -> int:
    """The stack level of the first frame outside torch and metadispatch."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and "/metadispatch/" not in name:
            return level
        frame, level = frame.f_back, level + 1
    return 1
