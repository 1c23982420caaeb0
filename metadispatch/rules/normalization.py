"""Normalisation ops: the dtype of saved statistics follows the device.

torch's meta kernels for layer and batch norm return the saved mean and
inverse standard deviation in float32 for bfloat16/float16 inputs -- what
the CUDA kernels do.  The CPU kernels return them in the input's dtype.  For
a MetaTensor on a logical CPU device the CPU behaviour wins; other devices
keep the meta kernel's answer.  In eval mode the CPU batch-norm kernels
save no statistics at all (empty outputs).

Group norm's output keeps the input's memory format on CPU (Note [Group
norm keeps channels-last]).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core.registry import builtin_rule

aten = torch.ops.aten

_REDUCED = (torch.bfloat16, torch.float16)


def _stats_in_input_dtype(out, x, training=True, weight=None):
    if x.device.type != "cpu" or (training and x.dtype not in _REDUCED):
        return out
    if training and weight is not None and weight.dtype != x.dtype:
        # A mixed-type call (bf16 input, fp32 weight: autocast) saves its
        # statistics in float on CPU too (``is_mixed_type`` in ATen).
        return out
    out = list(out)
    for i in (1, 2):
        if not training:
            # The CPU kernel saves no statistics in eval mode; the meta
            # kernel (CUDA's behaviour) does.
            out[i] = x.new_empty((0,))
        elif out[i].dtype != x.dtype and out[i].is_floating_point():
            out[i] = torch.empty_like(out[i], dtype=x.dtype)
    return tuple(out)


@builtin_rule(aten.native_layer_norm.default)
def layer_norm(x, normalized_shape, weight, *args, fallback, **kwargs):
    out = fallback(x, normalized_shape, weight, *args, **kwargs)
    return _stats_in_input_dtype(out, x, weight=weight)


@builtin_rule(aten._batch_norm_with_update.default)
def batch_norm_with_update(x, weight, *args, fallback, **kwargs):
    return _stats_in_input_dtype(fallback(x, weight, *args, **kwargs), x, weight=weight)


@builtin_rule(aten._native_batch_norm_legit_functional.default)
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, *args, fallback):
    out = fallback(x, weight, bias, running_mean, running_var, training, *args)
    out = _stats_in_input_dtype(out, x, training, weight)
    if x.device.type != "cpu":
        return out
    # outputs 3 and 4 are the updated running stats, in their own dtype on CPU
    new_stats = tuple(torch.empty_like(o, dtype=r.dtype) for o, r in zip(out[3:], (running_mean, running_var)))
    return out[:3] + new_stats


@builtin_rule(aten.native_batch_norm.default)
@builtin_rule(aten._native_batch_norm_legit.default)
def batch_norm_with_running_stats(x, weight, bias, running_mean, running_var, training, *args, fallback):
    out = fallback(x, weight, bias, running_mean, running_var, training, *args)
    return _stats_in_input_dtype(out, x, training, weight)


@builtin_rule(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(x, weight, bias, training, *args, fallback):
    return _stats_in_input_dtype(fallback(x, weight, bias, training, *args), x, training, weight)


@builtin_rule(aten.native_group_norm.default)
def group_norm(x, weight, bias, n, c, hxw, group, eps, *, fallback):
    """Note [Group norm keeps channels-last]

    The CPU kernel allocates its output in ``X.suggest_memory_format()``
    (``native_group_norm`` in ATen's group_norm.cpp; other devices:
    contiguous).  torch 2.13's meta function did the same; torch 2.14's
    returns a contiguous tensor for a channels-last input, so a diffusers
    UNet's group norms (channels-last activations) were recorded with the
    wrong strides.  The statistics are unaffected.
    """
    out = fallback(x, weight, bias, n, c, hxw, group, eps)
    if x.device.type != "cpu":
        return out
    fmt = _compat.suggest_memory_format(x)
    y = out[0]
    if y.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty_like(y, memory_format=fmt), *out[1:])


@builtin_rule(aten.native_group_norm_backward.default)
def group_norm_backward(grad_out, x, mean, rstd, weight, n, c, hxw, group, mask, *, fallback):
    """The CPU kernel allocates the input's gradient in ``X.suggest_memory_format()``
    too (Note [Group norm keeps channels-last]); torch 2.14's meta function
    follows the output gradient's strides instead.  They differ when the two
    disagree: a transposed 3-D ``X`` (a diffusers attention block's group
    norm) gets a contiguous gradient, a channels-last ``X`` with a
    contiguous ``grad_out`` a channels-last one.
    """
    out = fallback(grad_out, x, mean, rstd, weight, n, c, hxw, group, mask)
    dx = out[0]
    if x.device.type != "cpu" or dx is None:
        return out
    fmt = _compat.suggest_memory_format(x)
    if dx.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty_like(dx, memory_format=fmt), *out[1:])
