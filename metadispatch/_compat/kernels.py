"""What C++ reads to choose a kernel: convolution backends and switches, SDPA's switches, autocast's state.

Part of ``metadispatch._compat`` (its docstring says why private torch APIs live here alone).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint


def select_conv_backend(x, weight, bias, bias_sizes, stride, padding, dilation, transposed, output_padding, groups):
    """The backend C++'s ``convolution`` would run for these arguments."""
    if bias_sizes is None:
        return torch._C._select_conv_backend(
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
    return torch._C._select_conv_backend(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, bias_sizes
    )


def conv_switches() -> tuple:
    """``(oneDNN enabled, NNPACK enabled, cuDNN enabled)``: the switches the
    convolution backend choice reads on CPU (``_select_conv_backend``) and on
    a logical GPU (Note [Convolution layouts on a logical GPU])."""
    return (torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled(), torch._C._get_cudnn_enabled())


def cpu_conv_switches() -> tuple:
    """``(oneDNN enabled, NNPACK enabled)``: the switches a CPU convolution picks its kernel by."""
    return (torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled())


def mkldnn_lstm_dtype(dtype: torch.dtype) -> bool:
    """Whether a CPU LSTM of ``dtype`` may run oneDNN's ``mkldnn_rnn_layer`` (RNN.cpp's ``use_mkldnn``:
    oneDNN enabled; float32, bfloat16 where the CPU has it, float16 where it has it and grad is off)."""
    if not torch._C._get_mkldnn_enabled():
        return False
    if dtype == torch.float32:
        return True
    with torch._C._DisableTorchDispatch():  # the CPU's answer, not a call of the trace
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return not torch.is_grad_enabled() and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def set_cpu_conv_switches(switches: tuple) -> None:
    """Set what :func:`cpu_conv_switches` reads."""
    torch._C._set_mkldnn_enabled(switches[0])
    torch._C._set_nnpack_enabled(switches[1])


def conv_backend_memory_format(x, weight, backend) -> torch.memory_format:
    """The memory format ``backend`` gives a convolution's outputs."""
    return torch._C._conv_determine_backend_memory_format(x, weight, backend)


# FA3 and the priority order are newer than torch 2.5: absent, FA3 is off and
# the order is at::Context's initial one (flash, efficient, math, cuDNN, overrideable).
_FA3_ENABLED = getattr(torch._C, "_get_fa3_sdp_enabled", lambda: False)
_SDP_PRIORITY = getattr(torch._C, "_get_sdp_priority_order", lambda: (1, 2, 0, 3, 4))


def sdp_switches() -> tuple:
    """``(flash, mem_efficient, math, cudnn, fa3, priority order, deterministic, warn only)``:
    every switch C++'s attention backend choice reads."""
    return (
        torch._C._get_flash_sdp_enabled(),
        torch._C._get_mem_efficient_sdp_enabled(),
        torch._C._get_math_sdp_enabled(),
        torch._C._get_cudnn_sdp_enabled(),
        _FA3_ENABLED(),
        tuple(_SDP_PRIORITY()),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


any_autocast = torch._C._is_any_autocast_enabled


def autocast_state() -> tuple | None:
    """None outside autocast (the common case, one C call); else, per device
    type, whether autocast is on and its dtype, and whether casts are cached."""
    if not torch._C._is_any_autocast_enabled():
        return None
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES) + (
        torch.is_autocast_cache_enabled(),
    )
