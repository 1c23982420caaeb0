"""``torch.tensor(data, device=D)`` as C++ builds it for a device: one ``lift_fresh`` on ``D``.

Note [A literal made on a device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
C++ (``internal_new_from_data``) builds a literal on the CPU, copies it to
``D`` below the dispatcher and lifts it there: a real GPU run dispatches one
``lift_fresh`` whose output is on ``D``.  Under a mode that sets
``only_lift_cpu_tensors`` (MetaMode, as FakeTensorMode) C++ lifts the CPU
tensor and then moves it with a ``_to_copy`` the GPU never dispatches:
transformers' caches (``torch.tensor([], device=...)`` per layer) recorded
two at every attention layer on a logical H100 (tools/gpu_conformance.py
against a real one).  So a literal of plain data (no tensors in it) asked
for a device other than the CPU is built for real outside the trace, stood in
for on ``D`` and lifted there.  The device follows the mode's rule for
factories (Note [A factory's named device] in mode/devices.py): a mode with a
device puts a literal there unless it names another device type (one
named ``"cpu"`` is built here too, on the CPU, where C++ would lift it
onto the mode's device).

Note [Optimizer step counters on the CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Unless ``capturable`` or ``fused``, torch's optimizers keep each parameter's
step counter on the CPU (Adam's ``torch.tensor(0.0, dtype=..., device="cpu")``;
a counter loaded from a state dict has no device, so torch's default device),
whatever the parameters' device, and branch on it: Adam's foreach step adds
``torch.tensor(1.0, device="cpu")`` to CPU counters, one ``lift_fresh`` more
than the ``_foreach_add_`` of a number GPU counters take.  A mode with a
device would put both literals on it, so a logical GPU recorded a program a
GPU does not run (an H100's dispatch log of AdamW had the CPU counters and
the extra op).  So a literal that ``torch.optim``'s own code makes with no
device (while torch's default device is the CPU), or on the CPU, stays on
the CPU.
"""

from __future__ import annotations

import sys
import types

import torch

from .. import _compat
from .._compat import pytree
from ..errors import DataDependentError, mark_call
from ..source import user_frame
from ..tensor.describe import data_dependent_message
from ..tensor.tensor import MetaTensor, normalize_device, read_value

aten = torch.ops.aten
_CPU = torch.device("cpu")
LITERALS = {torch.tensor, torch.as_tensor}


def as_tensor_call(args, kwargs) -> tuple:
    """``x.new_tensor(data, ...)`` as the ``torch.tensor`` call it is: ``x``'s dtype and device unless named
    (Note [new_tensor is a literal] in mode/devices.py)."""
    x, data = args[0], args[1] if len(args) > 1 else kwargs.get("data")
    named = {k: v for k, v in kwargs.items() if v is not None and k != "data"}
    return torch.tensor, (data,), {"dtype": x.dtype, "device": x.device, **named}


# Note [Tensors inside a literal]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.tensor([x.sum(), 3.0])``: C++ (``recursive_store``) reads each
# tensor of the list through its data pointer, below the dispatcher -- an
# eager run dispatches the one ``lift_fresh`` (a TorchDispatchMode's log of
# it).  A MetaTensor has no data there: torch raised from inside C++ ("data is
# not allocated yet"), as it does under FakeTensorMode.  So C++ is handed each
# MetaTensor of the list as its known value, a real tensor of its dtype (which
# C++'s dtype inference reads); one whose value is not known is a
# DataDependentError naming ``torch.tensor``.  ``torch.tensor(t)`` of one
# tensor is dispatched (detach, _to_copy) and needs nothing here.
def with_values(func, args: tuple) -> tuple:
    """``args`` of ``torch.tensor``/``as_tensor`` with the MetaTensors in a list of data replaced by their values."""
    data = args[0] if args else None
    if type(data) not in (list, tuple) or not _has_meta(data):
        return args

    def value(x):
        if type(x) is not MetaTensor:
            return x
        v = read_value(x)
        if v is None:
            name = f"torch.{func.__name__}"
            e = DataDependentError(data_dependent_message(name, (data,), {}), op=name)
            mark_call(e, name, user_frame())
            raise e
        return v

    return (pytree.tree_map(value, data), *args[1:])


def _has_meta(data) -> bool:
    """Whether a MetaTensor is in the nested lists ``data`` (a list's element types taken in C: a literal may be long)."""
    kinds = set(map(type, data))
    if MetaTensor in kinds:
        return True
    return (list in kinds or tuple in kinds) and any(_has_meta(x) for x in data if type(x) in (list, tuple))


def applies(mode, func, args, kwargs) -> bool:
    """For ``func`` in LITERALS (the mode asks only for those): whether :func:`build` makes this call."""
    if not args:
        return False
    if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(args[0])):
        return False
    device = kwargs.get("device")
    if device is None:  # torch's default device: the CPU's counters unless set otherwise
        return _compat.default_device_type() == "cpu" and _optimizer_counter()
    if normalize_device(device).type == "cpu":
        # Note [A factory's named device] in mode/devices.py: on the CPU whatever the mode's device
        return mode.device is not None and mode.device.type != "cpu" or _optimizer_counter()
    return True


# Frames between the code that called torch.tensor and this module: ours,
# and other torch-function modes' (torch.device's).
_PASSING = ("metadispatch.", "torch.utils._device", "torch.overrides", "torch.utils._python_dispatch")


def _optimizer_counter() -> bool:
    # sys._getframe(3) is past this function, applies and the mode's
    # __torch_function__ (torch.tensor is C: it has no frame of its own).
    frame: types.FrameType | None = sys._getframe(3)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PASSING):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("torch.optim.")


def build(mode, func, args, kwargs):
    kwargs = dict(kwargs)
    device = kwargs.pop("device", None)
    requires_grad = kwargs.pop("requires_grad", False)
    kwargs.pop("pin_memory", None)
    if device is None or normalize_device(device).type == "cpu":
        # Note [Optimizer step counters on the CPU]
        device = _CPU
    elif mode.device is None or normalize_device(device).type == "meta":
        device = normalize_device(device)  # meta as named: Note [A factory's named device] in mode/devices.py
    elif torch.device(device).type == mode.device.type and torch.device(device).index is not None:
        device = normalize_device(device)  # an index the swap found on the logical machine
    else:
        device = mode.device
    with _compat.no_python_dispatch(), _compat.no_torch_function():
        real = func(*args, **kwargs)
    out = aten.lift_fresh.default(mode.constant_on(real, device))
    return out.requires_grad_() if requires_grad else out


# Note [A list as an index]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# ``x[:, [-1, 0]]`` (and ``x[:, [0, 1]] = v``): C++ turns the list into an index tensor with ``x``'s
# options (``sequenceToVariable``), below the dispatcher -- on the meta
# device for a MetaTensor, so the index reached the trace with no value
# and nothing read through it could be known (transformers' padding
# warning, ``pad in ids[:, [-1, 0]]``, on ids the trace knows).  So a list
# of ints among the indices is made that tensor here, for real, and stood
# in for on ``x``'s device, known, and lifted: the calls of a real run, one
# ``lift_fresh`` and the ``index.Tensor`` (a TorchDispatchMode's log of an
# eager run; the trace had the index alone before).  A list of bools
# is a mask, made a bool tensor as C++ makes it (its count of True is then
# known too).  Where ints, slices or None come before the first list
# (``x[0, [3, 2]]``), C++ applies them first (a select, ...) and then makes
# the index: so those are applied first here too (``x[0, ...]``), and the
# list then indexes what they leave, in the same order of calls -- when
# reading; a write (``x[0, [3, 2]] = v``) makes its value a tensor before
# any of them, so it is left to C++ there.  Other lists (mixed, nested;
# after a tensor or ``...``) are left to C++.
GETITEM = torch.Tensor.__getitem__


def has_int_list(index) -> bool:
    """Whether ``index`` (a ``__getitem__`` argument) is, or holds at its top level, a list of ints or bools
    that only full slices, ``...`` and such lists come before (C++ dispatches nothing for those: the index
    tensors made here are lifted where a real run lifts them)."""
    if type(index) is list:
        return _ints(index)
    if type(index) is not tuple:
        return False
    found = False
    for n, i in enumerate(index):
        if type(i) is list and _ints(i):
            found = True
        elif not (i is Ellipsis or _full(i)):
            return found and not any(type(j) is list and _ints(j) for j in index[n:])
    return found


_FULL = slice(None)


def _full(i) -> bool:
    """A slice C++ skips (the whole dimension, step 1): it dispatches nothing."""
    return type(i) is slice and i.start in (None, 0) and i.stop is None and i.step in (None, 1)


def basic_prefix(index) -> int | None:
    """Where ``index``'s first list of ints or bools is, if only ints, slices and None come before it, one
    of them not a full slice (those :func:`has_int_list` covers)."""
    if type(index) is not tuple:
        return None
    for n, i in enumerate(index):
        if type(i) is list:
            return n if _ints(i) and not all(_full(j) for j in index[:n]) else None
        if not (type(i) is int or type(i) is slice or i is None):
            return None
    return None


def index_after(mode, func, args, at: int):
    """``func(x, index, ...)`` as C++ runs it: ``index[:at]`` applied first, then the rest with its lists
    made known index tensors (Note [A list as an index])."""
    x, index = args[0], args[1]
    kept = sum(1 for i in index[:at] if type(i) is slice or i is None)  # the dims the prefix leaves before the list
    y = GETITEM(x, (*index[:at], Ellipsis))
    rest = (*(_FULL,) * kept, *index[at:])
    return func(y, index_lists(mode, y, rest) if has_int_list(rest) else rest, *args[2:])


def index_lists(mode, x, index):
    """``index`` with each list of ints or bools a known index tensor on ``x``'s device (Note [A list as an index])."""
    if type(index) is list:
        return _known_index(mode, x, index)
    return tuple(_known_index(mode, x, i) if type(i) is list and _ints(i) else i for i in index)


def _ints(items: list) -> bool:
    kind = type(items[0]) if items else None
    return kind in (int, bool) and all(type(i) is kind for i in items)


def _known_index(mode, x, items: list):
    with _compat.no_python_dispatch(), _compat.no_torch_function():
        real = torch.tensor(items, dtype=torch.bool if type(items[0]) is bool else torch.long)
    return aten.lift_fresh.default(mode.constant_on(real, x._md.device))
