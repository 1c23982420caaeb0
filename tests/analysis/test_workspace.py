"""Kernel workspaces (analysis/workspace.py): sizes from the libraries' rules, and
against the CPU allocator itself for single convolutions."""

import pytest
import torch

import metadispatch as md
from tests.cpu_allocator import cpu_allocator_peak

MiB = 2**20


@pytest.mark.parametrize("gpu, nbytes", [("h100", 32 * MiB), ("b200", 32 * MiB), ("a100-80gb", 8 * MiB + 128 * 1024)])
def test_workspace_cublas_lives_from_the_first_matmul_on(gpu, nbytes):
    def step(x):
        y = x + 1
        return (y @ y).sum()

    t = md.tracer(mode_factory=lambda: md.MetaMode(device="cuda", gpu=gpu))(step, torch.ones(64, 64))
    m = md.memory(t)
    ws = m.by_category_timeline["workspaces"]
    first = next(i for i, c in enumerate(t.calls) if c.op == "aten.mm.default")
    assert ws[:first] == [0] * first and set(ws[first:]) == {nbytes}  # ATen's getChosenWorkspaceSize
    assert m.peak - md.memory(t, workspaces=False).peak == nbytes


def test_workspace_flash_attention_backward_accumulators():
    q = torch.empty(2, 8, 300, 64, dtype=torch.bfloat16, requires_grad=True)

    def step(q):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    t = md.tracer(mode_factory=lambda: md.MetaMode(device="cuda", gpu="a100-80gb"))(step, q)
    bwd = next(i for i, c in enumerate(t.calls) if c.op.startswith("aten._scaled_dot_product_flash_attention_backward"))
    ws = md.memory(t).by_category_timeline["workspaces"]
    # mha_bwd: dq_accum f32[2, 384, 8, 64] (300 rounded to 128) and softmax_d f32[2, 8, 384], during the call only
    assert ws[bwd] == 2 * 384 * 8 * 64 * 4 + 2 * 8 * 384 * 4
    assert ws[bwd - 1] == ws[bwd + 1] == 0


@pytest.mark.parametrize(
    "n, ci, co, hw, dtype",
    [
        (2, 16, 16, 8, torch.float32),  # oneDNN: source, weights and destination reordered to blocks
        (4, 24, 16, 8, torch.float32),  # channels padded to the block
        (1, 32, 64, 16, torch.float32),  # batch 1, small input: ATen's slow_conv2d and its columns
        (2, 16, 16, 8, torch.float64),  # float64: slow_conv2d
    ],
)
def test_workspace_cpu_convolution_forward_meets_the_allocators_peak(n, ci, co, hw, dtype):
    conv = torch.nn.Conv2d(ci, co, 3, padding=1).to(dtype)
    x = torch.randn(n, ci, hw, hw, dtype=dtype)

    def step(conv, x):
        return conv(x)

    with torch.no_grad():
        t = md.trace(step, conv, x)
        real = cpu_allocator_peak(step, conv, (x,))
    m = md.memory(t)
    leaves = sum(s.allocated for s in m.storages.values() if s.born < 0)
    assert m.by_category["workspaces"] > 0
    assert m.peak - leaves == pytest.approx(real, rel=0.02)
