"""Pinned host memory on a logical GPU (Note [Pinned memory on a logical host]).

No accelerator here can pin, so the rules are held to torch's own contract:
what ``is_pinned`` answers for a tensor never pinned (the real CPU kernel's
False), ``pin_memory`` as its C++ composite dispatches it (``is_pinned`` then
``_pin_memory``), the copy's sizes and strides, and pinning a pinned tensor
or a view of one returning it.
"""

import pytest
import torch

import metadispatch as md
from tests.eager_ops import EagerOps


def _dispatched_by_torch() -> list:
    # torch's pin_memory on a tensor it cannot pin still dispatches its first steps.
    with EagerOps() as log, pytest.raises(RuntimeError):
        torch.empty(3, device="meta").pin_memory()
    return log.ops[1:]  # after the empty tensor itself


@pytest.mark.skipif(torch.cuda.is_available(), reason="a logical GPU on a host without CUDA")
def test_pinned_pin_memory_on_a_logical_gpu_copies_into_a_pinned_storage():
    with md.MetaMode(device="cuda") as mode:
        x = torch.empty(4, 6, device="cuda").cpu().t()
        never = x.is_pinned()
        y = x.pin_memory()
        assert (y.shape, y.stride(), y.device.type) == (x.shape, x.stride(), "cpu")
        assert y.is_pinned() and y[1:].is_pinned() and y.detach().is_pinned()
        view = y[1:]
        assert y.pin_memory() is y and view.pin_memory() is view
    assert never == torch.empty(6, 4).t().is_pinned()  # the CPU kernel's answer: False
    ops = [c.op for c in mode.trace.calls]
    pinning = ops[ops.index("aten._pin_memory.default") - 1 :][:2]
    assert ops.count("aten._pin_memory.default") == 1
    assert ["aten.is_pinned.default", "aten._pin_memory.default"] == pinning == _dispatched_by_torch()


def test_pinned_pin_memory_without_an_accelerator_is_refused_as_torch_refuses():
    # A CPU build says "no accelerator", a CUDA build on a host without one "no NVIDIA driver".
    with pytest.raises(RuntimeError, match="accelerator|NVIDIA driver"):
        torch.empty(3).pin_memory()
    with md.MetaMode(device="cpu"), pytest.raises(md.UnsupportedFeatureError, match="pin_memory"):
        torch.empty(3).pin_memory()
