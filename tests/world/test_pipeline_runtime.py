"""``md.runtime`` over a pipeline's ranks, each traced alone (Note [A
pipeline's bubble from its stages' traces]): the schedules' micro-batches
in flight, and the step as the ranks' traces run against each other."""

from collections import Counter

import pytest

import metadispatch as md
from tests.distributed_cases import MICRO, traced_rank


def _ranks(case: str, world_size: int) -> list:
    return [traced_rank(r, world_size, case, device="cpu")[0] for r in range(world_size)]


@pytest.mark.parametrize(
    "case,world_size,in_flight",
    [
        ("pp-gpipe", 2, [MICRO, MICRO]),  # every micro-batch forward before any backward
        ("pp-1f1b", 2, [2, 1]),  # stage s holds p - s
        ("pp-1f1b", 4, [4, 3, 2, 1]),
    ],
)
def test_pipeline_runtime_counts_the_schedules_micro_batches_in_flight(case, world_size, in_flight):
    traces = _ranks(case, world_size)
    p = md.runtime(traces, gpu="h100")
    assert p.in_flight == in_flight
    # Each rank is busy exactly its own calls' time; it waits for the others
    # only where it receives, so the step is no shorter than the busiest rank.
    alone = [md.runtime(t, gpu="h100").total for t in traces]
    assert p.busy == pytest.approx(alone)
    assert p.total >= max(alone) and p.bubble == pytest.approx([p.total - b for b in alone])
    assert 0 < p.bubble_fraction < 1


def test_pipeline_runtime_refuses_ranks_that_do_not_pair():
    traces = _ranks("pp-gpipe", 2)
    with pytest.raises(md.MetaDispatchError, match="waits for a send no rank's trace makes"):
        md.runtime(traces[1:], gpu="h100")  # rank 1 alone: its receives have no sender


@pytest.mark.parametrize("case", ["pp-interleaved-zb", "pp-zbv", "pp-dualpipev"])
def test_pipeline_runtime_zero_bubble_schedules_pair_their_sends_and_fill_the_bubble(case):
    # Two stages a rank (their collectives held to real gloo runs in
    # test_distributed_ground_truth.py).  Every receive is matched to a send
    # of the other rank, and splitting backward into input and weight
    # gradients leaves less idle time than interleaved 1F1B on the same stages.
    traces = _ranks(case, 2)
    for r, trace in enumerate(traces):
        kinds = Counter(c.kind for c in md.comms(trace).calls)
        other = Counter(c.kind for c in md.comms(traces[1 - r]).calls)
        assert kinds["send"] == other["recv"] > 0
    p = md.runtime(traces, gpu="h100")
    assert p.busy == pytest.approx([md.runtime(t, gpu="h100").total for t in traces])
    assert 0 < p.bubble_fraction < md.runtime(_ranks("pp-interleaved", 2), gpu="h100").bubble_fraction


def test_pipeline_runtime_pairs_stages_by_the_rank_each_was_traced_as():
    # 3-D on 8 ranks: the stages of one pipeline are ranks 0 and 4 (the
    # others shard and split them); their sends name those ranks.
    traces = [traced_rank(r, 8, "3d", device="cpu")[0] for r in (0, 4)]
    p = md.runtime(traces, gpu="h100")
    assert p.ranks == [0, 4] and p.in_flight == [2, 1]
    assert "  rank 4: busy" in str(p)
    with pytest.raises(md.MetaDispatchError, match="rank 4 waits for a send"):
        md.runtime(traces[1:], gpu="h100")


@pytest.mark.parametrize("schedule", ["pp-gpipe", "pp-1f1b"])
def test_pipeline_gradient_messages_are_recorded_as_backward(schedule):
    # Note [A pipeline's gradient messages are backward's]: the first stage
    # sends activations and receives gradients, the last the other way
    # round; the schedule issues both outside the autograd engine.  (Each
    # rank's first send and receive are the stages' vote, before the step.)
    first, last = _ranks(schedule, 2)
    phases = {
        rank: {kind: [c.phase for c in md.comms(t).calls if c.kind == kind][1:] for kind in ("send", "recv")}
        for rank, t in enumerate((first, last))
    }
    assert phases[0] == {"send": ["forward"] * MICRO, "recv": ["backward"] * MICRO}
    assert phases[1] == {"send": ["backward"] * MICRO, "recv": ["forward"] * MICRO}
