"""C++ composites that take another branch on a GPU, overridden for a logical one.

A logical GPU's MetaTensor is a meta tensor to C++ (Note [Logical device] in
tensor.py), so a composite that asks ``input.is_cuda()`` takes the branch
every other device takes: ops a GPU never runs, and their saved bytes.  Each
override here follows the CUDA branch of the C++ body it names, applies to
logical-GPU tensors only, and is registered with the MetaMode's
torch-function overrides (Note [Composite overrides] in composites.py);
calls inside torch's Python functions meet them too (Note [Seeing inside
torch's Python functions] in inside.py).  Checked against C++ on fake CUDA
tensors (tests/gpu/test_logical_gpu_composites.py, tests/gpu/test_logical_gpu_opdb.py).
"""

from __future__ import annotations

import torch

from .. import _compat
from ..tensor.tensor import MetaTensor
from ..values.composites import register_override

__all__: list[str] = []

aten = torch.ops.aten
_VF = _compat.variable_functions


# Note [Softmax of half to float on a GPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``softmax``/``log_softmax`` of a float16 CUDA tensor with ``dtype=float32``
# skip the cast: the C++ composite calls ``_softmax(x, dim, half_to_float=True)``
# when ``input.is_cuda()`` (SoftMax.cpp), where every other device casts
# first.  A logical GPU's MetaTensor is meta to C++, so the composite cast;
# transformers' attention (``softmax(..., dtype=torch.float32)`` on fp16
# scores) and autocast's float32 softmax recorded a copy the GPU never makes.
def _half_to_float(op):
    def impl(input, dim, dtype=None, *, _op=op):
        return _op(input, dim, True)

    return impl


def _half_to_float_applies(args, kwargs) -> bool:
    x = args[0] if args else kwargs.get("input")
    if len(args) > 2:
        dtype = args[2]
    else:
        dtype = kwargs.get("dtype")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return (
        dtype == torch.float32
        and isinstance(x, MetaTensor)
        and x._md.device.type == "cuda"
        and x.dtype == torch.float16
        and isinstance(dim, int)
        and not kwargs.keys() - {"input", "dim", "dtype"}
    )


# Note [A Python number written into a GPU tensor]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``t[index] = 0.5`` turns the number into a tensor in C++ (``THPVariable_setitem``):
# for a CUDA ``t`` a 0-dim CPU tensor made without dispatch
# (``scalar_tensor_static``), which the slice then takes with ``fill_``.
# For a logical GPU's MetaTensor C++ sees ``meta`` and dispatches
# ``scalar_tensor`` on it, then views, expands and copies: two to four ops a
# GPU does not run, at every masked write (torchvision's Swin builds its
# attention mask so).  Here the number becomes the 0-dim CPU tensor CUDA
# makes, outside the trace, and C++ writes it as it would on a GPU.
def _setitem_number(self, index, value):
    with _compat.no_python_dispatch():
        value = torch.scalar_tensor(value, dtype=self.dtype)
    mode = _compat.get_infra_mode(_compat.mode_key)
    if mode is not None:
        value = aten.lift_fresh.default(mode.cpu_constant(value))
    with _compat.no_torch_function_subclass():
        torch.Tensor.__setitem__(self, index, value)


def _setitem_number_applies(args, kwargs) -> bool:
    return (
        len(args) == 3
        and type(args[2]) in (int, float, bool)
        and isinstance(args[0], MetaTensor)
        and args[0]._md.device.type == "cuda"
        and not args[0].is_quantized
    )


# Note [rms_norm's fused kernel on a GPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``rms_norm``'s C++ body calls ``_fused_rms_norm`` (unless the input is
# complex or channels-last, or the weight's dtype differs: then its Python-
# like composite).  On CUDA that op has a kernel, so the GPU runs one op and
# saves the input, the weight and ``rstd`` for ``_fused_rms_norm_backward``;
# on the CPU and on meta it is a ``CompositeImplicitAutograd`` body -- pow,
# mean, rsqrt, mul, each saved for backward -- which a logical GPU recorded:
# other ops and more saved bytes than the GPU (``nn.RMSNorm``, torchtitan's
# LLaMA).  On a logical GPU the fused op is called below autograd by a
# Function whose backward is ``_fused_rms_norm_backward``, as the GPU's
# autograd formula runs it (with ``create_graph`` the formula differentiates
# the composite instead: not modelled).
class _FusedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, normalized_shape, weight, eps, saves):
        with _compat.below_autograd():
            out, rstd = aten._fused_rms_norm.default(input, normalized_shape, weight, eps)
            if saves:
                # the GPU's autograd node saves rstd, an output, as a detached alias
                rstd = aten.detach.default(rstd)
        ctx.save_for_backward(input, rstd, weight)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    def backward(ctx, grad):
        input, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2]]
        with _compat.below_autograd():
            grad_input, grad_weight = aten._fused_rms_norm_backward.default(
                grad, input, ctx.normalized_shape, rstd, weight, mask
            )
        return grad_input, None, grad_weight, None, None


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    saves = torch.is_grad_enabled() and (input.requires_grad or weight is not None and weight.requires_grad)
    return _FusedRmsNorm.apply(input, list(normalized_shape), weight, eps, saves)


def _rms_norm_applies(args, kwargs) -> bool:
    if len(args) < 2 or kwargs.keys() - {"weight", "eps"}:
        return False
    x = args[0]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    return (
        isinstance(x, MetaTensor)
        and x._md.device.type == "cuda"
        and hasattr(aten, "_fused_rms_norm_backward")
        and not x.is_complex()
        and (weight is None or weight.dtype == x.dtype)
        and _compat.suggest_memory_format(x) not in (torch.channels_last, torch.channels_last_3d)
    )


# Note [Dropout's fused kernel on a GPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``dropout``'s C++ body (Dropout.cpp) runs ``native_dropout`` -- one op, a
# boolean mask saved for backward -- when ``input.is_cuda()`` and
# ``0 < p < 1`` in training with a non-empty input; elsewhere its generic
# body: a float mask from ``empty_like`` + ``bernoulli_``, scaled, multiplied.
# A logical GPU's MetaTensor took the generic body: four ops where a GPU runs
# one, and a saved mask four times the bytes of the GPU's -- in every
# training step with dropout (GPT-2's defaults).  ``dropout_`` (in place)
# always takes the generic body, on CUDA too.
def _native_dropout(input, p=0.5, train=True):
    return torch.native_dropout(input, p, train)[0]


def _dropout_applies(args, kwargs) -> bool:
    names = ("input", "p", "train", "inplace")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    train = bound.get("train", bound.get("training", True))
    p = bound.get("p", 0.5)
    x = bound.get("input")
    return (
        isinstance(x, MetaTensor)
        and x._md.device.type == "cuda"
        and not bound.get("inplace", False)
        and train is True
        and isinstance(p, (int, float))
        and 0 < p < 1
        and x.numel() > 0
    )


def _functional_dropout(input, p=0.5, training=True, inplace=False):
    return torch.native_dropout(input, p, training)[0]


for _f, _op in (
    (_VF.softmax, _VF._softmax),
    (torch.Tensor.softmax, _VF._softmax),
    (_VF.log_softmax, _VF._log_softmax),
    (torch.Tensor.log_softmax, _VF._log_softmax),
):
    register_override(_f, _half_to_float(_op), _half_to_float_applies)
register_override(torch.Tensor.__setitem__, _setitem_number, _setitem_number_applies)
register_override(_VF.rms_norm, _rms_norm, _rms_norm_applies)
register_override(torch.nn.functional.rms_norm, _rms_norm, _rms_norm_applies)
register_override(_VF.dropout, _native_dropout, _dropout_applies)
register_override(torch.nn.functional.dropout, _functional_dropout, _dropout_applies)
