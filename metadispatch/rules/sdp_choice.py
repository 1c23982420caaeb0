"""SDPA's backend choice on a CUDA GPU, ported from torch's C++ for a GPU profile.

Note [SDPA backend choice]
~~~~~~~~~~~~~~~~~~~~~~~~~~
On CUDA, ``F.scaled_dot_product_attention`` asks ``select_sdp_backend``
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) which kernel runs:
cuDNN, flash, memory-efficient or math.  The answer depends on the GPU's SM,
the cuDNN the wheel ships, the inputs (dtype, head dim, alignment, mask,
dropout, causal, GQA, requires_grad) and the user's switches
(``torch.backends.cuda.enable_*_sdp``, ``sdpa_kernel``, its priority order).
A MetaTensor is ``meta`` to C++, where the choice is always math; so on a
logical CUDA device this module answers instead, from the mode's
:class:`~metadispatch.spec.profiles.GPUProfile`.  Each ``_check_*`` below is
one C++ filter of the same name (``check_*``), in the same order.

Version awareness: the filters follow sdp_utils.cpp at pytorch commit
001f694a (between the 2.13 and 2.14 releases) and the installed torch's own
header ``sdp_utils_cpp.h``, whose differences are switched on
``TORCH_2_14``: 2.14 gives unbatched (3-D) inputs a batch dimension before
choosing (``normalize_unbatched_input``) and lets cuDNN/flash/efficient
broadcast a single key/value head without ``enable_gqa`` (``supports_mqa``);
efficient attention takes GQA only from 2.14 (2.13's meta kernel for its
backward has no GQA).  The two releases' own sdp_utils.cpp differ from
001f694a in check_cudnn_tensor_shapes, read from the cu130 wheels'
libtorch_cuda.so (2.13.0 = cf30153c, 2.14.1 = 5c488690; Note [cuDNN head
dim and decode by release]).  Not ported: nested tensors, ROCm
(AOTriton/CK), the HPU/private-use hooks, and the ``overrideable`` backend.

Note [cuDNN head dim and decode by release]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
check_cudnn_tensor_shapes' head-dim limit is not 001f694a's in 2.13: 2.13.0
still has the rule of pytorch#149904/#161210 -- 256 on sm90.0 with cuDNN >=
9.10, else 128, and 192 for (d_qk, d_v) = (192, 128) on sm10x with cuDNN >=
9.11 -- with no check_cudnn_d256_bprop_head_dim (neither its symbol nor its
warning is in 2.13.0's binary).  pytorch#185553 (with the frontend 1.24 of
#185554) replaced it after 2.13's branch cut: 256 on sm90.0/sm10x (not
sm10.7 with cuDNN <= 9.25) needs cuDNN > 9.22 and a frontend >= 1.24, which
2.14.1's build has (its check has no frontend test left: the constexpr folded
to true), and training then takes only (<=128, <=128), (192, 128), (256, 256).
2.14.1 also refuses s_q == 1 ("decode") on sm10x/sm11x with cuDNN 9.19 to
9.25.0 except 9.24.1+ (is_cudnn_attention_decode_disabled, pytorch#194927
for the wrong results of #193893).  A real H100 on 2.11.0 (cuDNN 9.19, whose
binary has 2.13's head-dim rule) ran cuDNN for head dims 160, 192 and 256.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .. import _compat

__all__ = ["SDPParams", "select_sdp_backend", "TORCH_2_14", "MATH", "FLASH", "EFFICIENT", "CUDNN"]

TORCH_2_14 = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14)
# at::SDPBackend's values, as torch.nn.attention.SDPBackend numbers them.
MATH, FLASH, EFFICIENT, CUDNN, OVERRIDEABLE = 0, 1, 2, 3, 4
_DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN, OVERRIDEABLE)  # at::Context's initial order
_HALF = (torch.float16, torch.bfloat16)
# check_prefer_cudnn_attention reads this once per process; so do we.
_CUDNN_DEPRIORITIZED = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").upper() in ("1", "ON", "YES", "TRUE", "Y")


@dataclass(frozen=True)
class SDPParams:
    """sdp_params: what the choice reads about one call (tensors are MetaTensors)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout: float
    is_causal: bool
    enable_gqa: bool

    def requires_grad(self) -> bool:  # input_requires_grad
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.query, self.key, self.value))


def select_sdp_backend(p: SDPParams, gpu) -> int:
    """The backend number a GPU of profile ``gpu`` runs ``p`` with; raises as torch does when none can."""
    flash_on, efficient_on, math_on, cudnn_on, fa3_on, order, *_ = _compat.sdp_switches()
    if not (math_on or flash_on or efficient_on or cudnn_on):
        raise RuntimeError(
            "No viable backend for scaled_dot_product_attention was found. "
            "This is likely due to turning off both the math kernel and the fused kernels."
        )
    if TORCH_2_14:
        p = _normalize_unbatched(p)
    order = tuple(order)
    # priority_order: the first call on a GPU puts cuDNN first where preferred,
    # unless the user has set an order (sdpa_kernel(..., set_priority=True)).
    if order == _DEFAULT_ORDER and _prefer_cudnn(gpu):
        order = (CUDNN, FLASH, EFFICIENT, MATH)
    can_use = {
        CUDNN: lambda: cudnn_on and _can_use_cudnn(p, gpu),
        FLASH: lambda: flash_on and _can_use_flash(p, gpu, fa3_on),
        EFFICIENT: lambda: efficient_on and _can_use_efficient(p, gpu),
        MATH: lambda: math_on,
    }
    for backend in order:
        if backend in can_use and can_use[backend]():
            return backend
    raise RuntimeError("No available kernel. Aborting execution.")


def _normalize_unbatched(p: SDPParams) -> SDPParams:
    if not all(t.dim() == 3 and t.layout == torch.strided for t in (p.query, p.key, p.value)):
        return p
    mask = p.attn_mask
    while mask is not None and mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return SDPParams(
        p.query.unsqueeze(0), p.key.unsqueeze(0), p.value.unsqueeze(0), mask, p.dropout, p.is_causal, p.enable_gqa
    )


def _prefer_cudnn(gpu) -> bool:  # check_prefer_cudnn_attention
    major, minor = gpu.compute_capability
    if _CUDNN_DEPRIORITIZED or gpu.cudnn_version <= 91500 or major not in (9, 10):
        return False
    return gpu.cuda_version >= 13000 or minor in (0, 3)


def _sm_in(gpu, low, high) -> bool:  # check_sm_version
    return low <= tuple(gpu.compute_capability) <= high


def _dtype_in(p: SDPParams, allowed) -> bool:  # check_tensor_dtype
    d = p.query.dtype
    return d == p.key.dtype == p.value.dtype and d in allowed


def _tensor_shapes(p: SDPParams) -> bool:  # check_tensor_shapes
    return p.query.dim() == p.key.dim() == p.value.dim() == 4


def _nonzero_seq_lens(p: SDPParams) -> bool:  # check_nonzero_sequence_lengths_dense
    return p.query.shape[-2] != 0 and p.key.shape[-2] != 0


def _last_stride_1(p: SDPParams, ignore_singleton: bool) -> bool:  # check_last_dim_stride_equals_1_dense
    ok = all(t.stride(-1) == 1 for t in (p.query, p.key, p.value))
    if ignore_singleton:
        ok = ok or p.query.shape[-1] == 1
    return ok and (p.attn_mask is None or p.attn_mask.stride(-1) == 1)


def _batch_and_heads(p: SDPParams, requires_same_num_heads: bool = True, supports_gqa: bool = True) -> bool:
    """check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads, supports_mqa=true>."""
    q, k, v = p.query, p.key, p.value
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if p.enable_gqa and supports_gqa:  # check_grouped_query_attention
        if requires_same_num_heads and hk != hv:
            return False
        return hq % hk == 0 and (requires_same_num_heads or hq % hv == 0)
    if hq == hk == hv:
        return True
    return TORCH_2_14 and hq > 0 and hk == 1 and hv == 1  # supports_mqa: 2.14's header only


def _attn_mask_shape(p: SDPParams) -> bool:  # check_attn_mask_shape
    m = p.attn_mask
    if m is None:
        return True
    if m.requires_grad:
        return False
    b, h, lq, lk = p.query.shape[0], p.query.shape[1], p.query.shape[2], p.key.shape[2]
    if m.shape[-2] not in (lq, 1) or m.shape[-1] not in (lk, 1):
        return False
    return m.dim() == 2 or (m.dim() == 4 and m.shape[0] in (1, b) and m.shape[1] in (1, h))


def _sm90_or_sm10x(gpu) -> bool:
    major, minor = gpu.compute_capability
    return (major == 9 and minor == 0) or major == 10


def _cudnn_d256(gpu) -> bool:
    unsupported_sm107 = tuple(gpu.compute_capability) == (10, 7) and gpu.cudnn_version <= 92500
    return _sm90_or_sm10x(gpu) and not unsupported_sm107 and gpu.cudnn_version > 92200 and gpu.cudnn_frontend_d256


def _cudnn_head_dim_limit(gpu, d_qk: int, d_v: int) -> int:
    """check_cudnn_tensor_shapes' head_dim_limit (Note [cuDNN head dim and decode by release])."""
    version = gpu.cudnn_version
    if not TORCH_2_14:  # 2.13.0: pytorch#149904/#161210's rule, before #185553
        major, minor = gpu.compute_capability
        limit = 256 if version >= 91000 and (major, minor) == (9, 0) else 128
        return 192 if version >= 91100 and major == 10 and (d_qk, d_v) == (192, 128) else limit
    if _cudnn_d256(gpu):
        return 256
    return 192 if _sm90_or_sm10x(gpu) and version >= 91100 and (d_qk, d_v) == (192, 128) else 128


def _cudnn_decode_disabled(gpu) -> bool:  # is_cudnn_attention_decode_disabled (2.14, pytorch#194927)
    version = gpu.cudnn_version
    return gpu.compute_capability[0] in (10, 11) and 91900 <= version <= 92500 and not 92401 <= version <= 92499


def _cudnn_tensor_shapes(p: SDPParams, gpu) -> bool:  # check_cudnn_tensor_shapes
    b, h, s_q, d_qk = p.query.shape
    s_k, d_v, version = p.key.shape[2], p.value.shape[3], gpu.cudnn_version
    if b > 65535 or h > 65535 or version < 8903 or (version < 8906 and p.dropout != 0.0):
        return False
    if TORCH_2_14 and s_q == 1 and _cudnn_decode_disabled(gpu):
        return False
    limit = _cudnn_head_dim_limit(gpu, d_qk, d_v)
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if version < 8906 and s_k % 64:
        return False
    if version < 90000 and (s_q < 64 or (p.dropout != 0.0 and (s_q % 64 or s_k % 64))):
        return False
    return s_k != 1 and not (p.dropout != 0.0 and s_q == 1)


def _cudnn_d256_backward(p: SDPParams, gpu) -> bool:  # check_cudnn_d256_bprop_head_dim (2.14; not in 2.13)
    if not TORCH_2_14 or not p.requires_grad() or not _cudnn_d256(gpu):
        return True
    d_qk, d_v = p.query.shape[3], p.value.shape[3]
    return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))


def _can_use_cudnn(p: SDPParams, gpu) -> bool:  # can_use_cudnn_attention
    if p.dropout > 0.0 and 91100 < gpu.cudnn_version < 91400:
        return False
    deterministic, warn_only = _compat.sdp_switches()[6:8]
    general = (
        _tensor_shapes(p)
        and not (deterministic and not warn_only)
        and _sm_in(gpu, (8, 0), (12, 1))
        and _dtype_in(p, _HALF)
        and _attn_mask_shape(p)
        and p.dropout * 16.0 == math.floor(p.dropout * 16.0)
    )  # check_cudnn_dropout
    return (
        general
        and _nonzero_seq_lens(p)
        and _last_stride_1(p, True)
        and _batch_and_heads(p, requires_same_num_heads=False)
        and _cudnn_tensor_shapes(p, gpu)
        and _cudnn_d256_backward(p, gpu)
    )


def _can_use_flash(p: SDPParams, gpu, fa3_on: bool) -> bool:  # can_use_flash_attention
    if not _tensor_shapes(p) or p.attn_mask is not None:  # check_for_attn_mask
        return False
    d = p.query.shape[-1]
    if not (d == p.key.shape[-1] == p.value.shape[-1] and d <= 256):  # check_head_dim_size_flash
        return False
    if not _sm_in(gpu, (8, 0), (12, 1)):
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if p.requires_grad() and (_sm_in(gpu, (8, 6), (8, 9)) or _sm_in(gpu, (12, 0), (12, 1))):
        if not (d <= 192 or (p.dropout <= 0.0 and d > 224)):
            return False
    if p.is_causal and p.query.shape[-2] != p.key.shape[-2]:  # check_flash_causal_non_square_seqlens
        return False
    fa3 = gpu.compute_capability[0] >= 9 and fa3_on  # check_dtypes_flash_attention
    if not _dtype_in(p, (torch.float8_e4m3fn,) + _HALF if fa3 else _HALF):
        return False
    return _batch_and_heads(p) and _nonzero_seq_lens(p) and _last_stride_1(p, True)


def _gemm_alignment(p: SDPParams, gpu) -> int:  # minimum_gemm_alignment
    major, half = gpu.compute_capability[0], p.query.dtype in _HALF
    tensor_cores = major >= 8 or (major >= 7 and half)  # use_tensor_cores
    return max(4 if major >= 8 else 1, (128 // (16 if half else 32)) if tensor_cores else 1)


def _can_use_efficient(p: SDPParams, gpu) -> bool:  # can_use_mem_efficient_attention
    if not _sm_in(gpu, (5, 0), (12, 1)) or not _tensor_shapes(p):
        return False
    align = _gemm_alignment(p, gpu)
    dq, dk, dv = p.query.shape[-1], p.key.shape[-1], p.value.shape[-1]
    if not (dq == dk and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    # check_data_ptr_alignment_mem_efficient: the caching allocator aligns bases to 256 bytes.
    align_bytes = align * p.query.element_size()
    misaligned = [
        t for t in (p.query, p.key, p.value) if t.numel() and (t.storage_offset() * t.element_size()) % align_bytes
    ]
    if gpu.compute_capability[0] >= 8 and misaligned:
        return False
    # Efficient attention takes GQA from 2.14 (2.13's meta backward gives
    # grad_key the query's head count: its kernel had no GQA).
    if not (_nonzero_seq_lens(p) and _last_stride_1(p, False) and _batch_and_heads(p, supports_gqa=TORCH_2_14)):
        return False
    if gpu.compute_capability[0] >= 8:
        return _dtype_in(p, (torch.float16, torch.float32, torch.bfloat16))
    return _dtype_in(p, (torch.float16, torch.float32))
