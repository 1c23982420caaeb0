"""Tracing the inference fast paths of attention modules, as eager takes them.

Note [Inference fast paths]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.TransformerEncoder`` run a fused kernel in inference
(``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``)
unless, among other things, ``torch.overrides.has_torch_function`` says an
argument is overridden.  A MetaMode keeps a torch-function mode active
(``_SwapReal`` in mode.py), which makes that check true, so a traced module
took the general path while eager took the fused one: the trace was right
about shapes, but replay ran other kernels than eager and its values
differed in the last bits, while saying ok.

The fused kernels dispatch like any op, so MetaMode records them as eager
runs them.  While a recording MetaMode is entered, the module attribute
``torch.overrides.has_torch_function`` is wrapped: called from those
modules' ``forward`` -- and only there, by code identity -- it answers as
eager would for the arguments themselves (an overriding subclass still
says yes), ignoring the mode's own torch-function mode.  Every other
caller (higher-order operators, anything that imported the function
itself) gets torch's answer.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from .. import _compat
from ..tensor.tensor import MetaTensor

__all__ = ["install"]

_FORWARDS = frozenset(
    m.forward.__code__ for m in (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
)
_TORCH: dict = {}  # "has_torch_function" -> torch's function


def _overridden(arg) -> bool:
    """Whether ``arg``'s type overrides ``__torch_function__`` (what eager's check asks)."""
    t = type(arg)
    return (
        isinstance(arg, torch.Tensor)
        and t is not torch.Tensor
        and t is not MetaTensor  # its handler changes nothing under a mode (Note [Composite overrides without a mode])
        and getattr(t, "__torch_function__", _compat.disabled_torch_function) is not _compat.disabled_torch_function
    )


def _has_torch_function(args) -> bool:
    if sys._getframe(1).f_code in _FORWARDS:
        return any(_overridden(a) for a in args)
    return _TORCH["has_torch_function"](args)


def install(steps: list) -> None:
    """Wrap ``torch.overrides.has_torch_function``; append the undo to ``steps`` first."""
    current = torch.overrides.has_torch_function
    if current is _has_torch_function:
        return  # an outer mode did
    _TORCH.setdefault("has_torch_function", current)
    steps.append(functools.partial(setattr, torch.overrides, "has_torch_function", current))
    torch.overrides.has_torch_function = _has_torch_function
