"""md's expert parallelism (world/expert_parallel.py, the dispatch ``md.plan``'s EP configurations run) on
transformers' Qwen3-MoE block, traced under a declared routing, against real ``gloo`` runs of 2 and 4
processes whose router is forced to that routing (tests/ep_cases.py): per rank the same collective
sequence (op, tensors, bytes, split sizes, group) and the peak within 1 KiB."""

import json

import pytest
import torch.multiprocessing as mp

import metadispatch as md
from tests.distributed_cases import comparable

pytest.importorskip("transformers")

from tests.ep_cases import real_rank, traced_rank  # noqa: E402

RUNS = {2: ["uniform", "worst"], 4: ["uniform"]}  # worst at 4: one local expert cannot take both picks
_REAL: dict = {}


def _real(world: int, tmp_path_factory) -> dict:
    if world not in _REAL:
        out = tmp_path_factory.mktemp(f"ep{world}")
        mp.set_forkserver_preload(["tests.ep_cases"])
        mp.start_processes(real_rank, args=(world, RUNS[world], str(out)), nprocs=world, start_method="forkserver")
        _REAL[world] = {r: [json.loads((out / r / f"{k}.json").read_text()) for k in range(world)] for r in RUNS[world]}
    return _REAL[world]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "routing"), [(w, r) for w, rs in RUNS.items() for r in rs])
def test_expert_parallel_block_matches_real_gloo_run(world, routing, tmp_path_factory):
    real = _real(world, tmp_path_factory)[routing]
    for rank in range(world):
        trace = traced_rank(routing, rank, world)
        collectives = json.loads(json.dumps(comparable(md.comms(trace).calls)))
        assert [c[0] for c in collectives].count("_c10d_functional.all_to_all_single.default") == 5, (
            collectives
        )  # counts; tokens, combine and their backward
        assert collectives == real[rank]["collectives"], f"rank {rank}"
        peak = md.memory(trace).peak
        assert abs(peak - real[rank]["peak"]) <= 1024, f"rank {rank}: traced {peak}, real {real[rank]['peak']}"
