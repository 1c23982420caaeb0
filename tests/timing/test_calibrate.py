"""md.replay(timing=True) measures each call; md.calibrate fits md.runtime's table to such times."""

import pytest
import torch

import metadispatch as md
from metadispatch.timing.runtime import Efficiency, runtime
from tests.models import MODELS, train_step

KNOWN = Efficiency(
    matmul=((1e8, 0.1), (1e10, 0.35), (1e11, 0.55), (float("inf"), 0.8)),
    other=((float("inf"), 0.5),),
    memory=0.65,
    launch=4e-6,
)


def _step(a, b, c, x):
    big = (a @ b).relu()  # 4096^3 bf16: the top matmul bucket
    mid = c @ c.t()  # 2048 x 1024 x 2048: 8.6 GFLOP, the second bucket
    return big.sum() + mid.sum() + (x * 3).sum() + (x + 1).mean()


def _mixed_trace():
    bf = torch.bfloat16
    args = (torch.empty(4096, 4096, dtype=bf), torch.empty(4096, 4096, dtype=bf), torch.empty(2048, 1024, dtype=bf))
    return md.tracer(device="cuda")(_step, *args, torch.empty(1 << 24))


def test_calibrate_recovers_the_table_that_made_the_times():
    t = _mixed_trace()
    times = runtime(t, gpu="h100", efficiency=KNOWN).per_call  # what a GPU with KNOWN's kernels would measure
    e = md.calibrate(t, times, gpu="h100")
    assert e.matmul[3][1] == pytest.approx(0.8) and e.matmul[1][1] == pytest.approx(0.35)
    assert e.memory == pytest.approx(0.65)
    # buckets without calls keep the table in use: nothing measured them
    assert e.matmul[0][1] == md.Efficiency().matmul[0][1] and e.attention == md.Efficiency().attention


def test_calibrate_fits_launch_cost_from_calls_with_nothing_to_do():
    t = md.tracer(device="cuda")(lambda y: ((y + 1) * 2).neg(), torch.ones(8))
    e = md.calibrate(t, [3e-6, 5e-6, 4e-6], gpu="h100")
    assert e.launch == 4e-6 and e.memory == md.Efficiency().memory


def test_calibrate_writes_a_table_that_loads_back(tmp_path):
    t = _mixed_trace()
    times = runtime(t, gpu="a100-80gb", efficiency=KNOWN).per_call
    e = md.calibrate(t, times, gpu="a100-80gb", path=tmp_path / "a100.json")
    loaded = md.load_efficiency(tmp_path / "a100.json")
    assert loaded == e
    assert runtime(t, gpu="a100-80gb", efficiency=loaded).total == pytest.approx(sum(times))


def test_calibrate_refuses_times_of_another_trace():
    t = _mixed_trace()
    with pytest.raises(md.MetaDispatchError, match="times for a trace of"):
        md.calibrate(t, [1e-3], gpu="h100")


@pytest.mark.parametrize("check", [True, False])
def test_replay_timing_measures_every_call(check):
    model, inputs = MODELS["mlp"]()
    t = md.trace(train_step, model, *inputs)
    r = md.replay(t, (model, *inputs), timing=True, check=check)
    assert len(r.times) == len(t.calls) and all(s > 0 for s in r.times)
    assert r.checked == check and (r.ok or not check)
    assert md.replay(t, (model, *inputs)).times is None


@pytest.mark.cuda
def test_calibrate_on_a_real_gpu_explains_the_measured_step():
    bf = torch.bfloat16
    args = (
        torch.randn(4096, 4096, dtype=bf),
        torch.randn(4096, 4096, dtype=bf),
        torch.randn(2048, 1024, dtype=bf),
        torch.randn(1 << 24),
    )
    t = _mixed_trace()
    md.replay(t, args, device="cuda", timing=True)  # first use: handles, plans
    times = md.replay(t, args, device="cuda", timing=True).times
    name = torch.cuda.get_device_name().lower()
    gpu = "h100" if "h100" in name else "a100-80gb" if "a100" in name else "h200" if "h200" in name else "l4"
    e = md.calibrate(t, times, gpu=gpu)
    assert runtime(t, gpu=gpu, efficiency=e).total == pytest.approx(sum(times), rel=0.3)
