"""Steps eager runs that metadispatch crashed on or refused (issue 28, item 8).

Each is traced and replayed against the eager run: its op sequence and
metadata (a TorchDispatchMode log), and its values.
"""

from __future__ import annotations

import copy

import pytest
import torch

import metadispatch as md
from metadispatch.testing import eager_calls, trace_calls
from tools import model_conformance


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


def _lm_step(m, ids):
    out = m(ids).logits
    out.float().sum().backward()
    return out


def test_eager_runs_mixtral_trace_replays_from_its_file(tmp_path):
    # The load check sized _grouped_mm with torch's bf16-only meta function,
    # and bounded the offsets of its 2-d x 2-d backward by the wrong dimension.
    from tests.models import tiny_mixtral

    model, ids = tiny_mixtral(), torch.randint(0, 100, (2, 12))
    t = md.trace(_lm_step, model, ids)
    path = tmp_path / "mixtral.json.gz"
    t.save(path)
    loaded = md.Trace.load(path)
    assert "aten._grouped_mm.default" in {c.op for c in loaded.calls}
    eager = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.set_rng_state(t.rng_state)
        out = _lm_step(eager, ids)
    for trace in (t, loaded):
        r = md.replay(trace, (model, ids))
        assert r.ok, r
        assert torch.equal(r.output, out)
        for n, p in eager.named_parameters():
            assert torch.equal(r.grads[n], p.grad), n


def _halves(a, b, fill_both=True):
    q = a.new_empty(*a.shape[:-1], a.shape[-1] + b.shape[-1])
    q[..., : a.shape[-1]] = a
    if fill_both:
        q[..., a.shape[-1] :] = b
    return q * 2


@pytest.mark.parametrize("fill_both", [True, False])
def test_eager_runs_new_empty_filled_by_two_slice_assignments(fill_both):
    # Note [Strided writes]: each half is strided, together they write it all.
    torch.manual_seed(0)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    t = md.trace(_halves, a, b, fill_both)
    r = md.replay(t, (a, b, fill_both))
    if fill_both:
        assert r.ok, r
        assert torch.equal(r.output, _halves(a, b))
    else:  # half of it is what the allocator left, in eager too
        assert not r.ok and [m.name for m in r.made_up] == [f"uninitialised ${t.calls[0].output_metas[0].id}"]


def test_eager_runs_deepseek_v3_replays_ok_and_equals_eager():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, (ids,) = model_conformance._hf("deepseek_v3")()  # the conformance row's model (hf.deepseek_v3)
    t = md.trace(_lm_step, model, ids)
    eager = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.set_rng_state(t.rng_state)
        out = _lm_step(eager, ids)
    r = md.replay(t, (model, ids))
    assert r.ok, r
    assert torch.equal(r.output, out)
    for n, p in eager.named_parameters():
        if p.grad is not None:
            assert torch.equal(r.grads[n], p.grad), n
