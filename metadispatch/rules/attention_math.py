"""SDPA's math backend with dropout on a logical GPU: ``native_dropout``, as CUDA runs it.

Note [The math backend's dropout on a GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Where no fused kernel takes an attention (T5's learned position bias is a
mask that needs a gradient, which only the math backend gives), the C++
composite runs ``_scaled_dot_product_attention_math``, whose dropout is
``at::dropout``: on a CUDA tensor one ``native_dropout`` with a boolean
mask (Note [Dropout's fused kernel on a GPU] in gpu/gpu_composites.py), on a
logical GPU's meta tensor the generic four ops and a float mask -- what a
real H100 did not run in T5's training step (tools/gpu_conformance.py).
:func:`math_attention` is the body of that function and the mask conversion
of its caller (attention.cpp), op for op as they dispatch, with the dropout
passed in: on a logical GPU ``native_dropout``.  tests/gpu/test_sdpa_choice.py
holds it, with the generic dropout, to the C++ body's eager CPU calls.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten
_LOW = (torch.float16, torch.bfloat16)


def _additive(mask, dtype):  # convert_boolean_attn_mask: 0 where attended, -inf elsewhere
    if mask is None or mask.dtype != torch.bool:
        return mask
    inf = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device), inf)


def math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout):
    """``scaled_dot_product_attention``'s math path; ``dropout(attn, p)`` stands for ``at::dropout``."""
    attn_mask = _additive(attn_mask, query.dtype)  # the composite converts before choosing
    origin = query.dtype
    if origin in _LOW:  # kept in float32 for accuracy
        query, key, value = query.to(torch.float32), key.to(torch.float32), value.to(torch.float32)
    negative = scale is not None and scale < 0
    softmax_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else abs(scale)
    factor = math.sqrt(softmax_scale)  # sdp::calculate_scale(...).sqrt(): q and k scaled each
    query = aten.mul.Scalar(query, 0.0 - factor if negative else factor)  # C++'s SymFloat: the Scalar overload
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        attn_mask = _additive(causal, query.dtype)
    if enable_gqa and query.shape[-3] != key.shape[-3]:  # pre_process_group_query_attention_input
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    attn = torch.matmul(query, aten.mul.Scalar(key.transpose(-2, -1), factor))
    if attn_mask is not None:
        attn = attn.add(attn_mask)
    attn = aten._safe_softmax.default(attn, -1)
    if dropout_p > 0.0:
        attn = dropout(attn, dropout_p)
    # make_tuple(matmul(attn, value).to(origin), attn.to(origin)): GCC evaluates the second first
    weights = attn.to(origin)
    return torch.matmul(attn, value).to(origin), weights
