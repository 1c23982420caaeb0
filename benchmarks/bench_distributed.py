"""Per-rank peak memory of FSDP2 on a small LLaMA: md.memory and torch's
FSDPMemTracker (under FakeTensorMode with the fake process group), each
against a real 2-rank ``gloo`` run measured with md.LiveStorages; and the
time of a LLaMA-7B FSDP2 step traced for one rank of 8 and of 1,024.

    python benchmarks/bench_distributed.py            # everything
    python benchmarks/bench_distributed.py --timing   # the LLaMA-7B timings alone
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metadispatch as md  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from metadispatch.cli import llama  # noqa: E402
from tests import distributed_cases as cases  # noqa: E402

WORLD = 2


def real_peaks(case: str) -> tuple[list, float]:
    out = tempfile.mkdtemp()
    start = time.perf_counter()
    mp.spawn(cases.real_rank, args=(WORLD, [case], out), nprocs=WORLD)
    seconds = time.perf_counter() - start
    return [json.load(open(os.path.join(out, case, f"{r}.json")))["peak"] for r in range(WORLD)], seconds


def tracker_peak(rank: int, foreach: bool) -> int:
    """FSDPMemTracker's peak for one rank, as its docs run it: FakeTensorMode and the fake group."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("fake", store=md._compat.fake_process_group_store(), rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))  # reads its ranks' values: not under FakeTensorMode
        with FakeTensorMode():
            torch.manual_seed(0)
            model = llama.Llama(cases.CONFIG)
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
            ids = torch.randint(0, cases.CONFIG.vocab_size, (cases.BATCH, cases.SEQ))
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((ids, ids))
            with tracker:
                model(ids, ids).backward()
                opt.step()
                opt.zero_grad()
            peaks = tracker.get_tracker_snapshot("peak")
            return max(v["Total"] for v in peaks.values())
    finally:
        dist.destroy_process_group()


def step_time(world: int, foreach: bool = False) -> tuple[float, float, float, float]:
    """Seconds to trace LLaMA-7B's FSDP2 setup and its step (fw + bw + AdamW) for
    rank 0 of ``world``: (setup wall, setup CPU, step wall, step CPU).  CPU
    seconds are this process's own: on a shared machine wall time counts the
    others' work too, and tracing runs on one thread."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    t0, c0 = time.perf_counter(), time.process_time()
    with md.MetaMode(device="cuda", gpu="h100", world_size=world, rank=0):
        model, (ids, labels) = llama.build()
        mesh = init_device_mesh("cuda", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
        t1, c1 = time.perf_counter(), time.process_time()
        model(ids, labels).backward()
        opt.step()
    return t1 - t0, c1 - c0, time.perf_counter() - t1, time.process_time() - c1


def main() -> None:
    print(machine())
    if sys.argv[1:] == ["--timing"]:  # the LLaMA-7B timings alone
        _timings()
        return
    print(f"\nFSDP2, tiny LLaMA, world {WORLD}: peak bytes per rank (LiveStorages accounting)")
    print(f"{'case':<14} {'rank':>4} {'real gloo':>10} {'md.memory':>10} {'err':>7} {'FSDPMemTracker':>15} {'err':>7}")
    for case, foreach in (("fsdp", False), ("fsdp-foreach", True)):
        real, real_s = real_peaks(case)
        for rank in range(WORLD):
            t0 = time.perf_counter()
            trace, _ = cases.traced_rank(rank, WORLD, case)
            ours = md.memory(trace).peak
            ours_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                # A fresh process each: in one process the second measurement
                # differs from the first (FSDPMemTracker keeps state).
                with mp.get_context("spawn").Pool(1) as pool:
                    theirs = pool.apply(tracker_peak, (rank, foreach))
                them = f" {theirs:>15} {(theirs - real[rank]) / real[rank]:>+7.1%}"
            except Exception as e:  # what FakeTensorMode refuses is part of the comparison
                them = f" {'fails':>15} {'':>7}  ({type(e).__name__})"
            theirs_s = time.perf_counter() - t0
            print(
                f"{case:<14} {rank:>4} {real[rank]:>10} {ours:>10} {(ours - real[rank]) / real[rank]:>+7.1%}"
                f"{them}   (s: real {real_s:.1f} all ranks, md {ours_s:.2f}, tracker {theirs_s:.2f})"
            )
    _timings()


def _timings() -> None:
    print("\nLLaMA-7B bf16, 1 x 2048 tokens, FSDP2 per block, device cuda (h100), rank 0: seconds wall (CPU)")
    for world in (8, 1024):
        for foreach in (False, True):
            sw, sc, tw, tc = step_time(world, foreach)
            print(
                f"world {world:>5}, AdamW foreach={foreach!s:<5}: fully_shard setup {sw:.2f} ({sc:.2f}), "
                f"step (fw + bw + optimizer) {tw:.2f} ({tc:.2f}), total {sw + tw:.2f} ({sc + tc:.2f})"
            )


if __name__ == "__main__":
    main()
