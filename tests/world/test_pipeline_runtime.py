"""``md.runtime`` over a pipeline's ranks, each traced alone (Note [A
pipeline's bubble from its stages' traces]): the schedules' micro-batches
in flight, and the step as the ranks' traces run against each other."""

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
