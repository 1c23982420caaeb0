"""A 3-D combination -- pipeline x FSDP2 x tensor parallelism on one
``(pp, dp, tp)`` mesh (``tests.distributed_cases.three_d_step``) -- against a
real ``gloo`` run.

The real run is the smaller world, 4 processes on a ``(2, 1, 2)`` mesh (FSDP2
over one rank issues no collective): per rank, the shards, the collective
sequence and the bytes by category are equal, as in
test_distributed_ground_truth.py.  The logical world of 8, ``(2, 2, 2)``, is
checked per rank class (its pipeline stage) against that run: its
collectives are the real run's -- the same tensor-parallel all-reduces,
sends and receives, in the same order -- with FSDP2's all-gathers and
reduce-scatters over the rank's data-parallel pair between them.
"""

import json

import pytest

import metadispatch as md
from tests.distributed_cases import comparable, traced_categories, traced_rank
from tests.world.test_distributed import _spawn

_REAL: dict = {}


def _real(tmp_path_factory) -> list:
    if not _REAL:
        _REAL.update(_spawn(["3d"], 4, tmp_path_factory))
    return _REAL["3d"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(4))
def test_distributed_3d_rank_matches_real_gloo_run(rank, tmp_path_factory):
    real = _real(tmp_path_factory)[rank]
    trace, shards = traced_rank(rank, 4, "3d", device="cpu")
    assert shards == real["shards"]
    assert json.loads(json.dumps(comparable(md.comms(trace).calls))) == real["collectives"]
    # The stage's gradients, reduced after its last backward by the schedule
    # itself (Note [A pipeline stage reduces its gradients after backward]).
    assert traced_categories(trace) == real["categories"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(4))
def test_distributed_3d_peak_matches_real_gloo_run(rank, tmp_path_factory):
    peak = md.memory(traced_rank(rank, 4, "3d", device="cpu")[0]).peak
    assert abs(peak - _real(tmp_path_factory)[rank]["peak"]) <= 1024


def _without_members(calls) -> list:
    return [c[:-1] for c in json.loads(json.dumps(calls))]


@pytest.mark.slow
@pytest.mark.parametrize("rank,small", [(0, 0), (5, 3)])  # a rank of each stage, its place in the 4-rank run
def test_distributed_3d_world_of_8_is_the_smaller_run_with_fsdp_between(rank, small, tmp_path_factory):
    calls = md.comms(traced_rank(rank, 8, "3d", device="cpu")[0]).calls
    fsdp = [c for c in calls if c.kind in ("all_gather", "reduce_scatter")]
    rest = [c for c in calls if c.kind not in ("all_gather", "reduce_scatter")]
    assert _without_members(comparable(rest)) == _without_members(_real(tmp_path_factory)[small]["collectives"])
    # FSDP2 over the rank's data-parallel pair: the ranks 2 apart on the mesh.
    pair = sorted({rank, rank ^ 2})
    assert fsdp and all(list(c.group.ranks) == pair for c in fsdp)
    assert {c.kind for c in fsdp} == {"all_gather", "reduce_scatter"}
