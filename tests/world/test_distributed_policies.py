"""FSDP2's ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy`` on a logical GPU world.

The CPU worlds of both are held to real ``gloo`` runs in
test_distributed_ground_truth.py (``fsdp-bf16``, ``fsdp-offload``: shards,
collectives, categories, peak).  A GPU job cannot run here, so on a logical
CUDA world each rank is held to what those checks fixed: the same
collectives, and -- with CPU offload, whose shards, gradients and optimizer
state live on the host in both -- the same host bytes by category as the
gloo run measures; on the GPU, only what FSDP2 all-gathers and computes.
"""

from collections import Counter

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

import metadispatch as md
from metadispatch.cli.llama import Llama
from tests.distributed_cases import CONFIG, comparable, fsdp_policy_step, traced_categories, traced_rank

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a logical GPU world on a host without CUDA")

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _gpu_rank(rank: int, **policies):
    torch.manual_seed(0)
    with md.MetaMode(device="cuda", gpu="h100", world_size=2, rank=rank) as mode:
        model = fsdp_policy_step(**policies)
    # Asked after the trace: a call made in the mode after the step would
    # come after the optimizer's state has died with the step.
    return mode.trace, next(model.parameters()).to_local().device.type


@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_cpu_offload_on_a_logical_gpu_keeps_the_shards_pinned_on_the_host(rank):
    gpu, shard = _gpu_rank(rank, offload=CPUOffloadPolicy())  # pin_memory=True, its default
    cpu, _ = traced_rank(rank, 2, "fsdp-offload", device="cpu")  # the gloo run's, to 1 KiB
    assert shard == "cpu"
    assert comparable(md.comms(gpu).calls) == comparable(md.comms(cpu).calls)
    # Shards, gradients and AdamW's state on the host, byte for byte as the
    # real CPU run holds them; the GPU holds none of them.
    assert traced_categories(gpu, device="cpu") == traced_categories(cpu)
    on_gpu = traced_categories(gpu, device="cuda")
    assert on_gpu == {"backward": {"params": 0, "grads": 0}, "step": {"params": 0, "optimizer state": 0}}
    # Each shard pinned once (lazy init asks, and finds it pinned); each all-gather
    # copies its shards to the GPU, and each gradient comes back to the host.
    params = len(list(Llama(CONFIG).parameters()))
    moves = Counter((c.op, str(c.kwargs.get("device")), c.phase) for c in gpu.calls)
    assert moves["aten._pin_memory.default", "None", "forward"] == params
    assert moves["aten._to_copy.default", "cuda:0", "forward"] == params
    assert moves["aten._to_copy.default", "cpu", "backward"] == params


@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_mixed_precision_on_a_logical_gpu_gathers_bf16_and_reduces_fp32(rank):
    gpu, shard = _gpu_rank(rank, mp=BF16)
    cpu, _ = traced_rank(rank, 2, "fsdp-bf16", device="cpu")
    assert shard == "cuda"
    calls = md.comms(gpu).calls
    assert comparable(calls) == comparable(md.comms(cpu).calls)
    assert {c.tensors[0].split("[")[0] for c in calls if c.kind == "all_gather"} == {"bf16"}
    assert {c.tensors[0].split("[")[0] for c in calls if c.kind == "reduce_scatter"} == {"f32"}
    # The shards, gradients and AdamW's state stay fp32 (the policy casts
    # what is gathered): on the GPU, the same bytes as with no policy.
    plain, _ = _gpu_rank(rank)
    assert traced_categories(gpu, device="cuda") == traced_categories(plain, device="cuda")
    assert md.memory(gpu).peak < md.memory(plain).peak  # bf16 unsharded parameters and activations
