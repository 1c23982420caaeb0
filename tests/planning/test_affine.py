"""The lines through small traces give a deep model's allocated peak at any batch, to the byte."""

import pytest

import metadispatch as md
from metadispatch.planning.affine import aligned, largest, peak
from tests.planning.test_max_batch import _deep_llama


def _points(batch, layers):
    fn, args = _deep_llama(batch, layers)
    fit = md.fits(md.tracer(device="cuda", gpu="l4", warmup=1)(fn, *args), "l4")
    return fit, aligned(fit.memory.memory.trace.calls, fit.memory.memory.timeline, layers)


@pytest.mark.slow
def test_lines_from_two_and_four_blocks_give_the_full_depths_peak():
    points = {(b, k): _points(b, k)[1] for k in (2, 4) for b in (1, 2)}
    for batch in (3, 16):
        full = _points(batch, None)[0]  # 8 blocks
        assert peak(points, batch, 8) == pytest.approx(full.memory.peak, abs=1024)
    over = largest(points, full.memory.peak, 8)
    assert over == 16  # the largest batch within a peak is the batch that peaked there


def test_lines_need_calls_that_line_up():
    fit, one = _points(1, 2)
    other = (one[0][:-1], one[1][:-1])  # a call fewer
    assert largest({(1, 2): one, (2, 2): other, (1, 4): one, (2, 4): one}, 10**12, 8) is None
    memory = fit.memory.memory
    assert aligned(memory.trace.calls, memory.timeline, 3) is None  # no list of 3 blocks in a 2-block model
