"""``pack_padded_sequence`` traces as eager runs it: Note [Packing with known lengths] in rules/data_dependent.py."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import metadispatch as md
from tests.eager_ops import EagerOps


def _layout(t):
    return t.shape, t.stride(), t.dtype, t.device


@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_sequence_packing_dispatches_eagers_ops(enforce_sorted):
    lengths = [6, 4, 2] if enforce_sorted else [2, 6, 4]

    def step(x):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
        return packed.data * 2, packed.batch_sizes

    x = torch.randn(3, 6, 4)
    with EagerOps() as real:
        expected = step(x)
    t = md.trace(step, x)
    assert [c.op for c in t.calls] == real.ops
    assert [_layout(o) for o in t.output] == [_layout(o) for o in expected]
    assert md.replay(t, (x,), allow_made_up=True).ok


@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_sequence_lstm_step_traces_and_replays_as_eager(enforce_sorted):
    torch.manual_seed(0)
    rnn = nn.LSTM(4, 5, batch_first=True)
    lengths = [6, 4, 2] if enforce_sorted else [2, 6, 4]

    def step(x):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
        out, _ = rnn(packed)
        out.data.sum().backward()
        return out.data, out.batch_sizes

    x = torch.randn(3, 6, 4)
    expected = step(x)
    rnn.zero_grad()
    t = md.trace(step, x)
    assert [_layout(o) for o in t.output] == [_layout(o) for o in expected]
    result = md.replay(
        t, (x,), module=rnn, allow_made_up=True
    )  # scatter_ fills a permutation: Note [Uninitialised memory]
    assert result.ok, result
    assert torch.allclose(result.output[0], expected[0]) and torch.equal(result.output[1], expected[1])


_RNNS = {
    "lstm": lambda: nn.LSTM(4, 5, batch_first=True),
    "gru": lambda: nn.GRU(4, 5, batch_first=True),
    "lstm-bidirectional-2-layers-dropout": lambda: nn.LSTM(4, 5, num_layers=2, dropout=0.5, bidirectional=True),
    "gru-bidirectional-no-bias": lambda: nn.GRU(4, 5, bias=False, bidirectional=True),
    "lstm-projections": lambda: nn.LSTM(4, 5, proj_size=3, batch_first=True),
    "rnn-tanh": lambda: nn.RNN(4, 5, batch_first=True),
    "rnn-relu-bidirectional-2-layers-no-bias": lambda: nn.RNN(4, 5, 2, "relu", bias=False, bidirectional=True),
}


@pytest.mark.parametrize("enforce_sorted", [True, False])
@pytest.mark.parametrize("name", sorted(_RNNS))
def test_packed_sequence_rnn_step_dispatches_eagers_ops(name, enforce_sorted):
    # Note [Packed RNNs as the CPU kernel runs them]: every call and its
    # outputs' metadata as eager's, forward and backward
    torch.manual_seed(0)
    rnn = _RNNS[name]()
    lengths = [6, 4, 4, 1] if enforce_sorted else [4, 6, 1, 4]

    def step(x):
        packed = pack_padded_sequence(x, lengths, batch_first=rnn.batch_first, enforce_sorted=enforce_sorted)
        out, _ = rnn(packed)
        out.data.sum().backward()
        return out.data

    x = torch.randn(4, 6, 4) if rnn.batch_first else torch.randn(6, 4, 4)
    md.testing.assert_matches_eager(step, x)
    rnn.zero_grad()
    t = md.trace(step, x)
    result = md.replay(t, (x,), module=rnn, allow_made_up=True)  # Note [Uninitialised memory]
    assert result.ok, result
    if "dropout" not in name:
        assert torch.equal(result.output, step(x))  # the CPU kernel's arithmetic, bit for bit


_EQUAL = {
    "lstm": lambda: nn.LSTM(4, 5),
    "lstm-bidirectional-no-bias-eval": lambda: nn.LSTM(4, 5, num_layers=2, bias=False, bidirectional=True).eval(),
    "lstm-projections": lambda: nn.LSTM(4, 5, proj_size=3),  # no oneDNN path: PackedLayer
    "lstm-float64": lambda: nn.LSTM(4, 5).double(),  # no oneDNN path: PackedLayer
    "lstm-bfloat16": lambda: nn.LSTM(4, 5).bfloat16(),  # oneDNN where the CPU has bf16
    "gru": lambda: nn.GRU(4, 5),  # no oneDNN path: PackedLayer
    "rnn-tanh": lambda: nn.RNN(4, 5),  # no oneDNN path: PackedLayer
}


@pytest.mark.parametrize("lengths", [[3, 3, 3, 3], [5]])
@pytest.mark.parametrize("name", sorted(_EQUAL))
def test_packed_sequence_of_equal_lengths_dispatches_eagers_ops(name, lengths):
    # Note [Packed RNNs as the CPU kernel runs them]: every sequence full
    # length (or one sequence) makes all batch sizes equal, and the CPU LSTM
    # then views the data as padded and runs oneDNN's mkldnn_rnn_layer
    torch.manual_seed(0)
    rnn = _EQUAL[name]()
    dtype = next(rnn.parameters()).dtype

    def step(x):
        out, _ = rnn(pack_padded_sequence(x, lengths))
        out.data.float().sum().backward()
        return out.data

    x = torch.randn(max(lengths), len(lengths), 4, dtype=dtype)
    traced = md.testing.trace_calls(md.trace(step, x))
    rnn.zero_grad()
    real = md.testing.eager_calls(step, x)
    oneDNN = "aten.mkldnn_rnn_layer.default"
    if name != "lstm-bfloat16":  # whether the CPU has bf16: asked by the port, not recorded
        assert (oneDNN in {c.op for c in real}) == (
            name.startswith("lstm") and "projections" not in name and "64" not in name
        )
    # every output's metadata but oneDNN's workspace (docs/model-conformance.md, "Known differences")
    assert [(c.op, c.outputs[:3] if c.op == oneDNN else c.outputs) for c in traced] == [
        (c.op, c.outputs[:3] if c.op == oneDNN else c.outputs) for c in real
    ]


def test_packed_sequence_lengths_as_data_name_the_lengths_not_a_device():
    x, lengths = torch.randn(3, 6, 4), torch.tensor([6, 2, 4])
    pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)  # eager runs it
    with pytest.raises(md.DataDependentError, match="values of `lengths`") as info:
        md.trace(lambda x, n: pack_padded_sequence(x, n, batch_first=True, enforce_sorted=False).data, x, lengths)
    assert "meta Long tensor" not in str(info.value)


def test_packed_sequence_bad_lengths_get_the_cpu_kernels_error():
    x = torch.randn(3, 6, 4)
    with pytest.raises(RuntimeError) as eager:
        pack_padded_sequence(x, [2, 6, 4], batch_first=True)  # not sorted
    with pytest.raises(RuntimeError) as traced:
        md.trace(lambda x: pack_padded_sequence(x, [2, 6, 4], batch_first=True).data, x)
    assert str(eager.value).splitlines()[0] in str(traced.value)


@pytest.mark.parametrize("name", ["RNN", "LSTM", "GRU"])
def test_packed_sequence_on_a_logical_gpu_keeps_its_lengths_on_the_host(name):
    # pack_padded_sequence moves its lengths to the CPU (device="cpu", kept
    # under MetaMode(device="cuda")), as a real CUDA job's: packing takes
    # them there whatever the input's device, and batch_sizes stays there.
    torch.manual_seed(0)
    rnn = getattr(nn, name)(4, 5)
    x = torch.randn(6, 3, 4)
    eager_out, _ = rnn(pack_padded_sequence(x, [6, 4, 2]))
    with md.MetaMode(device="cuda"):
        out, _ = rnn(pack_padded_sequence(x, [6, 4, 2]))
    assert (out.data.shape, out.data.stride(), out.data.dtype) == _layout(eager_out.data)[:3]
    assert out.data.device == torch.device("cuda:0") and out.batch_sizes.device == torch.device("cpu")
    assert out.batch_sizes.tolist() == eager_out.batch_sizes.tolist()
