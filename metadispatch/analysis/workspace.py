"""Kernel workspaces: memory a kernel takes from the allocator that no tensor of the trace holds.

Requirements: the peak a real allocator sees includes the scratch kernels
allocate inside themselves -- oneDNN's blocked copies of a convolution's
tensors on CPU, im2col columns, the cuBLAS workspace, FlashAttention's
backward accumulators -- so ``md.memory`` places them, as their own category
``workspaces``, beside the storages of the trace.  Each size is derived from
the library's own rules, named beside each; none is measured.

Note [Transient and persistent workspaces]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A *transient* workspace lives only inside one call: it is what the kernel
holds at its own peak beyond its inputs and outputs (``md.memory`` counts it
at that call only).  Kernels allocate their outputs at different moments --
oneDNN's backward allocates ``grad_input`` before it computes
``grad_weight`` -- so the figure is the largest phase of the call minus the
outputs, which puts the call's peak where the real run has it.  A
*persistent* workspace is allocated on first use and kept: ATen gives each
cuBLAS handle and stream one workspace from the caching allocator
(``getChosenWorkspaceSize`` in ``aten/src/ATen/cuda/CublasHandlePool.cpp``:
``:4096:8``, 32 MiB, on compute capability 9 and above, else ``:4096:2:16:8``,
8 MiB + 128 KiB), live from the first matmul to the end.  Handles are per
thread, and the autograd engine runs a CUDA device's backward on a thread of
its own: a training step holds two, the forward's and the backward's (a real
H100's peak was one 32 MiB workspace above the trace's when the backward's
was not counted: the built-in LLaMA-7B step, and every zoo model with a
matmul, tools/gpu_conformance.py).  cuBLASLt shares the cuBLAS workspace
(``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default).

Limits, stated: oneDNN's *scratchpad* (its per-thread reduction buffers in a
convolution's weight gradient, tens of KiB, which depend on how it splits the
work over threads) is not modelled; nor are grouped and transposed
convolutions, memory-efficient attention's backward accumulators, or any
other op.  What cuDNN sizes at run time -- a GPU convolution's and batch
norm's workspaces (chosen by its heuristics), an RNN's reserve, workspaces
and dropout state (recorded, as torch's meta kernel does, empty: Note [cuDNN
RNNs on a logical GPU] in ``rules/cudnn_rnn.py``) -- is not sized either:
``md.memory`` lists those calls in ``unsized`` and says, when printed, that
its peak leaves them out.
The CPU figures follow ATen's choice between oneDNN and its own
``slow_conv2d`` (with this host's thread count), assume oneDNN's blocked
layouts for the host's vector width (16 channels with AVX-512, else 8) and
contiguous NCHW tensors.
"""

from __future__ import annotations

import math

import torch

from ..ir.trace import OpCall
from ..spec.profiles import GPUProfile
from ..spec.schema import schema_of

__all__ = [
    "CUBLAS_OPS",
    "transient_workspace",
    "cublas_workspace",
    "uses_cublas",
    "cpu_block",
    "unsized",
    "unsized_lines",
]

aten = torch.ops.aten

# the ops whose CUDA kernels take a cuBLAS handle (and with it its workspace)
CUBLAS_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.addmv.default,
        aten.mv.default,
        aten.dot.default,
        aten.addbmm.default,
        aten._int_mm.default,
        aten._scaled_mm.default,
    }
)


# CUDA calls whose scratch only the library sizes at run time (the limits above)
# Calls that take memory cuDNN sizes at run time, on a GPU: an RNN's reserve,
# workspace and dropout state; a convolution's workspace, which cuDNN's
# heuristics pick per call (a real H100's peaks were 1-9 MB above the
# trace's for the zoo's convolution models, and the reserved peaks over 30%:
# tools/gpu_conformance.py); batch norm's workspace.
UNSIZED_OPS = frozenset(
    {
        aten._cudnn_rnn.default,
        aten._cudnn_rnn_backward.default,
        aten._cudnn_init_dropout_state.default,
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.cudnn_batch_norm.default,
        aten.cudnn_batch_norm_backward.default,
    }
)


def unsized(call: OpCall) -> bool:
    """Whether ``call`` takes memory the trace cannot size (UNSIZED_OPS on a GPU)."""
    return call.func in UNSIZED_OPS and any(m.device.type == "cuda" for m in call.output_metas)


def unsized_lines(calls) -> list:
    """What a printed figure says about the calls it could not size (``Memory.unsized``: op name -> calls)."""
    if not calls:
        return []
    ops = ", ".join(f"{op} x{n}" for op, n in calls.most_common())
    rnn = any("rnn" in op or "dropout_state" in op for op in calls)
    what = "their workspaces, an RNN's reserve and dropout state" if rnn else "their workspaces"
    return [f"not sized: {ops}: what cuDNN allocates inside them at run time ({what}) is left out (the peak is low)"]


def cpu_block() -> int:
    """Channels per block of oneDNN's blocked layouts on this host (``nChw16c`` or ``nChw8c``)."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def cublas_workspace(gpu: GPUProfile) -> int:
    """Bytes of the cuBLAS workspace ATen allocates per handle and stream [getChosenWorkspaceSize]."""
    return 4096 * 8 * 1024 if gpu.compute_capability[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def uses_cublas(call: OpCall) -> bool:
    return call.func in CUBLAS_OPS and any(m.device.type == "cuda" for m in call.output_metas)


def transient_workspace(call: OpCall, block: int) -> int:
    """Bytes ``call`` holds inside itself beyond its inputs and outputs (Note [Transient and persistent workspaces])."""
    out = call.output_metas
    if not out:
        return 0
    device = out[0].device.type
    # a call whose arguments are not as its schema has them (a hand-made trace) has no workspace
    if device == "cpu" and call.func in (aten.convolution.default, aten.convolution_backward.default):
        if len(call.args) == len(schema_of(call.func).arguments):
            return max(0, _cpu_convolution(call, block))
    if device == "cuda" and call.func == aten._scaled_dot_product_flash_attention_backward.default:
        if len(call.args) > 1 and len(getattr(call.args[1], "shape", ())) == 4:
            return _flash_backward(call)
    return 0


def _use_onednn(x, w, stride, dilation) -> bool:
    """ATen's choice of oneDNN for a CPU convolution [ConvParams::use_mkldnn in Convolution.cpp]."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return True  # where the host supports them; else ATen refuses these dtypes anyway
    if x.dtype != torch.float32:
        return False
    strided_or_dilated = any(s != 1 for s in stride) or any(d != 1 for d in dilation)
    n, kh, kw = x.shape[0], w.shape[-2], w.shape[-1]
    if not (strided_or_dilated or n >= 16 or kh != 1 or kw != 1 or torch.get_num_threads() > 1):
        return False  # 1x1 filters single-threaded: ATen's own kernel is faster
    return (kh > 3 and kw > 3) or n > 1 or math.prod(x.shape) > 20480  # groups == 1 here


def _nbytes(m) -> int:
    return math.prod(m.shape) * m.dtype.itemsize


def _cpu_convolution(call: OpCall, block: int) -> int:
    backward = call.func == aten.convolution_backward.default
    x, w = (call.args[1], call.args[2]) if backward else (call.args[0], call.args[1])
    transposed, groups = call.args[7 if backward else 6], call.args[9 if backward else 8]
    if transposed or groups != 1 or len(x.shape) != 4:
        return 0
    n, ci, h, wd = x.shape
    co, kernel = w.shape[0], math.prod(w.shape[2:])
    it = x.dtype.itemsize
    y = call.args[0] if backward else call.output_metas[0]
    ho_wo = math.prod(y.shape[2:])
    stride, padding, dilation = call.args[4:7] if backward else call.args[3:6]
    if not _use_onednn(x, w, stride, dilation):
        # ATen's slow_conv2d: im2col columns for the whole batch [compute_columns2d]
        one_by_one = kernel == 1 and all(s == 1 for s in stride) and not any(padding)
        return 0 if one_by_one else n * ci * kernel * ho_wo * it

    def pad(c: int) -> int:
        return -(-c // block) * block

    # oneDNN reorders to blocked layouts; a "first" convolution (few input
    # channels) reads its source as it is, and its weights keep ci unpadded
    plain_src = ci < block
    src_b = 0 if plain_src else n * pad(ci) * h * wd * it
    w_fwd = pad(co) * (ci if plain_src else pad(ci)) * kernel * it
    dst_b = n * pad(co) * ho_wo * it
    if not backward:
        y_bytes = n * co * ho_wo * it
        return max(src_b + w_fwd + dst_b, dst_b + y_bytes) - y_bytes
    mask = call.args[10]
    gi = n * ci * h * wd * it if mask[0] else 0
    phases = []
    if mask[0]:  # backward data: diff_dst and weights reordered, diff_src blocked then copied out
        gi_b = n * pad(ci) * h * wd * it
        phases += [dst_b + pad(co) * pad(ci) * kernel * it + gi_b, gi_b + gi]
    if mask[1]:  # backward weights: diff_dst and src reordered, diff_weights blocked
        phases.append(gi + dst_b + src_b + w_fwd + (pad(co) * it if mask[2] else 0))
    return max(phases, default=0) - sum(_nbytes(m) for m in call.output_metas)


def _flash_backward(call: OpCall) -> int:
    """FlashAttention-2's ``mha_bwd``: ``dq_accum`` (float32, sequence rounded to 128,
    head dim rounded to 32 up to 128 else 64) and ``softmax_d``, for the call's length."""
    q = call.args[1]  # (grad_out, query, ...): query is (batch, heads, seq, head dim)
    b, heads, s, d = q.shape
    s_r = -(-s // 128) * 128
    step = 32 if d <= 128 else 64
    d_r = -(-d // step) * step
    return b * s_r * heads * d_r * 4 + b * heads * s_r * 4
