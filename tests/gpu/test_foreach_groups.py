"""The foreach paths' grouping on a logical GPU keys its groups as a real GPU's
(Note [Foreach groups on a logical GPU] in standins/standins.py), checked against
FakeTensorMode's CUDA tensors, which C++ groups by their real device."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import metadispatch as md
from tests.fake_cuda import CudaLog
from tests.gpu.test_autocast_cuda import needs_fake_cuda

_GROUP = torch._C._group_tensors_by_device_and_dtype


_SHAPES = [
    ((8, 8), torch.float32),
    ((8,), torch.float32),
    ((4, 8), torch.float16),
    ((4,), torch.float16),
    ((4, 4), torch.float32),
]


def _params(device="cpu"):
    torch.manual_seed(0)
    params = [torch.randn(shape, dtype=dtype, device=device).requires_grad_() for shape, dtype in _SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _clip(params, **kwargs):
    torch.nn.utils.clip_grad_norm_(params, 0.5, **kwargs)
    torch.nn.utils.clip_grad_value_(params, 0.1, **kwargs)


def _ops(calls):
    return [c.op for c in calls]


def _cuda_calls(**kwargs):
    with FakeTensorMode():
        params = _params("cuda")
        with CudaLog() as log:
            _clip(params, **kwargs)
    return _ops(log.calls)


def _logical_calls(**kwargs):
    params = _params()
    return _ops(md.tracer(device="cuda", gpu="h100")(lambda: _clip(params, **kwargs)).calls)


@needs_fake_cuda
@pytest.mark.parametrize("foreach", [None, True, False], ids=["default", "foreach", "per-tensor"])
def test_clip_grad_on_a_logical_gpu_dispatches_what_cuda_does(foreach):
    # A real GPU's default is foreach; a FakeTensor's type is not in torch's
    # foreach list, so the fake GPU is asked for foreach explicitly.  (Before,
    # the logical GPU's default took the per-tensor path, and foreach=True
    # raised "can't use the foreach API on meta tensors".)
    cuda = _cuda_calls(foreach=foreach is not False)
    assert _logical_calls(foreach=foreach) == cuda
    # one norm call per (device, dtype) group: float32 and float16
    assert cuda.count("aten._foreach_norm.Scalar") == (0 if foreach is False else 2)


def test_foreach_groups_on_a_logical_gpu_are_keyed_by_its_device():
    params = _params()
    keys = []

    def group():
        grads = [p.grad for p in params]
        groups = torch.utils._foreach_utils._group_tensors_by_device_and_dtype([grads, []], with_indices=True)
        keys.extend(
            (device, dtype, len(lists[0]), len(lists[1]), tuple(idx))
            for (device, dtype), (lists, idx) in groups.items()
        )

    md.tracer(device="cuda", gpu="h100")(group)
    real = _GROUP([[p.grad for p in params], []], True)
    cuda = torch.device("cuda", 0)
    assert keys == [(cuda, dtype, len(ls[0]), 0, tuple(idx)) for (_, dtype), (ls, idx) in real.items()]
    assert torch._C._group_tensors_by_device_and_dtype is _GROUP  # nothing left on torch after the trace
    t = md.to_meta(torch.ones(2), device="cuda")
    assert list(_GROUP([[t]], False)) == [(torch.device("meta"), torch.float32)]  # torch's own answer outside a mode
