"""Convolution layouts on a logical GPU: Note [Convolution layouts on a logical GPU].

No GPU runs here, so the reference is cuDNN's rule as torch's source states it
(``cudnn_conv_suggest_memory_format`` in ConvUtils.h), under several profiles;
where a logical CPU makes the same choice (oneDNN keeps channels-last float32),
the two traces must agree call for call.
"""

import dataclasses

import pytest
import torch
from torch import nn

import metadispatch as md
from metadispatch.spec import profiles

CL, CL3, CONTIG = torch.channels_last, torch.channels_last_3d, torch.contiguous_format


def _layouts(conv, x, gpu="h100", backward=True):
    """The memory format of the forward output and of the input and weight gradients."""

    def step(m, x):
        y = m(x)
        if backward:
            y.square().sum().backward()
        return y

    trace = md.tracer(device="cuda", gpu=gpu)(step, conv, x.detach().requires_grad_(backward))
    out = trace.calls[[c.op for c in trace.calls].index("aten.convolution.default")].output_metas[0]
    found = [_format(out)]
    if backward:
        back = next(c for c in trace.calls if c.op == "aten.convolution_backward.default")
        found += [_format(m) for m in back.output_metas[:2]]
    return found, trace


def _format(m):
    t = torch.empty_strided(m.shape, m.stride, device="meta")
    return md._compat.suggest_memory_format(t)


@pytest.mark.parametrize("gpu", ["h100", "a100-80gb", "l4", "b200"])
def test_channels_last_input_gives_channels_last_on_cudnn(gpu):
    conv = nn.Conv2d(8, 16, 3)
    x = torch.randn(2, 8, 12, 12).contiguous(memory_format=CL)
    assert _layouts(conv, x, gpu)[0] == [CL, CL, CL]


def test_channels_last_weight_alone_is_enough():
    conv = nn.Conv2d(8, 16, 3).to(memory_format=CL)
    assert _layouts(conv, torch.randn(2, 8, 12, 12))[0] == [CL, CL, CL]


def test_contiguous_stays_contiguous_and_3d_uses_channels_last_3d():
    assert _layouts(nn.Conv2d(8, 16, 3), torch.randn(2, 8, 12, 12))[0] == [CONTIG] * 3
    x = torch.randn(2, 4, 6, 6, 6).contiguous(memory_format=CL3)
    assert _layouts(nn.Conv3d(4, 4, 3), x)[0] == [CL3, CL3, CL3]


def test_depthwise_and_transposed_channels_last_go_to_cudnn():
    x = torch.randn(2, 8, 12, 12).contiguous(memory_format=CL)
    assert _layouts(nn.Conv2d(8, 8, 3, groups=8), x)[0] == [CL, CL, CL]
    assert _layouts(nn.ConvTranspose2d(8, 4, 3), x)[0] == [CL, CL, CL]


def test_no_cudnn_layout_for_float64_without_cudnn_or_bf16_before_sm80():
    x = torch.randn(2, 8, 12, 12).contiguous(memory_format=CL)
    assert _layouts(nn.Conv2d(8, 16, 3).double(), x.double())[0] == [CONTIG] * 3
    assert _layouts(nn.Conv2d(8, 16, 3), x)[0] == [CL] * 3  # warms the metadata cache ...
    with torch.backends.cudnn.flags(enabled=False):  # ... whose key holds the switch (issue 19)
        assert _layouts(nn.Conv2d(8, 16, 3), x)[0] == [CONTIG] * 3
    volta = dataclasses.replace(md.gpu_profile("a100-40gb"), name="test-sm70", compute_capability=(7, 0))
    md.register_gpu(volta)
    try:
        bf16 = nn.Conv2d(8, 16, 3).to(torch.bfloat16)
        assert _layouts(bf16, x.to(torch.bfloat16), "test-sm70", backward=False)[0] == [CONTIG]
        assert _layouts(bf16, x.to(torch.bfloat16), "a100-40gb", backward=False)[0] == [CL]
    finally:
        profiles._PROFILES.pop("test-sm70", None)


def test_float32_channels_last_agrees_with_the_logical_cpu():
    # oneDNN keeps a channels-last float32 convolution channels-last as cuDNN does.
    conv, x = nn.Conv2d(8, 16, 3), torch.randn(2, 8, 12, 12).contiguous(memory_format=CL)

    def step(m, x):
        m(x).square().sum().backward()

    cpu = md.testing.trace_calls(md.trace(step, conv, x))
    cuda = md.testing.trace_calls(md.tracer(device="cuda", gpu="h100")(step, conv, x))
    assert [(c.op, [m[:4] for m in c.outputs]) for c in cuda] == [(c.op, [m[:4] for m in c.outputs]) for c in cpu]
