"""C++ composites that read the C++ device, overridden while a MetaMode is entered.

Note [Composite overrides]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``CompositeImplicitAutograd`` op (``tensor_split`` with a tensor of
indices) runs its C++ body above the Python dispatch key, so no rule can
see it; only the ops it calls reach us.  When that body checks the C++
device it finds ``meta`` (Note [Logical device]) and fails where the real
device would not: ``tensor_split expected tensor_indices_or_sections to be
on cpu, but it's on meta``.

For such ops a Python kernel is registered at the ``AutogradMeta`` key, the
slot the composite fills for meta tensors, while at least one MetaMode is
entered (reference-counted, removed on the last exit, also on exceptions).
It answers for MetaTensors and hands anything else to the composite
(``OpOverload.decompose``).  Nothing is registered at import time.

The same slot serves a composite that reads the C++ device to choose what
to call (Note [SDPA backend on a logical CPU]).

Limits: MetaTensors used without a mode, and calls under
``torch.inference_mode()`` (which skips autograd keys; torch refuses a Meta
kernel for a composite), still run the C++ body.
"""

from __future__ import annotations

import threading

import torch

from .. import _compat
from .router import data_dependent_error
from .tensor import MetaTensor, value_of

__all__ = ["acquire", "release"]

aten = torch.ops.aten


def _tensor_split(self, indices, dim=0):
    op = aten.tensor_split.tensor_indices_or_sections
    if not isinstance(indices, MetaTensor):
        return op.decompose(self, indices, dim)
    torch._check(indices.device.type == "cpu", lambda: (
        f"tensor_split expected tensor_indices_or_sections to be on cpu, but it's on {indices.device}"))
    torch._check(indices.dtype == torch.long, lambda: (
        f"tensor_split expected tensor_indices_or_sections to have dtype of long, "
        f"but got {indices.dtype}"))
    torch._check(indices.dim() in (0, 1), lambda: (
        f"tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
        f"one-dimensional tensor, but got a tensor with {indices.dim()} dims"))
    if indices.dim() == 0:
        return torch.tensor_split(self, indices.item(), dim)  # item() as in the C++ body
    value = value_of(indices)  # Note [Known values]
    if value is None:
        raise data_dependent_error(f"{op} (tensor indices)", (self, indices), {})
    return torch.tensor_split(self, value.tolist(), dim)


# Note [SDPA backend on a logical CPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``scaled_dot_product_attention`` asks a per-device stub for its backend; meta
# has none, so on MetaTensors it always takes the math decomposition, while a
# real CPU run mostly calls ``_scaled_dot_product_flash_attention_for_cpu``
# (and that op's backward).  For MetaTensors on a logical CPU device we redo
# CPU's choice, ``use_flash_attention_cpp`` in torch's
# ``aten/src/ATen/native/transformers/sdp_utils_cpp.cpp``, and call the flash
# op as ``scaled_dot_product_attention`` in ``attention.cpp`` does, converting
# a bool mask to an additive one first.  The choice is conservative: whatever
# is unsure (a mix of devices or dtypes, a real tensor among the arguments,
# other logical devices -- CUDA's choice depends on the GPU, which we cannot
# check) goes to the composite, which is the math path, as before.
# ``test_composites_sdpa_*`` compare the ops and metadata against real CPU runs.

_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _cpu_flash_heads_ok(q, k, v, enable_gqa: bool) -> bool:
    # check_batch_size_and_num_heads_dense<supports_gqa=true>
    if not q.size(0) == k.size(0) == v.size(0):
        return False
    hq, hk, hv = q.size(-3), k.size(-3), v.size(-3)
    if enable_gqa:
        return hk == hv and hq % hk == 0
    return hq == hk == hv


def _cpu_flash_mask_ok(q, k, mask) -> bool:
    # check_attn_mask_shape; the mask's stride is not checked on CPU
    if mask is None:
        return True
    if mask.requires_grad or mask.dim() not in (2, 4):
        return False
    if mask.size(-2) not in (q.size(2), 1) or mask.size(-1) not in (k.size(2), 1):
        return False
    return mask.dim() == 2 or (mask.size(0) in (1, q.size(0)) and mask.size(1) in (1, q.size(1)))


def _uses_cpu_flash(q, k, v, mask, dropout_p, enable_gqa) -> bool:
    """Whether a real CPU run of these arguments takes the flash kernel."""
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if not all(isinstance(t, MetaTensor) and not t.is_nested for t in tensors):
        return False
    if any(t._md_device.type != "cpu" or t._md_device != q._md_device for t in tensors):
        return False
    if mask is not None and mask.dtype not in (torch.bool, q.dtype):
        return False  # the composite raises the real error
    flash_on, _ = _compat.sdp_backends_enabled()
    return (flash_on and dropout_p <= 0.0
            and q.dim() == k.dim() == v.dim() == 4
            and _cpu_flash_heads_ok(q, k, v, enable_gqa)
            and _cpu_flash_mask_ok(q, k, mask)
            and q.size(-1) == k.size(-1) == v.size(-1)
            and q.size(-2) != 0 and k.size(-2) != 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and q.dtype == k.dtype == v.dtype and q.dtype in _FLASH_CPU_DTYPES)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False):
    if not _uses_cpu_flash(query, key, value, attn_mask, dropout_p, enable_gqa):
        return aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask
        neg_inf = torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=attn_mask.device)
        attn_mask = torch.where(attn_mask, 0.0, neg_inf)
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


# Note [Packed sequences]
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``lstm``/``gru`` on a PackedSequence call ``aten.lstm.data``, whose C++ body
# reads ``batch_sizes`` through a data pointer: on a MetaTensor, "data is not
# allocated yet".  ``batch_sizes`` comes from ``pack_padded_sequence``; when
# its value is known (built from constants, or kept by md.check from the
# real kernel's answer) torch's decomposition runs on that list of sizes.


def _rnn_data(name: str):
    op = getattr(aten, name).data

    def impl(data, batch_sizes, *rest):
        if not isinstance(batch_sizes, MetaTensor):
            return op.decompose(data, batch_sizes, *rest)
        value = value_of(batch_sizes)  # Note [Known values]
        if value is None:
            raise data_dependent_error(f"{op} (the batch sizes of a PackedSequence)", (data, batch_sizes), {})
        return _compat.decomposition_table()[op](data, value.tolist(), *rest)

    return impl


def _pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length):
    """``_pad_packed_sequence``'s C++ body (PackedSequence.cpp), on the known batch sizes."""
    op = aten._pad_packed_sequence.default
    if not isinstance(batch_sizes, MetaTensor):
        return op.decompose(data, batch_sizes, batch_first, padding_value, total_length)
    value = value_of(batch_sizes)  # Note [Packed sequences]
    if value is None:
        raise data_dependent_error(f"{op} (the batch sizes of a PackedSequence)", (data, batch_sizes), {})
    sizes = value.tolist()
    steps, max_batch = len(sizes), sizes[0]
    if total_length != -1:
        torch._check(total_length >= steps, lambda: (
            f"Expected total_length to be at least the length of the longest sequence, "
            f"but got total_length={total_length} and max sequence length being {steps}"))
    rest = tuple(data.shape[1:])
    output = data.new_full((max(total_length, steps), max_batch) + rest, padding_value)
    lengths = [0] * max_batch
    offset, previous, previous_i = 0, max_batch, 0
    for i in range(steps + 1):
        batch = sizes[i] if i != steps else 0
        if batch != previous:
            n = previous * (i - previous_i)
            chunk = data.narrow(0, offset, n).view((i - previous_i, previous) + rest)
            output.narrow(0, previous_i, i - previous_i).narrow(1, 0, previous).copy_(chunk)
            offset, previous_i = offset + n, i
        for j in range(batch, previous):
            lengths[j] = i
        previous = batch
    return (output.transpose(0, 1) if batch_first else output), torch.tensor(lengths, dtype=torch.int64)


OVERRIDES = {
    "_pad_packed_sequence": _pad_packed_sequence,
    "tensor_split.tensor_indices_or_sections": _tensor_split,
    "scaled_dot_product_attention": _sdpa,
    "lstm.data": _rnn_data("lstm"),
    "gru.data": _rnn_data("gru"),
}

_LOCK = threading.Lock()
_STATE = {"count": 0, "lib": None}


def acquire() -> None:
    """Register the overrides (first MetaMode entered)."""
    with _LOCK:
        if _STATE["count"] == 0:
            lib = _compat.library("aten", "IMPL")
            for name, fn in OVERRIDES.items():
                lib.impl(name, fn, "AutogradMeta")
            _STATE["lib"] = lib
        _STATE["count"] += 1


def release() -> None:
    """Remove them again (last MetaMode left)."""
    with _LOCK:
        _STATE["count"] -= 1
        if _STATE["count"] == 0:
            _STATE.pop("lib")._destroy()
            _STATE["lib"] = None
