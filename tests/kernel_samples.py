"""Samples of the ops classed ``kernel`` (their CPU kernel checks their index-like arguments), for the proofs.

tests/trust/test_positions_kernels.py takes its samples from op_db first: it runs
the OpInfos that reach these ops under a dispatch logger and keeps the calls
it sees.  Ops op_db never reaches -- composites (``nll_loss_nd``,
``cross_entropy_loss``), in-place forms, backward kernels -- get the
legitimate calls below, by packet; an in-place packet op_db misses also
takes its functional packet's samples (``index_put_`` from ``index_put``).
"""

from __future__ import annotations

import torch

T = torch.tensor
A = torch.ops.aten


def _x(*shape):
    torch.manual_seed(0)
    return torch.randn(*shape)


def _lstm_params(input_size, hidden, gates):
    return [_x(gates * hidden, input_size), _x(gates * hidden, hidden), _x(gates * hidden), _x(gates * hidden)]


def _packed(gates):
    data, batch_sizes = _x(7, 3), T([3, 2, 1, 1])
    return data, batch_sizes, _lstm_params(3, 4, gates)


def _rnn(op, gates, hx):
    def build():
        data, batch_sizes, params = _packed(gates)
        return (data, batch_sizes, hx(), params, True, 1, 0.0, False, False), {}

    return (op, build)


HAND = [
    (A._index_put_impl.default, lambda: ((_x(4, 3), [T([0, 2])], _x(2, 3), False, True), {})),
    (A._index_put_impl_.default, lambda: ((_x(4, 3), [T([0, 2])], _x(2, 3), True, True), {})),
    (A._pack_padded_sequence.default, lambda: ((_x(5, 2, 3), T([5, 3]), False), {})),
    (A._unsafe_index.Tensor, lambda: ((_x(4, 3), [T([0, 3, 1])]), {})),
    (A._unsafe_index_put.default, lambda: ((_x(4, 3), [T([0, 3])], _x(2, 3), False), {})),
    (A.cross_entropy_loss.default, lambda: ((_x(4, 5), T([0, 1, 4, 2])), {})),
    (A.cummaxmin_backward.default, lambda: ((_x(3, 4), _x(3, 4), torch.zeros(3, 4, dtype=torch.int64), 1), {})),
    (A.embedding_renorm.default, lambda: ((_x(5, 3), T([0, 4]), 1.0, 2.0), {})),
    (A.embedding_renorm_.default, lambda: ((_x(5, 3), T([0, 4]), 1.0, 2.0), {})),
    (A.gather_backward.default, lambda: ((_x(3, 2), _x(3, 4), 1, T([[0, 3], [1, 1], [2, 0]]), False), {})),
    (A.index_copy_.default, lambda: ((_x(5, 3), 0, T([0, 4]), _x(2, 3)), {})),
    (A.index_fill_.int_Scalar, lambda: ((_x(5, 3), 0, T([0, 4]), 1.5), {})),
    (A.index_put_.default, lambda: ((_x(4, 3), [T([0, 2])], _x(2, 3)), {})),
    (A.index_reduce_.default, lambda: ((_x(5, 3), 0, T([0, 4]), _x(2, 3), "prod"), {})),
    (A.index_select_backward.default, lambda: ((_x(3, 2), [3, 4], 1, T([0, 3])), {})),
    _rnn(A.lstm.data, 4, lambda: [torch.zeros(1, 3, 4), torch.zeros(1, 3, 4)]),
    _rnn(A.gru.data, 3, lambda: torch.zeros(1, 3, 4)),
    _rnn(A.rnn_tanh.data, 1, lambda: torch.zeros(1, 3, 4)),
    _rnn(A.rnn_relu.data, 1, lambda: torch.zeros(1, 3, 4)),
    (A.lu_solve.default, lambda: ((_x(4, 2), *torch.linalg.lu_factor(_x(4, 4))), {})),
    (A.masked_scatter_.default, lambda: ((_x(4), T([True, False, True, False]), _x(2)), {})),
    (A.multilabel_margin_loss.default, lambda: ((_x(2, 4), T([[0, 3, -1, 0], [1, -1, 0, 0]])), {})),
    (A.narrow.Tensor, lambda: ((_x(5), 0, T(1), 2), {})),
    (A.nll_loss.default, lambda: ((_x(4, 5).log_softmax(1), T([0, 1, 4, 2])), {})),
    (A.nll_loss2d.default, lambda: ((_x(2, 3, 2, 2).log_softmax(1), T([[[0, 1], [2, 0]], [[1, 1], [0, 2]]])), {})),
    (A.nll_loss_nd.default, lambda: ((_x(4, 5).log_softmax(1), T([0, 1, 4, 2])), {})),
    (A.one_hot.default, lambda: ((T([0, 2, 1]), 3), {})),
    (A.repeat_interleave.Tensor, lambda: ((T([1, 0, 2]),), {})),
    (A.repeat_interleave.self_Tensor, lambda: ((_x(3), T([1, 0, 2])), {})),
    (A.put_.default, lambda: ((_x(3, 4), T([0, 11]), _x(2)), {})),
    (A.scatter_add_.default, lambda: ((_x(3, 4), 1, T([[0], [3], [1]]), _x(3, 1)), {})),
    (A.scatter_reduce_.two, lambda: ((_x(3, 4), 1, T([[0], [3], [1]]), _x(3, 1), "sum"), {})),
    (A.take_along_dim.default, lambda: ((_x(3, 4), T([[0], [3], [1]]), 1), {})),
    (A.tensor_split.tensor_indices_or_sections, lambda: ((_x(5), T([1, 3])), {})),
    (A.value_selecting_reduction_backward.default, lambda: ((_x(3), 1, T([0, 3, 1]), [3, 4], False), {})),
]
