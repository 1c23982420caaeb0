"""C++ composites that read the C++ device, overridden while a MetaMode is entered.

Note [Composite overrides]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``CompositeImplicitAutograd`` op (``tensor_split`` with a tensor of
indices) runs its C++ body above the Python dispatch key, so no rule can
see it; only the ops it calls reach us.  When that body checks the C++
device it finds ``meta`` (Note [Logical device]) and fails where the real
device would not: ``tensor_split expected tensor_indices_or_sections to be
on cpu, but it's on meta``.

For such ops the MetaMode's torch-function mode (``_SwapReal`` in mode.py,
pushed while a MetaMode is entered in this thread) calls a Python version of
the body instead, when a MetaTensor is among the arguments that matter; the
Python version's own ops reach the dispatch as usual.  Nothing is registered
with torch's dispatcher: an earlier version registered kernels at the
``AutogradMeta`` and ``AutogradCPU`` keys on each first mode entry, which
changed the op for every thread while registered and grew the process by
~4 KB per mode entry (registering and removing kernels leaks in the
dispatcher), unbounded in a loop of entries.

A logical-CPU MetaTensor reports ``cpu`` to C++ (Note [Backend keys of a
logical CPU]), so composites that only *check* the device, or choose a kernel
by it (SDPA's backend, an RNN's ``mkldnn_rnn_layer``), need no override there;
what remains are composites that read tensor *values* through a data pointer.

MetaTensors used without a mode get the same overrides from their own
``__torch_function__`` (Note [Composite overrides without a mode] in
mode.py).  Limits: calls that reach the C++ op without a torch function
(from another C++ composite) still run the C++ body.
"""

from __future__ import annotations

import torch

from .. import _compat
from .router import data_dependent_error
from .tensor import MetaTensor, read_value

__all__ = ["override_for", "register_override", "OVERRIDES"]

aten = torch.ops.aten


# Note [Where the user's tensor is]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``MetaMode(device="cuda")`` traces the user's program as it would run on
# the GPU, so the real tensors it converts report ``cuda``.  A small tensor
# from the user's scope that the program uses as a split's indices, though,
# stays on the CPU in that GPU program -- ``tensor_split`` requires it
# there, and nothing moves it -- so the split's device check asks where the
# user's tensor is (``_md_user_device``, set by ``MetaMode.from_scope``), as
# it would be without a mode.
def _tensor_split(self, indices, dim=0):
    op = aten.tensor_split.tensor_indices_or_sections
    if not isinstance(indices, MetaTensor):
        return op.decompose(self, indices, dim)
    where = indices.__dict__.get("_md_user_device", indices.device)
    torch._check(
        where.type == "cpu",
        lambda: f"tensor_split expected tensor_indices_or_sections to be on cpu, but it's on {where}",
    )
    torch._check(
        indices.dtype == torch.long,
        lambda: f"tensor_split expected tensor_indices_or_sections to have dtype of long, but got {indices.dtype}",
    )
    torch._check(
        indices.dim() in (0, 1),
        lambda: (
            f"tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
            f"one-dimensional tensor, but got a tensor with {indices.dim()} dims"
        ),
    )
    if indices.dim() == 0:
        return torch.tensor_split(self, indices.item(), dim)  # item() as in the C++ body
    value = read_value(indices)  # Note [Known values]
    if value is None:
        raise data_dependent_error(f"{op} (tensor indices)", (self, indices), {})
    return torch.tensor_split(self, value.tolist(), dim)


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
        value = read_value(batch_sizes)  # Note [Known values]
        if value is None:
            raise data_dependent_error(f"{op} (the batch sizes of a PackedSequence)", (data, batch_sizes), {})
        return _compat.decomposition_table()[op](data, value.tolist(), *rest)

    return impl


def _pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length):
    """``_pad_packed_sequence``'s C++ body (PackedSequence.cpp), on the known batch sizes."""
    op = aten._pad_packed_sequence.default
    if not isinstance(batch_sizes, MetaTensor):
        return op.decompose(data, batch_sizes, batch_first, padding_value, total_length)
    value = read_value(batch_sizes)  # Note [Packed sequences]
    if value is None:
        raise data_dependent_error(f"{op} (the batch sizes of a PackedSequence)", (data, batch_sizes), {})
    sizes = value.tolist()
    steps, max_batch = len(sizes), sizes[0]
    if total_length != -1:
        torch._check(
            total_length >= steps,
            lambda: (
                f"Expected total_length to be at least the length of the longest sequence, "
                f"but got total_length={total_length} and max sequence length being {steps}"
            ),
        )
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


def _matrix_rank(input, *args, **kwargs):
    """``linalg_matrix_rank``'s C++ body answers an empty matrix with
    ``at::zeros`` from the input's options: on a MetaTensor with no mode a
    real CPU tensor nobody intercepts (inside a mode the factory reaches the
    mode).  Answered here as the body would, through the MetaTensor."""
    if input.numel() == 0 and (input.is_floating_point() or input.is_complex()) and input.dim() >= 2:
        return input.new_zeros(input.shape[:-2], dtype=torch.long)
    with _compat.no_torch_function_subclass():
        return torch.linalg.matrix_rank(input, *args, **kwargs)


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
        and x._md_device.type == "cuda"
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
        and args[0]._md_device.type == "cuda"
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
        and x._md_device.type == "cuda"
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
        and x._md_device.type == "cuda"
        and not bound.get("inplace", False)
        and train is True
        and isinstance(p, (int, float))
        and 0 < p < 1
        and x.numel() > 0
    )


def _functional_dropout(input, p=0.5, training=True, inplace=False):
    return torch.native_dropout(input, p, training)[0]


OVERRIDES = {
    "linalg_matrix_rank": _matrix_rank,
    "_pad_packed_sequence": _pad_packed_sequence,
    "tensor_split.tensor_indices_or_sections": _tensor_split,
    "lstm.data": _rnn_data("lstm"),
    "gru.data": _rnn_data("gru"),
}
_VF = _compat.variable_functions


def _tensor_indices(args, kwargs) -> bool:
    return not kwargs.keys() - {"dim"} and len(args) > 1 and isinstance(args[1], torch.Tensor)


def _packed(args, kwargs) -> bool:
    # (data, batch_sizes, hx, params, ...) rather than (input, hx, params, has_biases, ...)
    return not kwargs and len(args) > 3 and isinstance(args[1], torch.Tensor) and isinstance(args[3], (list, tuple))


# torch function -> [(override, whether a call is the overload it replaces)], first match wins
_BY_FUNCTION: dict = {
    _VF.tensor_split: [(OVERRIDES["tensor_split.tensor_indices_or_sections"], _tensor_indices)],
    torch.Tensor.tensor_split: [(OVERRIDES["tensor_split.tensor_indices_or_sections"], _tensor_indices)],
    _VF.lstm: [(OVERRIDES["lstm.data"], _packed)],
    _VF.gru: [(OVERRIDES["gru.data"], _packed)],
    _VF._pad_packed_sequence: [(OVERRIDES["_pad_packed_sequence"], lambda args, kwargs: not kwargs)],
    torch.linalg.matrix_rank: [(OVERRIDES["linalg_matrix_rank"], lambda args, kwargs: bool(args))],
    torch.Tensor.__setitem__: [(_setitem_number, _setitem_number_applies)],
    _VF.rms_norm: [(_rms_norm, _rms_norm_applies)],
    torch.nn.functional.rms_norm: [(_rms_norm, _rms_norm_applies)],
    _VF.dropout: [(_native_dropout, _dropout_applies)],
    torch.nn.functional.dropout: [(_functional_dropout, _dropout_applies)],
    **{
        f: [(_half_to_float(op), _half_to_float_applies)]
        for f, op in (
            (_VF.softmax, _VF._softmax),
            (torch.Tensor.softmax, _VF._softmax),
            (_VF.log_softmax, _VF._log_softmax),
            (torch.Tensor.log_softmax, _VF._log_softmax),
        )
    },
}


def register_override(function, impl, applies) -> None:
    """Call ``impl`` instead of torch function ``function`` while a MetaMode is
    entered, for calls where ``applies(args, kwargs)``; for composites whose
    override belongs with a rule family (rules/attention.py's SDPA).  It is
    asked before the overrides registered earlier for the same function
    (rules/cudnn_rnn.py's before the packed-sequence ones above)."""
    _BY_FUNCTION.setdefault(function, []).insert(0, (impl, applies))


def override_for(func, args, kwargs):
    """The override to call instead of ``func(*args, **kwargs)``, or None."""
    entries = _BY_FUNCTION.get(func)
    if entries is None or not any(isinstance(a, MetaTensor) for a in args[:2]):
        return None
    return next((impl for impl, applies in entries if applies(args, kwargs)), None)
