"""torch's Python-level functions no mode sees, guarded while a MetaMode is entered.

Note [Functions no mode sees]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A few of torch's functions act in Python before any op reaches a mode, and
their failure on a MetaTensor came as a bare error from inside torch, after
harm was done.  While a MetaMode is entered they are wrapped (and restored
on exit, an outer mode's wrapping kept): ``torch.save`` (Note [torch.save
inside a traced step]) and the constructors of lazy modules' uninitialised
tensors (Note [Lazy modules built inside a MetaMode]).  The wrapping is
process-wide, so each wrapper first asks whether its own thread has a
MetaMode entered (``WIRING``) and is torch's function where it has not.
Code that took one into another name before the mode was entered is not
reached.

Note [torch.save inside a traced step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A training step that checkpoints (``torch.save(model.state_dict(), path)``)
hands ``torch.save`` stand-ins, which hold no data: there is nothing to
write, and no faithful answer.  torch opens (creates or truncates) the file
first and pickles after, so the pickler's refusal of a MetaTensor came as a
bare ``TypeError`` from inside ``torch.serialization`` -- with the user's
checkpoint already replaced by a broken one.  While a MetaMode is entered,
``torch.save`` (and ``torch.serialization.save``) first pickles the object
into nothing, every tensor replaced by a placeholder, to find a tensor in
it; finding one, it raises :class:`UnsupportedFeatureError` naming the
call, the tensor and the user's line, having written nothing.  A real
tensor is refused too: the step's ops act on its stand-in (Note [Swap above
autograd] in mode.py), so what eager would write at that point -- the
values after the step's in-place updates -- is not known, and writing the
values from before would put a wrong checkpoint on disk.  An object without
tensors is saved by torch's own function, as eager would.  Code that took
``torch.save`` into another name before the mode was entered still reaches
the pickler's ``TypeError`` (tensor.py).
"""

from __future__ import annotations

import pickle
import sys

import torch
from torch import nn

from .. import _compat
from ..errors import UnsupportedFeatureError, mark_call
from ..source import user_frame
from ..tensor.tensor import MetaTensor

__all__ = ["PATCHES", "WIRING"]

_TORCH: dict = {}  # what the wrappers call: torch's functions as they were when installed
_LAZY = (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)


class _Wiring:
    """``active()``: whether a MetaMode is entered on this thread (set by mode.py).

    The wrappers are process-wide while any thread has a mode entered; a
    thread without one gets torch's own functions.
    """

    active = staticmethod(lambda: False)


WIRING = _Wiring()


class _Found(Exception):
    def __init__(self, tensor) -> None:
        super().__init__()
        self.tensor = tensor


class _Probe(pickle.Pickler):
    """Pickles into nothing; raises :class:`_Found` at the first tensor or storage, before copying its data."""

    def persistent_id(self, obj):
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            raise _Found(obj)
        return None


class _Discard:
    def write(self, data) -> int:
        return len(data)


def _save(obj, f, *args, **kwargs):
    if not WIRING.active():
        return _TORCH["save"](obj, f, *args, **kwargs)
    why = None
    try:
        _Probe(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except _Found as found:
        why = _why(found.tensor)  # only the words: the exception's frames hold the object
    except Exception:
        pass  # not picklable for another reason: torch's save says so, as in eager
    if why is None:
        return _TORCH["save"](obj, f, *args, **kwargs)
    error = UnsupportedFeatureError(
        f"torch.save({_target(f)}): the object holds {why}; nothing was written "
        "(Note [torch.save inside a traced step]). Save outside the traced step, or skip saving "
        "while tracing; md.materialize gives real tensors, trace.save the trace"
    )
    mark_call(error, "torch.save", user_frame())
    raise error


def _why(t) -> str:
    if isinstance(t, MetaTensor):
        return f"a MetaTensor ({t.dtype} {list(t.shape)} on {t._md.device}), which holds no data, so there is nothing to write"
    if isinstance(t, torch.Tensor):
        return (
            f"a real tensor ({t.dtype} {list(t.shape)}) whose value at this point of the step is not known: "
            "the traced ops act on its stand-in"
        )
    return "a storage, whose value at this point of the step is not known"


def _target(f) -> str:
    return repr(str(f)) if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__") else type(f).__name__


def _uninitialised(cls, *args, **kwargs):
    """Note [Lazy modules built inside a MetaMode]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A lazy module (``nn.LazyLinear``) made inside a MetaMode makes its
    ``UninitializedParameter`` from a MetaTensor, which that class cannot
    wrap: torch failed deep inside ``Parameter.__new__``, and a module that
    got through would materialise on its first forward into tensors the trace
    cannot name.  While a mode is entered in this thread the constructors of
    ``UninitializedParameter`` and ``UninitializedBuffer`` raise
    ``UnsupportedFeatureError`` naming the module and the user's line instead.
    A lazy module built before the mode traces as its first eager forward
    runs (Note [Lazy modules under a trace] in standins/standins.py).
    """
    if not WIRING.active() or not _compat.torch_function_enabled():
        # another thread's, or metadispatch's own stand-in for a lazy module built
        # before the mode (Note [Lazy modules under a trace] in standins/standins.py)
        return _TORCH[cls](cls, *args, **kwargs)
    module = _lazy_module_being_built()
    what = f"nn.{type(module).__name__}" if module is not None else cls.__name__
    becomes = getattr(module, "cls_to_become", None)
    instead = f"nn.{becomes.__name__}" if isinstance(becomes, type) else "the module it becomes"
    error = UnsupportedFeatureError(
        f"{what}: a lazy module's {cls.__name__} cannot be built inside a MetaMode "
        "(Note [Lazy modules built inside a MetaMode]). Build the lazy module before entering the mode "
        "-- its first forward inside the mode or md.trace records the materialisation -- or use "
        f"{instead} with its input size"
    )
    mark_call(error, f"{cls.__name__}.__new__", user_frame())
    raise error


def _lazy_module_being_built():
    frame = sys._getframe(2)
    for _ in range(8):  # the module's __init__ is a few frames up
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, nn.modules.lazy.LazyModuleMixin):
            return candidate
        frame = frame.f_back
    return None


def _patch(key, fn):
    def make(below):
        _TORCH[key] = below.__func__ if isinstance(below, staticmethod) else below
        return fn

    return make


# (owner, attribute, make, why): the ledger's rows (mode/ledger.py).
PATCHES = [
    (torch, "save", _patch("save", _save), "torch.save of MetaTensors, refused (Note [Functions no mode sees])"),
    (torch.serialization, "save", _patch("save", _save), "torch.serialization.save, the same"),
    *[
        (
            cls,
            "__new__",
            _patch(cls, _uninitialised),
            "lazy modules built in the mode (Note [Lazy modules built inside a MetaMode])",
        )
        for cls in _LAZY
    ],
]
