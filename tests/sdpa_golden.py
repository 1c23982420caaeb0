"""Golden table: the SDPA backend a real GPU runs, derived by reading torch's source.

Each group names the C++ function (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
pytorch commit 001f694a, and the installed torch's sdp_utils_cpp.h; where the releases'
own check_cudnn_tensor_shapes differs, as read from the 2.13.0 and 2.14.1 cu130 wheels'
libtorch_cuda.so, the group says so) whose rule decides it;
the expected backend of a case is worked out from that rule by hand, per group, below --
never by calling metadispatch.  Cases are plain tuples so a failure names the case.

Facts every group relies on:
- ``priority_order`` + ``check_prefer_cudnn_attention``: the default order is flash,
  efficient, math, cuDNN; with cuDNN > 9.15 (the cu130 wheels ship 9.20 with 2.13.0 and
  9.24.0 with 2.14.1) on sm90/sm100
  (H100, H200, B200) cuDNN goes first: cuDNN, flash, efficient, math.  So on A100/L4
  cuDNN is reached only when math is disabled.
- flash and cuDNN take fp16/bf16 only on sm80+ (``check_dtypes_low_precision``);
  efficient also takes fp32 (``can_use_mem_efficient_attention``).
"""

from __future__ import annotations

import torch

TORCH_2_14 = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14)
PROFILES = ("h100", "h200", "b200", "a100-80gb", "a100-40gb", "l4")
CUDNN_FIRST = {"h100", "h200", "b200"}  # sm90 / sm100
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
MATH, FLASH, EFFICIENT, CUDNN = "math", "flash", "efficient", "cudnn"


def case(
    gpu,
    expected,
    *,
    dtype=BF16,
    q=(2, 8, 256, 64),
    k=None,
    mask=None,
    dropout=0.0,
    causal=False,
    gqa=False,
    grad=False,
    flags=None,
    priority=False,
    deterministic=None,
    offset=0,
    transposed=False,
    group="",
):
    """One row: inputs, switches, and the backend a GPU of ``gpu`` runs them with."""
    return dict(
        gpu=gpu,
        expected=expected,
        dtype=dtype,
        q=q,
        k=k or q,
        mask=mask,
        dropout=dropout,
        causal=causal,
        gqa=gqa,
        grad=grad,
        flags=flags,
        priority=priority,
        deterministic=deterministic,
        offset=offset,
        transposed=transposed,
        group=group,
    )


def _fused(gpu, dtype):
    """The first fused backend for a plain 4-D call: order and dtype facts above."""
    if dtype == F32:
        return EFFICIENT
    return CUDNN if gpu in CUDNN_FIRST else FLASH


CASES: list = []

# Group "dtype": priority order and dtype filters, with and without grad.
for gpu in PROFILES:
    for dtype in (BF16, F16, F32):
        for grad in (False, True):
            CASES.append(case(gpu, _fused(gpu, dtype), dtype=dtype, grad=grad, group="dtype"))


def _cudnn_head_dim_limit(gpu):
    # check_cudnn_tensor_shapes' head_dim_limit for d_qk == d_v.  2.13.0's binary: 256 on
    # sm90.0 with cuDNN >= 9.10 (the wheel's 9.20), else 128 (pytorch#149904/#161210).
    # 2.14.1's: 256 on sm90.0/sm10x (not sm10.7 up to 9.25) with cuDNN > 9.22 (the wheel's
    # 9.24.0) and a cuDNN frontend >= 1.24 (pytorch#185553/#185554), which that build has.
    if TORCH_2_14:
        return 256 if gpu in CUDNN_FIRST else 128
    return 256 if gpu in ("h100", "h200") else 128


def _head_dim(gpu, d, grad=False, dropout=0.0):
    # check_cudnn_tensor_shapes: d % 8 == 0 and d <= the limit above (a real H100 on torch
    # 2.11.0, whose binary has 2.13.0's rule, ran cuDNN for 160, 192 and 256).  Training
    # with d > 128 (2.14's check_cudnn_d256_bprop_head_dim) is not in this group.
    # check_head_dim_size_flash: d <= 256, any multiple (the composite pads to 8).
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120:
    # L4 (sm89) training refuses d in (192, 224], and (224, 256] with dropout.
    # check_head_dim_size_mem_efficient: d % 8 == 0 for half types, no upper bound on CUDA.
    if gpu in CUDNN_FIRST and d % 8 == 0 and d <= _cudnn_head_dim_limit(gpu):
        return CUDNN
    l4_train_refuses = gpu == "l4" and grad and not (d <= 192 or (dropout <= 0.0 and d > 224))
    if d <= 256 and not l4_train_refuses:
        return FLASH
    return EFFICIENT if d % 8 == 0 else MATH


# Group "head_dim".
for gpu in PROFILES:
    for d in (8, 40, 60, 64, 80, 96, 128, 160, 192, 256, 264):
        CASES.append(case(gpu, _head_dim(gpu, d), q=(2, 8, 256, d), group="head_dim"))
# Group "head_dim_train_cudnn": 2.14's check_cudnn_d256_bprop_head_dim lets training past
# d = 128 take cuDNN only as (192, 128) or (256, 256); 2.13 has no such check.  Flash
# takes the rest (sm90/sm100 have no flash training limit).
for gpu in ("h100", "b200"):
    for d in (160, 192, 256):
        cudnn = d <= _cudnn_head_dim_limit(gpu) and (not TORCH_2_14 or d == 256)
        CASES.append(case(gpu, CUDNN if cudnn else FLASH, q=(2, 8, 256, d), grad=True, group="head_dim_train_cudnn"))
# Group "head_dim_train_sm89": the L4 training limit against the others.
for gpu in ("l4", "a100-80gb"):
    for d in (192, 200, 224, 232, 256):
        for dropout in (0.0, 0.5):
            CASES.append(
                case(
                    gpu,
                    _head_dim(gpu, d, True, dropout),
                    q=(2, 8, 256, d),
                    grad=True,
                    dropout=dropout,
                    group="head_dim_train_sm89",
                )
            )

# Group "mask": check_for_attn_mask (flash takes none), check_attn_mask_shape (cuDNN: 2-D, or
# 4-D with batch/heads 1 or equal; a 3-D mask is refused), efficient takes any broadcastable mask.
_MASKS = {
    "bool_LS": ("bool", (256, 256)),
    "float_B1LS": ("float", (2, 1, 256, 256)),
    "bool_1LS": ("bool", (1, 256, 256)),
    "float_111S": ("float", (1, 1, 1, 256)),
}
for gpu in PROFILES:
    for name, (kind, shape) in _MASKS.items():
        ok_cudnn = gpu in CUDNN_FIRST and len(shape) != 3
        CASES.append(case(gpu, CUDNN if ok_cudnn else EFFICIENT, mask=(kind, shape), group=f"mask_{name}"))
        CASES.append(case(gpu, EFFICIENT, dtype=F32, mask=(kind, shape), group=f"mask_{name}_f32"))

# Group "dropout": check_cudnn_dropout (a multiple of 1/16); flash and efficient take any.
for gpu in PROFILES:
    for p in (0.0, 0.1, 0.125, 0.5):
        cudnn = gpu in CUDNN_FIRST and p * 16 == int(p * 16)
        CASES.append(case(gpu, CUDNN if cudnn else FLASH, dropout=p, grad=True, group="dropout"))

# Group "causal": check_flash_causal_non_square_seqlens; cuDNN has no such filter.
for gpu in PROFILES:
    cudnn = gpu in CUDNN_FIRST
    CASES.append(case(gpu, CUDNN if cudnn else FLASH, causal=True, group="causal_square"))
    CASES.append(
        case(
            gpu,
            CUDNN if cudnn else EFFICIENT,
            q=(2, 8, 128, 64),
            k=(2, 8, 256, 64),
            causal=True,
            group="causal_non_square",
        )
    )
    CASES.append(
        case(gpu, CUDNN if cudnn else FLASH, q=(2, 8, 128, 64), k=(2, 8, 256, 64), group="non_causal_non_square")
    )


# Group "flags": select_sdp_backend walks the order, skipping disabled backends
# (check_runtime_disabled_*); sdpa_kernel enables exactly the listed ones.
def _flags(gpu, enabled):
    order = (CUDNN, FLASH, EFFICIENT, MATH) if gpu in CUDNN_FIRST else (FLASH, EFFICIENT, MATH, CUDNN)
    return next(b for b in order if b in enabled)


for gpu in PROFILES:
    for enabled in (
        {FLASH, EFFICIENT, MATH},
        {CUDNN, EFFICIENT, MATH},
        {EFFICIENT, MATH},
        {MATH},
        {EFFICIENT},
        {CUDNN},
        {FLASH},
    ):
        CASES.append(case(gpu, _flags(gpu, enabled), flags=sorted(enabled), group="flags"))
    # sdpa_kernel(..., set_priority=True): the user's order wins over the cuDNN preference.
    CASES.append(case(gpu, EFFICIENT, flags=[EFFICIENT, CUDNN, FLASH, MATH], priority=True, group="priority"))
    CASES.append(case(gpu, FLASH, flags=[FLASH, CUDNN, EFFICIENT, MATH], priority=True, group="priority"))

# Group "gqa": check_batch_size_and_num_heads_dense.  cuDNN and flash take enable_gqa with
# divisible heads; efficient from 2.14 only; one key/value head without enable_gqa
# (supports_mqa) from 2.14's header only.  Math otherwise.
for gpu in PROFILES:
    for dtype in (BF16, F32):
        gqa = _fused(gpu, dtype) if (dtype != F32 or TORCH_2_14) else MATH
        CASES.append(case(gpu, gqa, dtype=dtype, k=(2, 2, 256, 64), gqa=True, group="gqa"))
        mqa = _fused(gpu, dtype) if TORCH_2_14 else MATH
        CASES.append(case(gpu, mqa, dtype=dtype, k=(2, 1, 256, 64), group="mqa"))

# Group "unbatched": normalize_unbatched_input (2.14's header) gives 3-D inputs a batch;
# before, check_tensor_shapes (4-D only) sends them to math.
for gpu in PROFILES:
    for dtype in (BF16, F32):
        CASES.append(
            case(gpu, _fused(gpu, dtype) if TORCH_2_14 else MATH, dtype=dtype, q=(8, 256, 64), group="unbatched")
        )

# Group "layout": check_last_dim_stride_equals_1_dense (all fused kernels) and, for efficient,
# check_data_ptr_alignment_mem_efficient (storage offset * element size % 16 on sm80+).
for gpu in PROFILES:
    CASES.append(case(gpu, MATH, transposed=True, group="last_dim_stride"))
    CASES.append(case(gpu, MATH, dtype=F32, offset=1, group="misaligned_f32"))
    CASES.append(case(gpu, EFFICIENT, dtype=F32, offset=4, group="aligned_offset_f32"))

# Group "deterministic": check_cudnn_deterministic refuses cuDNN unless warn_only.
for gpu in ("h100", "h200", "b200", "a100-80gb"):
    CASES.append(case(gpu, FLASH, deterministic="error", group="deterministic"))
    CASES.append(case(gpu, CUDNN if gpu in CUDNN_FIRST else FLASH, deterministic="warn", group="deterministic"))

# Group "seq_len_1": check_cudnn_tensor_shapes refuses s_k == 1, and s_q == 1 with dropout.
# 2.14.1 also refuses s_q == 1 on sm10x/sm11x with cuDNN 9.19 to 9.25.0 but 9.24.1+
# (is_cudnn_attention_decode_disabled, pytorch#194927): B200 with the wheel's 9.24.0.
for gpu in ("h100", "h200", "b200"):
    decode = FLASH if TORCH_2_14 and gpu == "b200" else CUDNN
    CASES.append(case(gpu, FLASH, q=(2, 8, 256, 64), k=(2, 8, 1, 64), group="seq_k_1"))
    CASES.append(case(gpu, FLASH, q=(2, 8, 1, 64), k=(2, 8, 256, 64), dropout=0.25, group="seq_q_1_dropout"))
    CASES.append(case(gpu, decode, q=(2, 8, 1, 64), k=(2, 8, 256, 64), group="seq_q_1"))
