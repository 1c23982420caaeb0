"""Context parallelism (``context_parallel`` on SDPA) on one rank of a logical world,
against real ``gloo`` runs of 2 and 4 processes (Note [A GPU's attention kernel
on a CPU rank] in tests/cp_cases.py says what of the real run is a stand-in).

Per rank: the same collective sequence (op, tensors, bytes, group), the same
attention kernels and collectives in the same order, and the peak within
1 KiB; on a logical H100 the same ring, its kernel chosen by the mode.
"""

import json

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import _attention as cp_attention
from torch.distributed.tensor.experimental import context_parallel

import metadispatch as md
from tests import cp_cases
from tests.distributed_cases import comparable

_REAL: dict = {}


def _real(world_size: int, tmp_path_factory) -> list:
    if world_size not in _REAL:
        out = tmp_path_factory.mktemp(f"cp{world_size}")
        mp.set_forkserver_preload(["tests.cp_cases"])  # Note [Ranks forked from one server]
        mp.start_processes(
            cp_cases.real_rank, args=(world_size, str(out)), nprocs=world_size, start_method="forkserver"
        )
        _REAL[world_size] = [json.loads((out / f"{r}.json").read_text()) for r in range(world_size)]
    return _REAL[world_size]


def _traced(world_size: int, rank: int, gpu: bool):
    torch.manual_seed(0)
    options = dict(device="cuda", gpu="h100") if gpu else dict(device="cpu")
    with md.MetaMode(world_size=world_size, rank=rank, **options) as mode:
        cp_cases.cp_step(world_size, gpu=gpu)
    return mode.trace


def _ops(trace) -> list:
    return [c.op for c in trace.calls if cp_cases.kept(c.op)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_rank_matches_real_gloo_run(world_size, tmp_path_factory):
    real = _real(world_size, tmp_path_factory)
    for rank in range(world_size):
        trace = _traced(world_size, rank, gpu=False)
        assert json.loads(json.dumps(comparable(md.comms(trace).calls))) == real[rank]["collectives"], f"rank {rank}"
        assert _ops(trace) == real[rank]["ops"], f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_rank_peak_matches_real_gloo_run(world_size, tmp_path_factory):
    real = _real(world_size, tmp_path_factory)
    for rank in range(world_size):
        trace = _traced(world_size, rank, gpu=False)
        assert abs(md.memory(trace).peak - real[rank]["peak"]) <= 1024, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_on_a_logical_h100_runs_the_real_ring(world_size, tmp_path_factory):
    # No stand-in: the mode's SDPA choice for the DTensor picks cuDNN on an
    # H100 (torch 2.13), and the ring's kernels and collectives are the real run's.
    real = _real(world_size, tmp_path_factory)
    for rank in range(world_size):
        trace = _traced(world_size, rank, gpu=True)
        assert json.loads(json.dumps(comparable(md.comms(trace).calls))) == real[rank]["collectives"], f"rank {rank}"
        assert _ops(trace) == real[rank]["ops"], f"rank {rank}"


def _cp_refused(seq: int, match: str) -> None:
    with md.MetaMode(device="cuda", gpu="h100", world_size=2) as mode:
        mesh = init_device_mesh("cuda", (2,))
        model = cp_cases.Attention().cuda().bfloat16()
        x = torch.randn(1, seq, cp_cases.DIM, device="cuda", dtype=torch.bfloat16)
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            with pytest.raises(md.UnsupportedFeatureError, match=match):
                model(x)
    assert not md.comms(mode.trace).calls  # refused before the ring's first exchange


def test_context_parallel_unchecked_rotate_method_is_refused():
    cp_attention.set_rotate_method("alltoall")
    try:
        _cp_refused(32, "rotate method ALL_TO_ALL")
    finally:
        cp_attention.set_rotate_method("allgather")


def test_context_parallel_without_load_balancing_is_refused():
    # 30 tokens over 2 ranks: not divisible into 4 head-tail chunks, so torch shards them plainly.
    _cp_refused(30, "no load balancing")


def test_context_parallel_on_a_logical_cpu_fails_as_a_cpu_job_does():
    # torch's CPU attention kernel has no CP rule: a real gloo job raises this too.
    with md.MetaMode(device="cpu", world_size=2):
        mesh = init_device_mesh("cpu", (2,))
        model = cp_cases.Attention().bfloat16()
        x = torch.randn(1, 32, cp_cases.DIM, dtype=torch.bfloat16)
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu"):
                model(x)
