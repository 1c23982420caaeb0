"""Normalisation ops: the dtype of saved statistics follows the device.

torch's meta kernels for layer and batch norm return the saved mean and
inverse standard deviation in float32 for bfloat16/float16 inputs -- what
the CUDA kernels do.  The CPU kernels return them in the input's dtype.  For
a MetaTensor on a logical CPU device the CPU behaviour wins; other devices
keep the meta kernel's answer.  In eval mode the CPU batch-norm kernels
save no statistics at all (empty outputs).

Group norm's output keeps the input's memory format on CPU (Note [Group
norm keeps channels-last]), and so do the input gradients of batch and group
norm (Note [Norm gradients follow the input]); layer norm's input gradient is
contiguous (Note [Layer-norm gradients are contiguous]).
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
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
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


def _grad_input_like_input(out, x):
    """Note [Norm gradients follow the input]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The CPU backward kernels of batch norm (``batch_norm_backward_cpu``) and
    group norm (``native_group_norm_backward``) allocate the input gradient
    with ``empty_like(X, X.suggest_memory_format())``: channels-last when
    the input is, contiguous otherwise, whatever the incoming gradient's
    layout.  torch's meta functions are decompositions whose result follows
    ``grad_output`` instead (a contiguous gradient of a channels-last input
    in eval mode, or a channels-last gradient of a contiguous input), and
    the group-norm one cannot even view a permuted gradient.  Other devices
    keep the meta answer.
    """
    fmt = _compat.suggest_memory_format(x)
    if out[0] is None or out[0].is_contiguous(memory_format=fmt):
        return out
    return (torch.empty_like(out[0], memory_format=fmt), *out[1:])


@builtin_rule(aten.native_batch_norm_backward.default)
def batch_norm_backward(grad, x, *args, fallback):
    """Note [Batch-norm gradients the mask leaves out]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    torch's meta function (``meta_batch_norm_backward`` through its
    decomposition) returns all three gradients whatever ``output_mask``
    says.  The CPU kernel (``batch_norm_backward_cpu_template``) allocates
    only the ones asked for and leaves the rest undefined.  Autograd asks
    for no input gradient whenever the input needs none (``BatchNorm1d`` on
    data), so a defined record made replay report "output 0: defined
    expected tensor, got NoneType" there, and md.memory counted a tensor the
    kernel never allocates.  On a logical CPU the answer is None where the
    mask is off.  ``batch_norm_backward_cuda``'s source reads the same, but
    other devices keep torch's meta answer until a real GPU run checks it.
    """
    out = fallback(grad, x, *args)
    if x.device.type != "cpu":
        return out
    out = _grad_input_like_input(out, x)
    return tuple(o if wanted else None for o, wanted in zip(out, args[-1]))


@builtin_rule(aten.native_group_norm_backward.default)
def group_norm_backward(grad, x, *args, fallback):
    if x.device.type != "cpu":
        return fallback(grad, x, *args)
    # The decomposition views the gradient; give it one it can view (the
    # layout is fixed below, the statistics do not depend on it).
    fmt = _compat.suggest_memory_format(x)
    return _grad_input_like_input(fallback(grad.contiguous(memory_format=fmt), x, *args), x)


@builtin_rule(aten.native_layer_norm_backward.default)
def layer_norm_backward(grad, x, *args, fallback):
    """Note [Layer-norm gradients are contiguous]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``layer_norm_backward_cpu`` makes its input contiguous and allocates the
    input gradient ``empty_like(X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``: row
    major whatever the incoming gradient's layout.  torch's meta answer (a
    decomposition, which FakeTensorMode gives too) follows ``grad_output``,
    so a permuted gradient -- Swin's final norm, whose output is permuted
    to channels first for the pooling -- came out permuted, and the clone
    that follows was a copy eager never makes.  Other devices keep the meta
    answer (``layer_norm_backward_cuda`` reads the same, unchecked on a GPU).
    """
    out = fallback(grad, x, *args)
    if x.device.type != "cpu" or out[0] is None or out[0].is_contiguous():
        return out
    return (torch.empty_like(out[0], memory_format=torch.contiguous_format), *out[1:])
