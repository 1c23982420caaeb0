"""Scaled dot-product attention on a logical CUDA device: the kernel a real GPU runs.

``aten._fused_sdp_choice`` answers, for a CUDA MetaTensor, what
``select_sdp_backend`` answers on a GPU of the mode's profile (Note [SDPA
backend choice] in sdp_choice.py); for other devices torch's own kernel
answers.  ``F.scaled_dot_product_attention`` is a C++ composite that never
asks the dispatcher on a ``meta`` tensor (it calls the choice's device stub
for ``query.device()``, which is ``meta``), so under a MetaMode a Python
version of its body (attention.cpp, ``scaled_dot_product_attention``) is
called instead (Note [Composite overrides]): it asks ``_fused_sdp_choice``
and calls the chosen kernel's op with the same padding, mask conversion and
expansion as the C++, so the trace holds ``_scaled_dot_product_cudnn_attention``,
``_scaled_dot_product_flash_attention`` or ``_scaled_dot_product_efficient_attention``
and their backward ops.  The choice itself is not a call in the trace: on a
real GPU it is a plain C++ function call, not a dispatched op.

Limits: only a logical CUDA device is answered this way (a logical CPU
already gets torch's own C++ choice, Note [Backend keys of a logical CPU]);
MetaTensors used without a mode still take the math path.
"""

from __future__ import annotations

import math

import torch

from .. import _compat
from ..core.registry import builtin_rule
from ..mode.mode import active_profile
from ..tensor.tensor import MetaTensor
from ..values import composites
from .attention_math import math_attention
from .sdp_choice import CUDNN, EFFICIENT, FLASH, MATH, TORCH_2_14, SDPParams, select_sdp_backend

aten = torch.ops.aten
_sdpa = _compat.sdpa_entry


_profile = active_profile  # no mode: the default GPU


@builtin_rule(aten._fused_sdp_choice.default)
def fused_sdp_choice(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False, fallback
):
    """_fused_sdp_choice_meta with CUDA's stub answered for the mode's GPU profile."""
    if query.device.type != "cuda":
        return fallback(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    params = SDPParams(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    return select_sdp_backend(params, _profile())


def _validate(query, key, value, attn_mask) -> None:  # validate_sdpa_input
    torch._check(
        query.dtype == key.dtype == value.dtype,
        lambda: (
            f"Expected query, key, and value to have the same dtype, but got query.dtype: {query.dtype} "
            f"key.dtype: {key.dtype} and value.dtype: {value.dtype} instead."
        ),
    )
    torch._check(
        query.device == key.device == value.device,
        lambda: (
            f"Expected query, key, and value to have the same device type, but got query.device: "
            f"{query.device} key.device: {key.device} and value.device: {value.device} instead."
        ),
    )
    torch._check(
        query.dim() >= 2 and key.dim() >= 2 and value.dim() >= 2,
        lambda: (
            f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
            f"{query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead."
        ),
    )
    if attn_mask is not None:
        torch._check(
            attn_mask.dtype in (torch.bool, query.dtype),
            lambda: (
                f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                f"attn_mask.dtype: {attn_mask.dtype} and  query.dtype: {query.dtype} instead."
            ),
        )


def _additive(mask, dtype, fill: float):
    """convert_boolean_attn_mask (fill -inf) and its cuDNN twin (fill -65504, scalar on CPU)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    device = mask.device if fill == -math.inf else "cpu"  # the cuDNN twin's zero has no device: CPU
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype, device=device))


def _pad_last(t, alignment: int):  # pad_last_dim<alignment, false>
    rest = t.shape[-1] % alignment
    return t if rest == 0 else torch.nn.functional.pad(t, (0, alignment - rest))


def _efficient_mask(mask, query, key):  # preprocess_mask (pad_bias<8> where not aligned_tensor<8>)
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        size = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, 8 - size % 8))[..., :size]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """attention.cpp's ``scaled_dot_product_attention`` for a CUDA device."""
    _validate(query, key, value, attn_mask)
    unbatched = TORCH_2_14 and query.dim() == key.dim() == value.dim() == 3
    if unbatched:  # normalize_unbatched_input, before the choice as in 2.14's composite
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        while attn_mask is not None and attn_mask.dim() < 4:
            attn_mask = attn_mask.unsqueeze(0)
    # A plain call, as the C++ calls the stub: the choice is no op of the program.
    params = SDPParams(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    backend = select_sdp_backend(params, _profile())
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if backend == CUDNN:
        out = aten._scaled_dot_product_cudnn_attention(
            query,
            key,
            value,
            _additive(attn_mask, query.dtype, -65504.0),
            grad,
            dropout_p,
            is_causal,
            False,
            scale=scale,
        )[0]
    elif backend == FLASH:
        size = query.shape[-1]
        scale = scale if scale is not None else 1.0 / math.sqrt(size)  # sdp::calculate_scale on the unpadded size
        out = aten._scaled_dot_product_flash_attention(
            _pad_last(query, 8), _pad_last(key, 8), _pad_last(value, 8), dropout_p, is_causal, False, scale=scale
        )[0]
        if out.shape[-1] != size:  # post_process_flash_output
            out = out[..., :size]
    elif backend == EFFICIENT:
        mask = _additive(attn_mask, query.dtype, -math.inf)
        if mask is not None:
            mask = _efficient_mask(mask, query, key)
        out = aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, grad, dropout_p, is_causal, scale=scale
        )[0]
    else:
        assert backend == MATH, backend
        if dropout_p > 0.0:  # Note [The math backend's dropout on a GPU] in attention_math.py
            out = math_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, _native_dropout
            )[0]
        else:  # the C++ body on a meta tensor takes the math path, as a real GPU would here
            out = _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return out.squeeze(0) if unbatched else out


def _native_dropout(attn, p):
    # at::dropout's fused kernel takes 0 < p < 1 and a non-empty input; the rest, its generic body
    if p < 1 and attn.numel() > 0:
        return torch.native_dropout(attn, p, True)[0]
    return torch.dropout(attn, p, True)


def _on_logical_cuda(args, kwargs) -> bool:
    query = args[0] if args else kwargs.get("query")
    # A DTensor of logical-CUDA shards (context parallelism's SDPA) takes the
    # same choice: C++ asks the stub for the DTensor's device and shapes.
    return isinstance(_compat.local_shard(query), MetaTensor) and query.device.type == "cuda"


composites.register_override(_sdpa, scaled_dot_product_attention, _on_logical_cuda)
