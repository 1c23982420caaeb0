"""Convolutions: the output's memory format is the backend's, chosen by torch's C++.

torch's meta kernel for ``convolution`` leaves its output contiguous: a meta
tensor has no device, so it cannot know which backend a real run would pick
(``_select_conv_backend``), and the backend decides the layout -- on CPU,
oneDNN keeps a channels-last input channels-last.  A MetaTensor on a logical
CPU reports ``cpu`` to C++ (Note [Backend keys of a logical CPU] in
``_compat/tensors.py``), so we ask torch's own C++ which backend it would select and
which memory format that backend gives (``_conv_determine_backend_memory_format``),
as FakeTensor does, and lay the outputs out so.  Nothing here encodes a
backend's behaviour.

Note [Convolution layouts on a logical GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A logical GPU's tensors are meta tensors to C++, so torch cannot be asked;
the meta kernel's contiguous output was wrong for every channels-last
network (ConvNeXt, ``model.to(memory_format=torch.channels_last)``).  On
CUDA, torch's backend choice (``_select_conv_backend`` in Convolution.cpp)
gives channels-last layouts only through cuDNN, and cuDNN's layout is
``cudnn_conv_suggest_memory_format`` (ConvUtils.h): channels-last (3-D:
channels-last-3d) when the input or the weight suggests it, never for
float64.  The slow CUDA kernels and the depthwise ones are contiguous, and
a channels-last depthwise convolution goes to cuDNN whenever cuDNN is
usable (``use_cudnn_depthwise``).  cuDNN is usable when
``torch.backends.cudnn.enabled`` and, for bfloat16, on sm80 or newer (the
mode's GPU profile); this port leaves out inputs past 32-bit indexing and
transposed convolutions with an output padding at least their stride or
dilation, which cuDNN also refuses.  Other logical devices keep the meta
kernel's answer.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core.registry import builtin_rule
from ..mode.mode import active_profile

aten = torch.ops.aten


def _laid_out(t, fmt):
    if t is None or fmt is None or (fmt == torch.contiguous_format and t.is_contiguous()):
        return t
    if t.dim() == 3:  # conv1d: the backend's choice was made for the 4-d unsqueezed form
        return torch.empty_like(t.unsqueeze(2), memory_format=fmt).squeeze(2)
    return torch.empty_like(t, memory_format=fmt)


def _cudnn_format(x, weight):
    """Note [Convolution layouts on a logical GPU]."""
    if not torch.backends.cudnn.enabled or torch.float64 in (x.dtype, weight.dtype):
        return torch.contiguous_format
    if torch.bfloat16 in (x.dtype, weight.dtype) and active_profile().compute_capability < (8, 0):
        return torch.contiguous_format
    wanted = {4: torch.channels_last, 5: torch.channels_last_3d}.get(weight.dim())
    suggested = (_compat.suggest_memory_format(x), _compat.suggest_memory_format(weight))
    return wanted if wanted is not None and wanted in suggested else torch.contiguous_format


def _format(x, weight, bias, bias_sizes, conv_args):
    if x.device.type == "cuda" and weight.device.type == "cuda":
        return _cudnn_format(x, weight)
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return None
    backend = _compat.select_conv_backend(x, weight, bias, bias_sizes, *conv_args)
    if weight.dim() == 3 and not x.is_mkldnn:
        x, weight = x.contiguous().unsqueeze(2), weight.unsqueeze(2)
    return _compat.conv_backend_memory_format(x, weight, backend)


@builtin_rule(aten.convolution.default)
def convolution(x, weight, bias, *conv_args, fallback):
    out = fallback(x, weight, bias, *conv_args)
    return _laid_out(out, _format(x, weight, bias, None, conv_args))


@builtin_rule(aten._convolution.default)
def convolution_underscore(
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *flags, fallback
):
    conv_args = (stride, padding, dilation, transposed, output_padding, groups)
    out = fallback(x, weight, bias, *conv_args, *flags)
    return _laid_out(out, _format(x, weight, bias, None, conv_args))


@builtin_rule(aten.convolution_backward.default)
def convolution_backward(grad_out, x, weight, bias_sizes, *args, fallback):
    *conv_args, output_mask = args
    grad_x, grad_w, grad_b = fallback(grad_out, x, weight, bias_sizes, *args)
    fmt = _format(x, weight, None, bias_sizes, conv_args)
    return _laid_out(grad_x, fmt), _laid_out(grad_w, fmt), grad_b
