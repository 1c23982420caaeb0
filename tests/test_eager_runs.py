"""Steps eager runs that metadispatch crashed on or refused (issue 28, item 8).

Each is traced and replayed against the eager run: its op sequence and
metadata (a TorchDispatchMode log), and its values.
"""

from __future__ import annotations

import pytest
import torch

import metadispatch as md
from metadispatch.testing import eager_calls, trace_calls


def _complex_mul_backward(z):
    torch.view_as_real(1j * z).sum().backward()
    return z.grad


def test_eager_runs_backward_of_a_complex_scalar_product():
    # Note [Wrapped numbers]: mul's backward takes _conj of the bare 1j.
    torch.manual_seed(0)
    z = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    t = md.trace(_complex_mul_backward, z)
    assert trace_calls(t) == eager_calls(_complex_mul_backward, z.detach().clone().requires_grad_())
    r = md.replay(t, (z,))
    assert r.ok, r
    eager = z.detach().clone().requires_grad_()
    _complex_mul_backward(eager)
    assert torch.equal(r.output, eager.grad)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "shape, correction", [((3, 5), 1), ((5,), 0), ((2, 7), 2), ((4, 1), 1)], ids=["3x5", "1d", "ddof2", "dof0"]
)
def test_eager_runs_cov_on_a_meta_tensor_outside_a_mode(shape, correction, device):
    x = torch.randn(shape)
    expected = torch.cov(x, correction=correction)  # eager, on the CPU
    got = torch.cov(md.to_meta(x, device=device), correction=correction)
    assert isinstance(got, md.MetaTensor) and str(got.device).startswith(device)
    assert (got.shape, got.dtype, got.stride()) == (expected.shape, expected.dtype, expected.stride())
