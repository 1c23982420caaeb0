"""The reduced losses' rule (rules/losses.py) against eager CPU on mismatched shapes."""

import itertools
import warnings

import pytest
import torch

import metadispatch as md

aten = torch.ops.aten
_SHAPES = [(3, 4), (4,), (1, 4), (3, 1), (2, 4), (4, 3), (12,), (), (3, 4, 1), (1,)]
_LOSSES = [aten.mse_loss.default, aten.smooth_l1_loss.default, aten.binary_cross_entropy.default]
_LOSSES += [aten.soft_margin_loss.default]


def _call(op, x, t, reduction, weight=None):
    if op is aten.binary_cross_entropy.default:
        return op(x, t, weight, reduction)
    return op(x, t, reduction)


def _outcome(op, *args):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecated resize of the squeezed output
            out = _call(op, *args)
    except RuntimeError as e:
        return type(e), None
    return None, (tuple(out.shape), out.dtype, out.untyped_storage().nbytes())


@pytest.mark.parametrize("op", _LOSSES, ids=lambda op: op.__name__)
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_loss_kernel_refuses_the_shapes_eager_refuses(op, reduction):
    # Note [The shapes a loss kernel refuses]: eager CPU raises iff the trace
    # does, and where neither does, shape, dtype and storage bytes agree.
    weights = [None, (4,), (3, 4), (2, 1)] if op is aten.binary_cross_entropy.default else [None]
    refused = 0
    for a, b in itertools.product(_SHAPES[:4], _SHAPES):
        for w in weights:
            g = torch.Generator().manual_seed(0)
            x, t = torch.rand(a, generator=g), torch.rand(b, generator=g)
            wt = torch.rand(w, generator=g) if w is not None else None
            eager = _outcome(op, x, t, reduction, wt)
            with md.MetaMode():
                traced = _outcome(op, x, t, reduction, wt)
            assert traced == eager, (a, b, w)
            refused += eager[0] is not None
    if op in (aten.binary_cross_entropy.default, aten.soft_margin_loss.default):
        assert refused  # the grid holds shapes each kernel refuses


def test_loss_refusal_names_the_op_and_shapes():
    with md.MetaMode(), pytest.raises(RuntimeError, match=r"soft_margin_loss.*input \[4\] and target \[3, 4\]"):
        torch.nn.functional.soft_margin_loss(torch.rand(4), torch.rand(3, 4))
