"""The cuDNN branch of ``_VF.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` on a logical GPU.

The C++ composites send a CUDA input to cuDNN (``use_cudnn`` in
aten/src/ATen/native/RNN.cpp); on a logical GPU's meta tensors they would take
the generic path, so under a MetaMode (and for MetaTensors without one) a
Python version of their cuDNN branch, ``_cudnn_impl`` in
aten/src/ATen/native/cudnn/RNN.cpp, is called instead (Note [Composite
overrides]); the ops it records are answered by ``cudnn_rnn.py``.  What is
ported and what is not: Note [cuDNN RNNs on a logical GPU] in ``cudnn_rnn.py``.
"""

from __future__ import annotations

import weakref

import torch

from .. import _compat
from ..mode.mode import active_profile
from ..tensor.describe import data_dependent_error
from ..tensor.tensor import MetaTensor, read_value
from ..values import composites
from .cudnn_rnn import GRU, LSTM, RNN_RELU, RNN_TANH

__all__ = ["use_cudnn"]

aten = torch.ops.aten
_VF = _compat.variable_functions
_CUDNN_DTYPES = (torch.float16, torch.float32, torch.float64)


def use_cudnn(t) -> bool:
    """``use_cudnn`` in RNN.cpp, for a logical GPU of the active profile (Note [cuDNN RNNs on a logical GPU])."""
    if not (isinstance(t, MetaTensor) and t.device.type == "cuda" and torch.backends.cudnn.enabled):
        return False
    if t.numel() == 0:
        return False
    if t.dtype == torch.bfloat16:  # supportsBFloat16RNNWithCuDNN
        profile = active_profile()
        return profile.compute_capability >= (8, 0) and profile.cudnn_version >= 91300
    return t.dtype in _CUDNN_DTYPES


# MetaMode -> the dropout state its trace made (get_dropout_state's process-wide cache, per trace)
_DROPOUT_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _dropout_state(dropout, train, input):
    """``get_dropout_state``: made on the first call that needs one, then handed to every call.

    Without a mode there is no trace to hold it, and a factory with no
    MetaTensor among its arguments would reach torch's own CUDA: none is
    made (``_cudnn_rnn``'s outputs do not depend on it)."""
    mode = _compat.get_infra_mode(_compat.mode_key)
    if mode is None:
        return None
    state = _DROPOUT_STATES.get(mode)
    if train and dropout > 0 and state is None:
        state = _DROPOUT_STATES[mode] = aten._cudnn_init_dropout_state(
            dropout, train, 0, dtype=torch.uint8, device=input.device
        )
    return state


def _batch_sizes(batch_sizes) -> list:
    torch._check(batch_sizes.dim() == 1, lambda: "batch_sizes tensor should be 1D")
    where = batch_sizes.device
    torch._check(where.type == "cpu", lambda: f"batch_sizes tensor should be on CPU, but got {where}")
    value = read_value(batch_sizes) if isinstance(batch_sizes, MetaTensor) else batch_sizes
    if value is None:
        op = "aten._cudnn_rnn.default (the batch sizes of a PackedSequence)"
        raise data_dependent_error(op, (batch_sizes,), {})
    return [int(v) for v in value.tolist()]


def _cudnn_impl(mode, input, batch_sizes, hx, cx, params, has_biases, num_layers, dropout, train, bidi, batch_first):
    """``_cudnn_impl`` in cudnn/RNN.cpp, both overloads (Note [cuDNN RNNs on a logical GPU])."""
    hidden_size, proj_size = hx.shape[2], 0
    if cx is not None and cx.shape[2] != hx.shape[2]:  # an LSTM with projections
        hidden_size, proj_size = cx.shape[2], hx.shape[2]
    sizes = _batch_sizes(batch_sizes) if batch_sizes is not None else []
    state = _dropout_state(dropout, train, input)
    count = (4 if has_biases else 2) + (1 if proj_size else 0)
    output, hy, cy, _, _ = aten._cudnn_rnn(
        input, params, count, None, hx, cx, mode, hidden_size, proj_size, num_layers,
        batch_first, dropout, train, bidi, sizes, state,
    )  # fmt: skip
    return output, hy, cy


def _packed(args) -> bool:
    # (data, batch_sizes, hx, params, ...) rather than (input, hx, params, has_biases, ...)
    return isinstance(args[1], torch.Tensor) and isinstance(args[3], (list, tuple))


def _lstm(*args):
    if _packed(args):
        data, batch_sizes, hx, params, *rest = args
        output, hy, cy = _cudnn_impl(LSTM, data, batch_sizes, hx[0], hx[1], params, *rest, False)
    else:
        input, hx, params, *rest = args
        torch._check(len(hx) == 2, lambda: "lstm expects two hidden states")
        output, hy, cy = _cudnn_impl(LSTM, input, None, hx[0], hx[1], params, *rest)
    return output, hy, cy


def _one_hidden(mode):
    def impl(*args):
        if _packed(args):
            data, batch_sizes, hx, params, *rest = args
            output, hy, _ = _cudnn_impl(mode, data, batch_sizes, hx, None, params, *rest, False)
        else:
            input, hx, params, *rest = args
            output, hy, _ = _cudnn_impl(mode, input, None, hx, None, params, *rest)
        return output, hy

    return impl


def _on_cudnn(args, kwargs) -> bool:
    return not kwargs and len(args) == 9 and use_cudnn(args[0])


for _function, _impl in (
    (_VF.lstm, _lstm),
    (_VF.gru, _one_hidden(GRU)),
    (_VF.rnn_tanh, _one_hidden(RNN_TANH)),
    (_VF.rnn_relu, _one_hidden(RNN_RELU)),
):
    composites.register_override(_function, _impl, _on_cudnn)
