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
    # The LSTM over the packed data runs torch's decomposition, not the CPU
    # kernel's in-place cell (Note [Packed sequences] in values/composites.py),
    # so the values are compared, not the op sequence.
    t = md.trace(step, x)
    assert [_layout(o) for o in t.output] == [_layout(o) for o in expected]
    result = md.replay(
        t, (x,), module=rnn, allow_made_up=True
    )  # scatter_ fills a permutation: Note [Uninitialised memory]
    assert result.ok, result
    assert torch.allclose(result.output[0], expected[0]) and torch.equal(result.output[1], expected[1])


@pytest.mark.xfail(
    strict=True,
    reason="Note [Packed sequences] in values/composites.py: aten.lstm.data runs torch's Python decomposition "
    "(split_with_sizes, out-of-place add/sigmoid/tanh) where the CPU kernel (RNN.cpp's PackedLayer and "
    "LSTMCell) computes the input projection once, narrows each step and works in place (add_, unsafe_split, "
    "sigmoid_, tanh_); the C++ body is not ported",
)
@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_sequence_lstm_step_dispatches_eagers_ops(enforce_sorted):
    torch.manual_seed(0)
    rnn = nn.LSTM(4, 5, batch_first=True)
    lengths = [6, 4, 2] if enforce_sorted else [2, 6, 4]

    def step(x):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
        rnn(packed)[0].data.sum().backward()

    x = torch.randn(3, 6, 4)
    t = md.trace(step, x)
    with EagerOps() as real:
        step(x)
    assert [c.op for c in t.calls] == real.ops


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
