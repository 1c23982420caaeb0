"""A dropless expert-parallel MoE layer traced under a declared routing
(``md.RoutingAssumption``), against real ``gloo`` runs of the same layer
whose router is forced to that routing (tests/moe_cases.py): the same
collectives with the same split sizes on every rank, the peak within 1 KiB.
"""

import json
import re

import pytest
import torch
import torch.multiprocessing as mp

import metadispatch as md
from tests.distributed_cases import comparable
from tests.moe_cases import ROUTINGS, TOKENS, real_rank, traced_rank

_REAL: dict = {}


def _real(world: int, tmp_path_factory) -> dict:
    if world not in _REAL:
        out = tmp_path_factory.mktemp(f"moe{world}")
        mp.set_forkserver_preload(["tests.moe_cases"])
        mp.start_processes(real_rank, args=(world, list(ROUTINGS), str(out)), nprocs=world, start_method="forkserver")
        _REAL[world] = {r: [json.loads((out / r / f"{k}.json").read_text()) for k in range(world)] for r in ROUTINGS}
    return _REAL[world]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_routing_dropless_moe_matches_real_gloo_run(routing, world, tmp_path_factory):
    real = _real(world, tmp_path_factory)[routing]
    for rank in range(world):
        trace = traced_rank(routing, rank, world)
        collectives = json.loads(json.dumps(comparable(md.comms(trace).calls)))
        assert collectives == real[rank]["collectives"], f"rank {rank}"
        peak = md.memory(trace).peak
        assert abs(peak - real[rank]["peak"]) <= 1024, f"rank {rank}: traced {peak}, real {real[rank]['peak']}"


def test_routing_assumptions_are_listed_and_worst_case_sizes_rank_0(tmp_path):
    world = 2
    trace = traced_rank("worst", 0, world)
    ops = [a.op for a in trace.assumptions]
    assert ops == ["aten.histc.default", "_c10d_functional.all_to_all_single.default"] + ["Tensor.tolist"] * 3
    # The split sizes read: rank 0 keeps all 32 tokens and receives 32 from rank 1.
    assert [a.value for a in trace.assumptions[2:4]] == ["[32, 0]", "[32, 32]"]
    path = tmp_path / "moe.json.gz"
    trace.save(path)
    assert [str(a) for a in md.Trace.load(path, allow_ops=sorted({c.op for c in trace.calls})).assumptions] == [
        str(a) for a in trace.assumptions
    ]
    assert all("RoutingAssumption('worst')" in a.basis for a in trace.assumptions)
    # Rank 0 receives every token of every rank; rank 1 none.
    sizes = [c.bytes for c in md.comms(trace).calls]
    assert max(sizes) == world * TOKENS * 16 * 4
    quiet = [c.bytes for c in md.comms(traced_rank("worst", 1, world)).calls]
    assert 0 in quiet


def test_routing_without_an_assumption_is_refused_and_bad_routings_are_typed():
    with pytest.raises(md.DataDependentError):
        with md.MetaMode(device="cpu", world_size=2, rank=0):
            from tests.moe_cases import moe_step

            moe_step("uniform", 0, 2)
    for bad in ("sometimes", {0: 0.5}, [[1, 2], [3]]):
        with pytest.raises(ValueError, match="RoutingAssumption"):
            md.RoutingAssumption(bad)
    with pytest.raises(TypeError, match="RoutingAssumption"):
        md.RoutingAssumption(3)


def test_routing_fractions_and_recorded_counts():
    policy = md.RoutingAssumption({0: 0.5, 3: 0.5})
    assert policy.counts(0, 2, 4, 10) == [5, 0, 0, 5]
    recorded = md.RoutingAssumption([[1, 2, 3, 4], [4, 3, 2, 1]])
    with pytest.raises(ValueError, match="12 picks"):
        recorded.counts(1, 2, 4, 12)
    assert recorded.counts(1, 2, 4, 10) == [4, 3, 2, 1]
    assert torch.tensor(recorded.counts(0, 2, 4, 10)).sum() == 10


def test_routing_eager_all_to_all_single_receives_each_ranks_recorded_counts():
    # dist.all_to_all_single (c10d.alltoall_base_) writes the counts into a buffer.
    import torch.distributed as dist

    def layer(top):
        counts = torch.histc(top.float(), bins=4, min=0, max=3)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)
        return got.tolist()

    recorded = [[1, 2, 3, 4], [4, 3, 2, 1]]
    for rank in range(2):
        policy = md.RoutingAssumption(recorded)
        t = md.tracer(assume=policy, world_size=2, rank=rank, device="cpu")(layer, torch.zeros(10, dtype=torch.long))
        mine = slice(2 * rank, 2 * rank + 2)
        assert t.output == [float(c) for row in recorded for c in row[mine]]
        assert [a.op for a in t.assumptions][-1] == "Tensor.tolist"


def _count_exchange(splits, eager: bool):
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single

    def layer(top):
        counts = torch.histc(top.float(), bins=4, min=0, max=3)
        if eager:
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, output_split_sizes=splits, input_split_sizes=splits)
        else:
            got = all_to_all_single(counts, splits, splits, dist.group.WORLD)
        return got.tolist()

    policy = md.RoutingAssumption([[1, 2, 3, 4], [4, 3, 2, 1]])
    return md.tracer(assume=policy, world_size=2, rank=0, device="cpu")(layer, torch.zeros(10, dtype=torch.long))


@pytest.mark.parametrize("eager", [False, True])
def test_routing_count_all_to_all_with_other_splits_is_refused(eager):
    # The routing sends 2 counts to each of 2 ranks; splits of 3 and 1 would move other counts.
    assert _count_exchange([2, 2], eager).output == [1.0, 2.0, 4.0, 3.0]
    op = "c10d.alltoall_base_.default" if eager else "_c10d_functional.all_to_all_single.default"
    with pytest.raises(md.UnsupportedFeatureError, match=rf"{re.escape(op)}: output_split_sizes=\[3, 1\].*\[2, 2\]"):
        _count_exchange([3, 1], eager)


def test_routing_bincount_needs_minlength_and_no_weights():
    policy = md.RoutingAssumption("uniform")
    ids = torch.zeros(8, dtype=torch.long)
    for count in (lambda t: torch.bincount(t), lambda t: torch.bincount(t, torch.ones(8), minlength=4)):
        with pytest.raises(md.UnsupportedFeatureError, match="bincount.*minlength"):
            md.tracer(assume=policy, world_size=2, rank=0, device="cpu")(count, ids)
    t = md.tracer(assume=policy, world_size=2, rank=1, device="cpu")(
        lambda t: torch.bincount(t, minlength=4).tolist(), ids
    )
    assert t.output == [2, 2, 2, 2]
