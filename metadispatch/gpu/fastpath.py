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

import sys

import torch
from torch import nn

from .. import _compat
from ..tensor.tensor import MetaTensor

__all__ = ["PATCHES"]

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
    # The caller is two frames up: the ledger's dispatcher is between (Note [The ledger]).
    if sys._getframe(2).f_code in _FORWARDS:
        return any(_overridden(a) for a in args)
    return _TORCH["has_torch_function"](args)


def _make(below):
    _TORCH["has_torch_function"] = below
    return _has_torch_function


# (owner, attribute, make, why): the ledger's row (mode/ledger.py).
PATCHES = [
    (
        torch.overrides,
        "has_torch_function",
        _make,
        "the attention modules' fast-path check answers as eager for MetaTensors (Note [Inference fast paths])",
    )
]
