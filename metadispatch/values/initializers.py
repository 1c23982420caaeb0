"""Data-dependent initialisers, recorded as one call while a MetaMode is entered.

``torch.nn.init``'s truncated normal loops until its samples are in range
(Note [Data-dependent initialisers] in ``spec/ownops.py``).  While at least one
MetaMode is entered, ``torch.nn.init._no_grad_trunc_normal_`` -- the body
that ``nn.init.trunc_normal_`` and every library calling it reach, however
they imported it -- is replaced by :func:`_trunc_normal_`, which sends a
MetaTensor to ``metadispatch::trunc_normal_`` and anything else to torch's
body unchanged, so other threads and real tensors see torch's behaviour.  The
attribute is restored when the last mode exits (counted across threads, and
interrupt-safe as the other entry steps: Note [Interrupts in mode entry and
exit] in mode.py).

Limits: a MetaTensor initialised outside any mode still reaches torch's body
and its data-dependent ``.item()``; initialisers of other libraries that
loop on values (none known in timm, transformers or diffusers: timm's
``trunc_normal_`` is ``erfinv``-based) are not rerouted.
"""

from __future__ import annotations

import warnings

import torch

from .. import _compat
from ..spec.ownops import TRUNC_NORMAL_BODY, trunc_normal_op
from ..tensor.tensor import MetaTensor

__all__ = ["PATCHES"]


def _trunc_normal_(tensor, mean, std, a, b, generator=None):
    if not isinstance(tensor, MetaTensor):
        return TRUNC_NORMAL_BODY(tensor, mean, std, a, b, generator=generator)
    if (mean < a - 2 * std) or (mean > b + 2 * std):  # the warning torch's body gives
        warnings.warn(
            "mean is more than 2 std from [a, b] in nn.init.trunc_normal_. "
            "The distribution of values may be incorrect.",
            stacklevel=3,
        )
    with torch.no_grad():
        trunc_normal_op()(tensor, float(mean), float(std), float(a), float(b), generator)
    return tensor


def _make(below):
    trunc_normal_op()  # define the op before the first call needs it
    return _trunc_normal_


# (owner, attribute, make, why): the ledger's row (mode/ledger.py).
PATCHES = [
    (
        torch.nn.init,
        _compat.TRUNC_NORMAL_BODY_NAME,
        _make,
        "nn.init.trunc_normal_ on a MetaTensor, recorded as one call (Note [Data-dependent initialisers])",
    )
]
