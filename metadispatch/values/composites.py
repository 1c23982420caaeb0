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

import warnings

import torch

from .. import _compat
from ..tensor.describe import data_dependent_error
from ..tensor.tensor import MetaTensor, read_value
from . import packed_rnn

__all__ = ["override_for", "register_override", "OVERRIDES"]

aten = torch.ops.aten


# Note [Where the user's tensor is]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``MetaMode(device="cuda")`` traces the user's program as it would run on
# the GPU, so the real tensors it converts report ``cuda``.  A small tensor
# from the user's scope that the program uses as a split's indices, though,
# stays on the CPU in that GPU program -- ``tensor_split`` requires it
# there, and nothing moves it -- so the split's device check asks where the
# user's tensor is (``_md.user_device``, set by ``MetaMode.from_scope``), as
# it would be without a mode.
def _tensor_split(self, indices, dim=0):
    op = aten.tensor_split.tensor_indices_or_sections
    if not isinstance(indices, MetaTensor):
        return op.decompose(self, indices, dim)
    where = indices._md.user_device or indices.device
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
# ``lstm``/``gru``/``rnn_tanh``/``rnn_relu`` on a PackedSequence call ``aten.lstm.data`` (and so on), whose C++ body
# reads ``batch_sizes`` through a data pointer: on a MetaTensor, "data is not
# allocated yet".  ``batch_sizes`` comes from ``pack_padded_sequence``; when
# its value is known (built from constants, or kept by md.check from the
# real kernel's answer) the CPU kernel's path runs on that list of sizes
# (Note [Packed RNNs as the CPU kernel runs them] in packed_rnn.py), torch's
# decomposition on other devices.


_CPU_PACKED = {
    "lstm": packed_rnn.lstm_data,
    "gru": packed_rnn.gru_data,
    "rnn_tanh": packed_rnn.rnn_tanh_data,
    "rnn_relu": packed_rnn.rnn_relu_data,
}


def _rnn_data(name: str):
    op = getattr(aten, name).data

    def impl(data, batch_sizes, *rest):
        if not isinstance(batch_sizes, MetaTensor):
            return op.decompose(data, batch_sizes, *rest)
        value = read_value(batch_sizes)  # Note [Known values]
        if value is None:
            raise data_dependent_error(f"{op} (the batch sizes of a PackedSequence)", (data, batch_sizes), {})
        if data.device.type == "cpu":  # Note [Packed RNNs as the CPU kernel runs them]
            return _CPU_PACKED[name](data, value.tolist(), *rest)
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


def _is_scalar_tensor_true(t) -> bool:
    """ATen's ``at::is_scalar_tensor_true``: ``equal`` with a one of its options."""
    return torch.equal(t, t.new_ones((), dtype=t.dtype))


def _cov(input, *, correction=1, fweights=None, aweights=None):
    """``at::cov``'s C++ body (Correlation.cpp), op for op.  On a MetaTensor of a
    logical GPU with no mode, its ``at::scalar_tensor(n, in.options())`` is a
    plain meta tensor nobody intercepts, and torch's ``equal`` on it raised
    NotImplementedError; here the factory takes the MetaTensor's device.
    (Inside a mode the mode catches it: the C++ body runs there.)"""
    torch._check(
        input.ndim < 3,
        lambda: f"cov(): expected input to have two or fewer dimensions but got an input with {input.ndim} dimensions",
    )
    inp = input.view(1, -1) if input.ndim < 2 else input
    n = inp.size(1)
    w = None
    if fweights is not None:
        torch._check(fweights.ndim <= 1, lambda: "cov(): expected fweights to have one or fewer dimensions")
        torch._check(
            not fweights.is_floating_point() and not fweights.is_complex(),
            lambda: "cov(): expected fweights to have integral dtype",
        )
        torch._check(
            fweights.numel() == n,
            lambda: "cov(): expected fweights to have the same numel as there are observations in the input",
        )
        torch._check(
            n == 0 or _is_scalar_tensor_true(fweights.min().ge(0)), lambda: "cov(): fweights cannot be negative"
        )
        w = fweights
    if aweights is not None:
        torch._check(aweights.ndim <= 1, lambda: "cov(): expected aweights to have one or fewer dimensions")
        torch._check(aweights.is_floating_point(), lambda: "cov(): expected aweights to have floating point dtype")
        torch._check(
            aweights.numel() == n,
            lambda: "cov(): expected aweights to have the same numel as there are observations in the input",
        )
        torch._check(
            n == 0 or _is_scalar_tensor_true(aweights.min().ge(0)), lambda: "cov(): aweights cannot be negative"
        )
        w = w * aweights if w is not None else aweights
    w_sum = w.sum() if w is not None else inp.new_full((), n, dtype=torch.long)
    torch._check(
        w is None or _is_scalar_tensor_true(w_sum.ne(0)), lambda: "cov(): weights sum to zero, can't be normalized"
    )
    avg = (inp * w if w is not None else inp).sum(1) / w_sum
    if w is not None and aweights is not None and correction != 0:
        norm_factor = w_sum - correction * (w * aweights).sum() / w_sum
    else:
        norm_factor = w_sum - correction
    if _is_scalar_tensor_true(norm_factor.le(0)):
        warnings.warn(
            "cov(): degrees of freedom is <= 0. Correction should be strictly less than the number of observations.",
            stacklevel=3,
        )
        norm_factor.zero_()
    inp = inp - avg.unsqueeze(1)
    c = torch.mm(inp, (inp * w if w is not None else inp).t().conj())
    return torch.true_divide(c, norm_factor).squeeze()


# Note [one_hot's checks]
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``one_hot``'s C++ body (Onehot.cpp) has two branches.  On a tensor with
# the Python key (a MetaTensor, a FakeTensor) it answers
# ``eq(self.unsqueeze(-1), arange(n))``, which gives a row of zeros for a
# class outside ``[0, n)`` and checks nothing; on a real tensor it checks
# the classes and scatters ones into zeros.  The first branch made a trace
# in which an out-of-range class passed, and replay of that trace said ok
# where eager raises.  The real branch runs here instead, op for op, with
# the two value reads eager makes on the CPU (``aminmax`` and ``item()`` of
# each end) recorded as ``_assert_async`` of the same comparison with
# eager's message: replay then raises as eager does, and a known input
# raises while tracing.  On any other device eager checks nothing itself
# and relies on ``scatter_``'s device assert; replay's own check of
# ``scatter_``'s index (trust/value_checks.py) stops such a call before the
# kernel.


def _one_hot(self, num_classes=-1):
    """``at::native::one_hot``'s real-tensor branch on the program's device (Note [one_hot's checks])."""
    torch._check(self.dtype == torch.long, lambda: "one_hot is only applicable to index tensor of type LongTensor.")
    shape = tuple(self.shape)
    if self.numel() == 0:
        torch._check(num_classes > 0, lambda: "Can not infer total number of classes from empty tensor.")
        return _zeros_or_empty(self, shape + (num_classes,), torch.empty, self.new_empty)
    if self.device.type == "cpu":
        low, high = torch.aminmax(self)
        aten._assert_async.msg(low >= 0, "Class values must be non-negative.")
        if num_classes == -1:
            num_classes = high.item() + 1
        else:
            aten._assert_async.msg(high < num_classes, "Class values must be smaller than num_classes.")
    elif num_classes == -1:
        num_classes = self.max().item() + 1
    else:
        torch._check(num_classes >= 1, lambda: "num_classes should be positive")
    out = _zeros_or_empty(self, shape + (num_classes,), torch.zeros, self.new_zeros)
    return out.scatter_(-1, self.unsqueeze(-1), 1)


def _zeros_or_empty(like, shape, factory, method):
    """Eager's ``at::zeros``/``at::empty`` of ``like``'s options: inside a mode
    the factory reaches the mode as eager's does; without one a factory would
    make a real tensor (Note [Composite overrides without a mode]), so the
    tensor method makes it from ``like``."""
    if _compat.dispatch_mode_stack():
        return factory(shape, dtype=like.dtype, device=like.device)
    return method(shape)


def _outside_a_mode(args, kwargs) -> bool:
    return bool(args) and not _compat.dispatch_mode_stack()


OVERRIDES = {
    "one_hot": _one_hot,
    "cov": _cov,
    "linalg_matrix_rank": _matrix_rank,
    "_pad_packed_sequence": _pad_packed_sequence,
    "tensor_split.tensor_indices_or_sections": _tensor_split,
    "lstm.data": _rnn_data("lstm"),
    "gru.data": _rnn_data("gru"),
    "rnn_tanh.data": _rnn_data("rnn_tanh"),
    "rnn_relu.data": _rnn_data("rnn_relu"),
}
_VF = _compat.variable_functions


def _tensor_indices(args, kwargs) -> bool:
    return not kwargs.keys() - {"dim"} and len(args) > 1 and isinstance(args[1], torch.Tensor)


def _packed(args, kwargs) -> bool:
    # (data, batch_sizes, hx, params, ...) rather than (input, hx, params, has_biases, ...)
    return not kwargs and len(args) > 3 and isinstance(args[1], torch.Tensor) and isinstance(args[3], (list, tuple))


# torch function -> [(override, whether a call is the overload it replaces)], first match wins
BY_FUNCTION: dict = {
    _VF.tensor_split: [(OVERRIDES["tensor_split.tensor_indices_or_sections"], _tensor_indices)],
    torch.Tensor.tensor_split: [(OVERRIDES["tensor_split.tensor_indices_or_sections"], _tensor_indices)],
    _VF.lstm: [(OVERRIDES["lstm.data"], _packed)],
    _VF.gru: [(OVERRIDES["gru.data"], _packed)],
    _VF.rnn_tanh: [(OVERRIDES["rnn_tanh.data"], _packed)],
    _VF.rnn_relu: [(OVERRIDES["rnn_relu.data"], _packed)],
    _VF._pad_packed_sequence: [(OVERRIDES["_pad_packed_sequence"], lambda args, kwargs: not kwargs)],
    torch.linalg.matrix_rank: [(OVERRIDES["linalg_matrix_rank"], lambda args, kwargs: bool(args))],
    torch.cov: [(OVERRIDES["cov"], _outside_a_mode)],
    torch.nn.functional.one_hot: [(OVERRIDES["one_hot"], lambda args, kwargs: bool(args))],
    torch.Tensor.cov: [(OVERRIDES["cov"], _outside_a_mode)],
}


def register_override(function, impl, applies) -> None:
    """Call ``impl`` instead of torch function ``function`` while a MetaMode is
    entered, for calls where ``applies(args, kwargs)``; for composites whose
    override belongs with a rule family (rules/attention.py's SDPA).  It is
    asked before the overrides registered earlier for the same function
    (rules/cudnn_rnn.py's before the packed-sequence ones above)."""
    BY_FUNCTION.setdefault(function, []).insert(0, (impl, applies))


def override_for(func, args, kwargs):
    """The override to call instead of ``func(*args, **kwargs)``, or None."""
    entries = BY_FUNCTION.get(func)
    # A DTensor over MetaTensor shards counts as one: its composite's C++ body
    # would read the shards' meta device as a real one would read CUDA.
    if entries is None or not any(isinstance(_compat.local_shard(a), MetaTensor) for a in args[:2]):
        return None
    return next((impl for impl, applies in entries if applies(args, kwargs)), None)
