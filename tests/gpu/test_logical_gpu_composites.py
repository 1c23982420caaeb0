"""C++ composites that decide by ``input.is_cuda()`` take CUDA's branch on a logical GPU.

A logical GPU's MetaTensor is a meta tensor to C++, so composites that
branch on the device took the other branch: Note [Softmax of half to float on
a GPU] and Note [A Python number written into a GPU tensor] in composites.py.
Where this torch build can make fake CUDA tensors (a CUDA build, the 2.14
leg), the trace is compared with what C++ dispatches for them.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metadispatch as md
from metadispatch.testing import _EagerLog, trace_calls
from tests.gpu.test_autocast_cuda import needs_fake_cuda


def _masked(x):
    m = x.new_zeros(4, 6)
    m[0:2, 1:3] = 3
    m[m > 1] = 0.5
    x[:, 0] = True
    return m


def _softmaxes(x):
    h = x.half()
    return h.softmax(-1, dtype=torch.float32), torch.log_softmax(h, 1, torch.float32), h.softmax(-1)


def _rms_norms(x):
    w = x.new_ones(6)
    return torch.rms_norm(x, [6], w, 1e-6), F.rms_norm(x.half(), [6]), F.rms_norm(x.view(2, 2, 6), [2, 6])


def _dropouts(x):
    a = F.dropout(x, 0.1) + torch.dropout(x, 0.2, True) + F.dropout(x, 0.0) + F.dropout(x, 0.5, training=False)
    return a, F.dropout(x.clone(), 0.3, True, True), nn.Dropout(0.1)(x)


CASES = {
    "setitem_number": _masked,
    "softmax_half_to_float": _softmaxes,
    "rms_norm": _rms_norms,
    "dropout": _dropouts,
    "logsigmoid": lambda x: F.logsigmoid(x) + F.logsigmoid(x.t().contiguous().t()),
}


def _ops(calls):
    return [(c.op, tuple((o[0], o[1], o[4].type, o[2] if 0 not in o[0] else None) for o in c.outputs)) for c in calls]


@needs_fake_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_logical_gpu_composite_is_what_cuda_dispatches(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x0 = torch.randn(4, 6)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = x0.to("cuda")
        with _EagerLog() as log:
            CASES[name](x)
    traced = trace_calls(md.tracer(device="cuda")(CASES[name], x0.clone()))
    assert _ops(traced) == _ops(log.calls)


def test_setitem_of_a_number_fills_from_a_cpu_scalar_as_cuda_does():
    t = md.tracer(device="cuda")(_masked, torch.randn(4, 6))
    ops = [c.op for c in t.calls]
    assert ops[:5] == [
        "aten.new_zeros.default",
        "aten.lift_fresh.default",
        "aten.slice.Tensor",
        "aten.slice.Tensor",
        "aten.fill_.Tensor",
    ]
    lifted = t.calls[1].output_metas[0]
    assert lifted.device.type == "cpu" and lifted.dtype == torch.float32
    assert "aten.scalar_tensor.default" not in ops and "aten.copy_.default" not in ops
    # on a logical CPU the same code is eager's (C++ makes the CPU scalar itself)
    md.testing.assert_matches_eager(_masked, torch.randn(4, 6))


def test_softmax_of_half_to_float_takes_cudas_fused_cast():
    t = md.tracer(device="cuda")(_softmaxes, torch.randn(4, 6))
    assert [(c.op, c.args[2] if len(c.args) > 2 else None) for c in t.calls if "softmax" in c.op] == [
        ("aten._softmax.default", True),
        ("aten._log_softmax.default", True),
        ("aten._softmax.default", False),
    ]
    assert sum(c.op == "aten._to_copy.default" for c in t.calls) == 1  # the .half() alone


def test_rms_norm_runs_the_fused_kernel_forward_and_backward_as_cuda_does():
    norm = nn.RMSNorm(8)

    def step(x):
        norm(x).sum().backward()

    t = md.tracer(device="cuda")(step, torch.randn(4, 8, requires_grad=True))
    ops = [c.op for c in t.calls]
    assert ops.count("aten._fused_rms_norm.default") == 1
    assert ops.count("aten._fused_rms_norm_backward.default") == 1
    assert not {"aten.pow.Tensor_Scalar", "aten.rsqrt.default", "aten.mean.dim"} & set(ops)
    assert {n: g.shape for n, g in t.grads.items()} == {"weight": (8,)}
    # a weight of another dtype takes the composite, as C++ does (and warns)
    mixed = md.tracer(device="cuda")(
        lambda x: F.rms_norm(x, [8], torch.ones(8, dtype=torch.float64)), torch.randn(4, 8)
    )
    assert "aten._fused_rms_norm.default" not in [c.op for c in mixed.calls]
    # a logical CPU is still eager's
    md.testing.assert_matches_eager(step, torch.randn(4, 8, requires_grad=True))


def test_dropout_in_training_runs_cudas_fused_kernel_and_saves_a_bool_mask():
    lin = nn.Linear(8, 8)

    def step(x):
        F.dropout(lin(x), 0.1).sum().backward()

    t = md.tracer(device="cuda")(step, torch.randn(4, 8))
    ops = [c.op for c in t.calls]
    assert "aten.bernoulli_.float" not in ops and "aten.empty_like.default" not in ops
    (fwd,) = [c for c in t.calls if c.op == "aten.native_dropout.default"]
    assert fwd.output_metas[1].dtype == torch.bool
    assert "aten.native_dropout_backward.default" in ops
    # in place, and on a logical CPU, the generic body, as on those devices
    inplace = md.tracer(device="cuda")(lambda x: F.dropout(x, 0.1, True, True), torch.randn(4, 8))
    assert "aten.native_dropout.default" not in [c.op for c in inplace.calls]
    md.testing.assert_matches_eager(lambda x: F.dropout(x, 0.1), torch.randn(4, 8))


def test_calls_inside_torchs_python_functions_meet_the_overrides():
    # Note [Seeing inside torch's Python functions]: nn.MultiheadAttention's
    # F.multi_head_attention_forward calls F.scaled_dot_product_attention and
    # F.dropout; seen only from outside, a logical H100 recorded the math
    # attention and the generic dropout.
    mha = nn.MultiheadAttention(64, 4, batch_first=True, dropout=0.1)

    def step(x):
        mha(x, x, x, need_weights=False)[0].sum().backward()

    t = md.tracer(device="cuda", gpu="h100")(step, torch.randn(2, 16, 64).bfloat16())
    ops = [c.op for c in t.calls]
    assert any(op.startswith("aten._scaled_dot_product_") and "math" not in op for op in ops), ops
    assert not {"aten._safe_softmax.default", "aten.bernoulli_.float", "aten.softmax.int"} & set(ops)
    # outside the attention, mha's own dropout of the weights is not used (need_weights=False);
    # a logical CPU is still eager's
    md.testing.assert_matches_eager(lambda x: mha(x, x, x, need_weights=False)[0].sum(), torch.randn(2, 16, 64))
