"""``torch.tensor([t, 3.0])`` reads each tensor of its list (Note [Tensors inside a literal])."""

import pytest
import torch

import metadispatch as md
from metadispatch.errors import DataDependentError
from metadispatch.tensor.tensor import value_of
from tests.eager_ops import EagerOps


def _literal(x):
    s = x.sum()  # known where x is: a constant of the step
    t = torch.tensor([s, 3.0])
    u = torch.tensor([[s.to(torch.float64)], [2]], device="cpu")  # f64 inferred from the tensor, as C++ does
    return t * 2, u + 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_known_tensor_in_a_literal_is_read_as_eager_reads_it(device):
    x = torch.arange(4.0).reshape(2, 2)
    with EagerOps() as log:
        eager = _literal(x)
    # x comes from the step's scope (a constant): its value is known to the trace
    trace = md.tracer(device=device)(lambda: _literal(x))
    assert [c.op for c in trace.calls] == log.ops
    for got, want in zip(trace.output, eager):  # the trace knows the values: its constants' and those made from them
        assert got.dtype == want.dtype
        assert torch.equal(value_of(got), want)


def test_an_unknown_tensor_in_a_literal_is_a_data_dependent_error_naming_the_line():
    def step(x):
        return torch.tensor([x.sum(), 1.0])

    with pytest.raises(DataDependentError, match=r"torch\.tensor needs the values of its input \(f32\[\]@cpu\)") as e:
        md.trace(step, torch.randn(2, 2))
    assert "test_literal_of_tensors.py" in "".join(getattr(e.value, "__notes__", []))
