"""A logical GPU against the real one: where this host has CUDA, each step is
traced for this GPU's profile (``md.testing.this_gpu_profile``) and run on the
GPU under a ``TorchDispatchMode``; the recorded calls -- op names, every
output's shape, dtype, strides, offset and device -- must equal the real
ones, and the trace must replay on the GPU.  Each case is a difference a real H100 showed (tools/gpu_conformance.py,
docs/model-conformance.md); elsewhere they are skipped (conftest.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import metadispatch as md
from metadispatch.testing import eager_calls, this_gpu_profile, trace_calls

pytestmark = pytest.mark.cuda


def _assert_same_calls(step, *args):
    trace = md.tracer(device="cuda", gpu=this_gpu_profile())(step, *args)
    real_args = [copy.deepcopy(a) for a in args]
    real = eager_calls(step, *real_args)
    traced = trace_calls(trace)
    for i, (a, b) in enumerate(zip(real, traced)):
        assert a == b, f"call #{i}: real {a}\n traced {b}"
    assert len(real) == len(traced)
    # and the trace replays on the GPU, its CPU tensors on the CPU (Note [Devices in replay])
    result = md.replay(trace, args, device="cuda")
    assert result.ok, result
    return trace


def test_real_gpu_memory_efficient_attention_returns_cpu_seed_and_offset():
    # Note [Efficient attention's seed and offset] in rules/attention_rng.py
    q = torch.randn(2, 4, 16, 8, device="cuda", requires_grad=True)

    def step(q):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.0).sum().backward()

    _assert_same_calls(step, q)


@pytest.mark.parametrize("causal", [False, True])
def test_real_gpu_bf16_attention_kernel_and_outputs(causal):
    q = torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(q):
        F.scaled_dot_product_attention(q, q, q, is_causal=causal).float().sum().backward()

    _assert_same_calls(step, q)


def test_real_gpu_literal_made_on_the_device_is_one_lift():
    # Note [A literal made on a device] in values/literals.py
    x = torch.randn(2, device="cuda")
    _assert_same_calls(lambda x: x * torch.tensor([1.0, 2.0], device="cuda"), x)


def test_real_gpu_adamw_keeps_step_counters_on_the_cpu():
    # Note [Optimizer step counters on the CPU] in values/literals.py
    lin = torch.nn.Linear(8, 8).cuda()

    def step(m, x):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m(x).sum().backward()
        opt.step()

    _assert_same_calls(step, lin, torch.randn(4, 8, device="cuda"))


def _offloading(counters: list) -> None:
    # elementwise ops only: no cuBLAS workspace, which a process allocates once
    x = torch.ones(1000, device="cuda")
    host = x.cpu()  # offloaded
    back = (x * 2).cpu() + host  # a GPU temporary, freed at once; two host tensors
    big = torch.empty(300_000, device="cuda")
    del x
    counters.append((torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
    big.add_(back.sum().cuda())
    counters.append((torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))


def test_real_gpu_memory_counters_leave_the_hosts_storages_out():
    # Note [Memory counters from the trace so far] in analysis/cuda_counters.py:
    # the allocator counts its own blocks, not the host's tensors
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base, real = torch.cuda.memory_allocated(), []
    _offloading(real)
    logical: list = []
    with md.MetaMode(device="cuda", gpu=this_gpu_profile()):
        _offloading(logical)
    assert logical == [(now - base, peak - base) for now, peak in real]


def test_real_gpu_known_values_of_cuda_constants_answer_data_dependent_ops():
    # A small real CUDA tensor the step reads from its scope is known by
    # value, kept on the CPU (values/known.py): a bool of it is answered, not
    # refused, as for a CPU one.
    pad = torch.tensor([[3, 0, 5]], device="cuda")

    def step(x):
        return x * 2 if (pad == 0).any() else x

    _assert_same_calls(step, torch.randn(1, 3, device="cuda"))
