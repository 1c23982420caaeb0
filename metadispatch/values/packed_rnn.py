"""``lstm``/``gru``/``rnn_tanh``/``rnn_relu`` over a PackedSequence on a logical CPU, as the CPU kernel runs them.

Note [Packed RNNs as the CPU kernel runs them]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``aten.lstm.data``'s C++ body reads ``batch_sizes`` through a data pointer
(Note [Packed sequences] in composites.py), so on known batch sizes it is
run here.  torch's Python decomposition dispatches other ops than the CPU
kernel (``split_with_sizes``, out-of-place gates), so this is a port of the
kernel's path in ``aten/src/ATen/native/RNN.cpp``, each piece named by its
C++ function: ``PackedLayer`` and ``ReversedPackedLayer`` project the whole
input once (``linear_ih``, the CPU's ``pre_compute_input``), narrow each
step and the hidden states; ``LSTMCell``/``GRUCell``/``SimpleCell`` work in place
(``add_``, ``unsafe_chunk``, ``sigmoid_``, ``tanh_``); ``apply_layer_stack``
drops out between layers; ``_lstm_impl`` and ``_rnn_impl_with_concat``
stack the final states.  Where C++ builds an LSTM's pair with
``std::make_tuple(f(h), f(c))`` the cell state's op runs first: the CPU
build (GCC) evaluates the arguments right to left, which a projected LSTM's
final ``stack``s and the slices' backward order show (tests/rules/
test_packed_sequence.py compares every call with eager's).  An LSTM whose
batch sizes are all equal (every sequence full length, or one sequence),
without projections, on a dtype oneDNN takes, is not packed at all to the
kernel: it views the data as ``[steps, batch, features]`` and runs the
padded ``lstm``'s oneDNN path (``mkldnn_rnn_layer``), which
``aten.lstm.input`` dispatches as it does.  Only the CPU path: other
logical devices keep torch's decomposition.
"""

from __future__ import annotations

import torch

from .. import _compat

__all__ = ["lstm_data", "gru_data", "rnn_tanh_data", "rnn_relu_data"]

aten = torch.ops.aten


class _Params:
    """``CellParams``: one direction of one layer's weights (``gather_params``)."""

    def __init__(self, w_ih, w_hh, b_ih=None, b_hh=None, w_hr=None):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr = w_ih, w_hh, b_ih, b_hh, w_hr

    def linear_ih(self, x):
        return aten.linear(x, self.w_ih, self.b_ih)

    def linear_hh(self, h):
        return aten.linear(h, self.w_hh, self.b_hh)

    def matmul_hr(self, h):
        return h if self.w_hr is None else aten.matmul(h, self.w_hr.t())


def _gather_params(params, has_biases: bool, has_projections: bool) -> list:
    step = (4 if has_biases else 2) + (1 if has_projections else 0)
    out = []
    for i in range(0, len(params), step):
        group = params[i : i + step]
        b_ih, b_hh = (group[2], group[3]) if has_biases else (None, None)
        out.append(_Params(group[0], group[1], b_ih, b_hh, group[-1] if has_projections else None))
    return out


def _lstm_cell(x, hidden, p: _Params):
    """``LSTMCell::operator()`` on the CPU, ``pre_compute_input`` true."""
    hx, cx = hidden
    gates = p.linear_hh(hx).add_(x)
    ingate, forgetgate, cellgate, outgate = gates.unsafe_chunk(4, 1)
    ingate, forgetgate, cellgate, outgate = (
        ingate.sigmoid_(),
        forgetgate.sigmoid_(),
        cellgate.tanh_(),
        outgate.sigmoid_(),
    )
    cy = (forgetgate * cx).add_(ingate * cellgate)
    hy = outgate * cy.tanh()
    return p.matmul_hr(hy), cy


def _gru_cell(x, hidden, p: _Params):
    """``GRUCell::operator()`` on the CPU, ``pre_compute_input`` true."""
    chunked_igates = x.unsafe_chunk(3, 1)
    chunked_hgates = p.linear_hh(hidden).unsafe_chunk(3, 1)
    reset_gate = chunked_hgates[0].add_(chunked_igates[0]).sigmoid_()
    input_gate = chunked_hgates[1].add_(chunked_igates[1]).sigmoid_()
    new_gate = chunked_igates[2].add(chunked_hgates[2].mul_(reset_gate)).tanh_()
    return (hidden - new_gate).mul_(input_gate).add_(new_gate)


def _tanh_cell(x, hidden, p: _Params):
    """``SimpleCell<tanh_f>::operator()``, ``pre_compute_input`` true."""
    return p.linear_hh(hidden).add_(x).tanh()


def _relu_cell(x, hidden, p: _Params):
    """``SimpleCell<relu_f>::operator()``, ``pre_compute_input`` true."""
    return p.linear_hh(hidden).add_(x).relu()


def _slice(hidden, start: int, end: int):
    """``hidden_slice``: a tensor, or each of an LSTM's pair, the cell state first (the module docstring)."""
    if isinstance(hidden, tuple):
        c = hidden[1].narrow(0, start, end - start)
        return hidden[0].narrow(0, start, end - start), c
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: list):
    """``hidden_concat``: an LSTM's cell states first, as :func:`_slice`."""
    if isinstance(hiddens[0], tuple):
        c = torch.cat([h[1] for h in hiddens], 0)
        return torch.cat([h[0] for h in hiddens], 0), c
    return torch.cat(hiddens, 0)


def _output(hidden):
    """``hidden_as_output``."""
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _packed_layer(cell, data, sizes: list, hidden, p: _Params):
    """``PackedLayer::operator()``."""
    projected = p.linear_ih(data)
    steps, hiddens, offset, last = [], [], 0, sizes[0]
    for batch in sizes:
        step_input = projected.narrow(0, offset, batch)
        offset += batch
        dec = last - batch
        if dec > 0:
            hiddens.append(_slice(hidden, last - dec, last))
            hidden = _slice(hidden, 0, last - dec)
        last = batch
        hidden = cell(step_input, hidden, p)
        steps.append(_output(hidden))
    hiddens.append(hidden)
    hiddens.reverse()
    return torch.cat(steps, 0), _concat(hiddens)


def _reversed_packed_layer(cell, data, sizes: list, input_hidden, p: _Params):
    """``ReversedPackedLayer::operator()``."""
    projected = p.linear_ih(data)
    steps, offset, last = [], data.shape[0], sizes[-1]
    hidden = _slice(input_hidden, 0, sizes[-1])
    for batch in reversed(sizes):
        if batch - last > 0:
            hidden = _concat([hidden, _slice(input_hidden, last, batch)])
        step_input = projected.narrow(0, offset - batch, batch)
        offset -= batch
        last = batch
        hidden = cell(step_input, hidden, p)
        steps.append(_output(hidden))
    steps.reverse()
    return torch.cat(steps, 0), hidden


def _layer_stack(cell, data, sizes, hiddens, params, num_layers, dropout_p, train, bidirectional):
    """``apply_layer_stack`` over ``PackedLayer`` or ``PackedBidirectionalLayer``: (output, final hiddens)."""
    finals = []
    for layer in range(num_layers):
        if bidirectional:
            fw = _packed_layer(cell, data, sizes, hiddens[2 * layer], params[2 * layer])
            bw = _reversed_packed_layer(cell, data, sizes, hiddens[2 * layer + 1], params[2 * layer + 1])
            data = torch.cat([fw[0], bw[0]], -1)
            finals += [fw[1], bw[1]]
        else:
            data, final = _packed_layer(cell, data, sizes, hiddens[layer], params[layer])
            finals.append(final)
        if dropout_p != 0 and train and layer < num_layers - 1:
            data = torch.dropout(data, dropout_p, True)
    return data, finals


def lstm_data(data, sizes: list, hx, params, has_biases, num_layers, dropout_p, train, bidirectional):
    """``lstm.data``'s CPU path (``_lstm_impl<PackedLayer, PackedBidirectionalLayer>``) on known batch sizes."""
    projections = hx[0].shape[2] != hx[1].shape[2]
    if not projections and data.numel() and len(set(sizes)) == 1 and _compat.mkldnn_lstm_dtype(data.dtype):
        # oneDNN's path (the module docstring): the padded LSTM on the data viewed as unpacked
        padded = data.view(len(sizes), sizes[0], data.shape[-1])
        out, hy, cy = aten.lstm.input(
            padded, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, False
        )
        return out.view(data.shape[0], out.shape[-1]), hy, cy
    weights = _gather_params(params, has_biases, projections)
    hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0)))
    out, finals = _layer_stack(_lstm_cell, data, sizes, hiddens, weights, num_layers, dropout_p, train, bidirectional)
    cy = torch.stack([c for _, c in finals], 0)  # first: make_tuple's arguments, right to left
    return out, torch.stack([h for h, _ in finals], 0), cy


def _concat_impl(cell, data, sizes: list, hx, params, has_biases, num_layers, dropout_p, train, bidirectional):
    """``_rnn_impl_with_concat<cell, PackedLayer, PackedBidirectionalLayer>`` on known batch sizes."""
    weights = _gather_params(params, has_biases, False)
    out, finals = _layer_stack(
        cell, data, sizes, list(hx.unbind(0)), weights, num_layers, dropout_p, train, bidirectional
    )
    return out, torch.stack(finals, 0)


def gru_data(*args):
    """``gru.data``'s CPU path (``GRUCell``)."""
    return _concat_impl(_gru_cell, *args)


def rnn_tanh_data(*args):
    """``rnn_tanh.data``'s CPU path (``SimpleCell<tanh_f>``)."""
    return _concat_impl(_tanh_cell, *args)


def rnn_relu_data(*args):
    """``rnn_relu.data``'s CPU path (``SimpleCell<relu_f>``)."""
    return _concat_impl(_relu_cell, *args)
