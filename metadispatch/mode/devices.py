"""The device a factory or a move names, as a real job on the logical machine would answer it.

The swap (swap.py) hands these calls here: factories naming a device
(Note [A factory's named device]), ``*_like``/``new_*`` naming meta, and
``x.new_tensor`` (Note [new_tensor is a literal]), ``t.to``/``t.cuda`` to a
CUDA index.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import UnsupportedFeatureError, mark_call
from ..gpu import cuda_answers, inside
from ..source import user_frame
from ..tensor.tensor import STATE, MetaTensor, normalize_device

FACTORIES = _compat.device_constructors()


# Note [A factory's named device]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A mode with a device (``MetaMode(device="cuda")``) is torch's default
# device for the step: a factory given no device makes its tensor there.
# One given a device keeps it: ``torch.zeros(3, device="cpu")`` is a CPU
# tensor in a real CUDA job.  At the aten level the two look alike: torch's
# binding passes ``device=cpu`` for "no device given" too.  So the
# difference is made where ``torch.set_default_device`` makes it, at the
# torch-function level: the swap calls a factory of its ``DeviceContext``'s
# list (``_compat.device_constructors``) that names a device with
# ``STATE.named_device`` set, and only then does ``_device`` in
# core/dispatch.py keep the named device.  ``meta`` named there is meta, as
# under ``torch.set_default_device`` (``STATE.explicit_meta``, Note [Meta
# from options] there); another index of the mode's device type is kept if
# the logical machine has it, and refused naming the factory if not, as a
# real one-GPU job fails (``invalid device ordinal``).  On a host without
# CUDA that machine is the mode's GPU alone (``"cuda"`` names it, whatever
# its index), on a logical world each rank's.  Factories below a
# Python function torch runs for a function mode (``F.*``'s body) meet no
# function mode under ``torch.set_default_device``, nor in a real job that
# moved its model with ``.cuda()``: they make CPU tensors.  The swap sees
# inside such bodies on a logical GPU (Note [Seeing inside torch's Python
# functions] in inside.py), so it names CPU for a factory there that names
# no device.


def factory(mode, func, args, kwargs):
    if kwargs.get("device") is None and not inside.seeing_inside():
        out = func(*args, **kwargs)
    else:
        # Note [A factory's named device]
        if kwargs.get("device") is None:
            kwargs = dict(kwargs, device=_CPU)
        named, kwargs = on_checked_device(mode, func, kwargs)
        meta = named.type == "meta"
        # fmt: off
        prev = STATE.named_device, STATE.explicit_meta; STATE.named_device = True; STATE.explicit_meta = prev[1] or meta  # noqa: E702,E501 (Note [Interrupts in mode entry and exit])
        try: out = func(*args, **kwargs)  # noqa: E701
        finally: STATE.named_device, STATE.explicit_meta = prev  # noqa: E701
        # fmt: on
    if kwargs.get("pin_memory") and type(out) is MetaTensor:
        out._md.pinned_by = f"torch.{func.__name__}(..., pin_memory=True)"
    return out


# ``torch.empty_like(t, device="meta")``, ``t.new_zeros(n, device="meta")``:
# named from Python, meta means meta, as ``x.to("meta")`` does (the core
# gives a meta-optioned op with tensor inputs its inputs' device, which is
# right only for C++'s own options: Note [Meta from options]).
LIKE = frozenset(
    getattr(owner, name)
    for owner, names in (
        (torch, ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")),
        (torch.Tensor, ("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")),
    )
    for name in names
    if hasattr(owner, name)
)


def explicitly_meta(func, args, kwargs):
    prev, STATE.explicit_meta = STATE.explicit_meta, True
    try:
        return func(*args, **kwargs)
    finally:
        STATE.explicit_meta = prev


# Note [new_tensor is a literal]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``x.new_tensor(data)`` is ``torch.tensor(data)`` with ``x``'s dtype and
# device as defaults.  C++ builds it from ``x``'s options with Python
# dispatch excluded, so on a MetaTensor it made a plain meta tensor that no
# trace recorded, answering the logical device (``torch.tensor``'s literal
# path, Note [A literal made on a device], is the one that records it).
NEW_TENSOR = torch.Tensor.new_tensor
_CPU = torch.device("cpu")
TO_GPU = (torch.Tensor.to, torch.Tensor.cuda)


def move_checked(mode, func, args, kwargs):
    """``t.to(d)`` / ``t.cuda(i)`` with the CUDA device named checked as a factory's (``cuda:{local_rank}``
    is a logical world rank's own GPU; another index the one-GPU logical machine lacks is refused)."""
    at = "device" if "device" in kwargs else 1 if len(args) > 1 else None
    named = kwargs.get("device") if at == "device" else args[1] if at == 1 else None
    if func is torch.Tensor.cuda and type(named) is int:
        named = torch.device("cuda", named)
    if named is None or not isinstance(named, (str, int, torch.device)) or isinstance(named, bool):
        return args, kwargs
    if normalize_device(named).type != "cuda":
        return args, kwargs
    checked = check_index(mode, func, named)
    if at == "device":
        return args, dict(kwargs, device=checked)
    return (args[0], checked, *args[2:]), kwargs


def on_checked_device(mode, func, kwargs) -> tuple[torch.device, dict]:
    """The device named (``check_index``), and ``kwargs`` with the CUDA one the logical machine answers for it."""
    named = check_index(mode, func, kwargs["device"])
    return named, (dict(kwargs, device=named) if named.type == "cuda" else kwargs)


def check_index(mode, func, device) -> torch.device:
    """The device a factory named, refused if the logical machine has no such one (Note [A factory's named device])."""
    named, own, host = normalize_device(device), mode.device, cuda_answers.host_has_cuda()
    if own is None or named.type != own.type or named.index == own.index or named.type != "cuda":
        return named
    indexed = (
        type(device) is int or torch.device(device).index is not None
    )  # Note [An int device is the logical GPU's index] in tensor.py
    if mode.world is not None or not (host or indexed):
        return own  # each rank's own GPU, whichever index it is named by (cuda:{local_rank}); "cuda": the one GPU
    count = torch.cuda.device_count() if host else 1  # without CUDA the logical machine is the mode's GPU alone
    if host and named.index is not None and named.index < count:
        return named
    name = f"{'Tensor' if func in TO_GPU else 'torch'}.{getattr(func, '__name__', func)}"
    error = UnsupportedFeatureError(
        f"{name}(..., device={str(named)!r}): the logical machine of MetaMode(device={str(own)!r}) has "
        f"{count} CUDA device(s), {str(own)!r}; a real job there fails with 'invalid device ordinal' (Note "
        "[A factory's named device]). Name the mode's device, or trace with MetaMode() and no device"
    )
    mark_call(error, name, user_frame())
    raise error
