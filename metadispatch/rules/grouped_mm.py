"""Grouped matrix multiply (``torch._grouped_mm``) on a logical CPU or GPU.

torch's meta function for ``_grouped_mm`` demands bfloat16 (the CUDA fast
path's condition), so transformers' default MoE experts (Qwen3-MoE, OLMoE,
Mixtral, ...) in float32 could not be traced.  The kernels accept float32,
bfloat16 and float16: the CPU's (``_grouped_mm`` in GroupedBlas.cpp) and
CUDA's (``_grouped_mm_cuda``: the bf16 CUTLASS path on sm90/sm100, else
``_grouped_mm_fallback``, a loop of ``mm``) both validate with
``_grouped_mm_validate_inputs`` and make their output with
``create_grouped_gemm_output_tensor`` (GroupedMMUtils.h), which pads the
last dimension to 16 bytes -- in a CPU build the meta function leaves it
unpadded.  This rule ports those two shared helpers; other logical devices
(ROCm builds differ) keep torch's meta answer.
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule

__all__ = ["grouped_mm_output"]

aten = torch.ops.aten

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN = 16  # bytes


def _check_strides(mat):
    """``check_valid_strides_and_return_transposed``: one of the two innermost
    dimensions is dense, the other's stride a multiple of 16 bytes."""
    size_m, size_n = mat.shape[-2:]
    stride_m, stride_n = mat.stride()[-2:]
    align = _ALIGN // mat.element_size()
    if stride_n == 1 and stride_m >= max(1, size_n):
        lead = stride_m
    elif stride_m == 1 and stride_n >= max(1, size_m):
        lead = stride_n
    else:
        raise RuntimeError(
            f"Invalid strides/sizes, got {tuple(mat.stride())} for strides and {tuple(mat.shape)} for sizes"
        )
    torch._check(lead % align == 0, lambda: "strides should be multiple of 16 bytes")


def _out_shape(a, b, offs):
    a2, b2 = a.dim() == 2, b.dim() == 2
    if a2 and b2:
        return [offs.shape[0], a.shape[0], b.shape[1]]
    if a2:
        torch._check(offs.shape[0] == b.shape[0], lambda: "matrix batch sizes have to match")
        return [a.shape[0], b.shape[-1]]
    if b2:
        torch._check(offs.shape[0] == a.shape[0], lambda: "matrix batch sizes have to match")
        return [a.shape[1], b.shape[1]]
    torch._check(a.shape[0] == b.shape[0], lambda: "batched dimension has to match")
    return [a.shape[0], a.shape[1], b.shape[-1]]


@builtin_rule(aten._grouped_mm.default)
def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None, *, fallback):
    if mat_a.device.type not in ("cpu", "cuda"):
        return fallback(mat_a, mat_b, offs, bias, out_dtype)
    return grouped_mm_output(mat_a, mat_b, offs, bias, out_dtype)


def grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The CPU and CUDA kernels' checks and output, on ``mat_a``'s device: also
    what replay's cost walk of a loaded trace sizes the call by, on plain meta
    tensors, where torch's meta function would refuse float32 (trust/costs.py)."""
    torch._check(
        mat_a.dtype in _DTYPES, lambda: f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {mat_a.dtype}"
    )
    torch._check(
        mat_b.dtype in _DTYPES, lambda: f"Expected mat_b to be Float32, BFloat16 or Float16 matrix, got {mat_b.dtype}"
    )
    torch._check(
        mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
        lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and mat_b.dim()={mat_b.dim()}",
    )
    torch._check(
        (offs is not None) == (mat_a.dim() == 2 or mat_b.dim() == 2),
        lambda: "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d",
    )
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: "offs has to be 1D")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    torch._check(bias is None, lambda: "Bias not supported yet")
    if mat_a.dim() == 3 or mat_b.dim() == 3:
        torch._check(mat_a.shape[-1] == mat_b.shape[-2], lambda: "contraction dimension of mat_a and mat_b must match")
    dtype = mat_a.dtype if out_dtype is None else out_dtype
    torch._check(dtype == mat_a.dtype, lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    _check_strides(mat_a)
    _check_strides(mat_b)
    torch._check(
        mat_a.dtype == mat_b.dtype,
        lambda: f"expected m1 and m2 to have the same dtype, but got: {mat_a.dtype} != {mat_b.dtype}",
    )
    shape = _out_shape(mat_a, mat_b, offs)
    align = _ALIGN // dtype.itemsize
    padded = -(-shape[-1] // align) * align
    stride = [padded] if len(shape) == 2 else [shape[1] * padded, padded]
    return torch.empty_strided(shape, stride + [1], dtype=dtype, device=mat_a.device)
