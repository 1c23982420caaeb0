"""GPU profiles: the registry, the default, user profiles, and the datasheet figures' sanity."""

import dataclasses

import pytest
import torch

import metadispatch as md
from metadispatch.spec import profiles

BUILT_IN = ["h100", "h200", "a100-80gb", "a100-40gb", "l4", "l40s", "b200"]


@pytest.mark.parametrize("name", BUILT_IN)
def test_profile_built_in_figures_are_consistent(name):
    p = md.gpu_profile(name)
    assert p.name == name
    assert set(p.flops) >= {"fp64", "fp32", "tf32", "bf16", "fp16", "int8"}
    # tensor cores: each narrower dtype is at least as fast as the wider one
    assert p.flops["fp32"] <= p.flops["tf32"] <= p.flops["bf16"] == p.flops["fp16"] <= p.flops["int8"]
    # the reported total is below the marketing size in GB (decimal) and above 90% of it
    marketed = int(p.title.split()[1]) * 10**9
    assert 0.9 * marketed < p.memory <= marketed * 1.075  # GiB-sized parts report up to 1.074x
    assert p.bandwidth > 1e11 and p.l2_bytes > 0 and p.interconnect > 0


def test_profile_default_is_h100():
    assert md.gpu_profile() is md.gpu_profile("H100") is md.gpu_profile("h100")


def test_profile_passes_a_profile_through():
    p = md.gpu_profile("l4")
    assert md.gpu_profile(p) is p


def test_profile_unknown_name_lists_known():
    with pytest.raises(md.MetaDispatchError, match="h100"):
        md.gpu_profile("v100")


def test_profile_user_defined_registers_and_refuses_duplicates():
    mine = dataclasses.replace(md.gpu_profile("a100-40gb"), name="test-a100-small", memory=10 * 2**30)
    try:
        assert md.register_gpu(mine) is mine
        assert md.gpu_profile("test-a100-small").memory == 10 * 2**30
        with pytest.raises(md.MetaDispatchError, match="registered already"):
            md.register_gpu(mine)
        md.register_gpu(dataclasses.replace(mine, memory=1), override=True)
        assert md.gpu_profile("test-a100-small").memory == 1
    finally:
        profiles._PROFILES.pop("test-a100-small", None)


def test_profile_is_frozen_and_its_flops_read_only():
    p = md.gpu_profile("h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.memory = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.flops["bf16"] = 1  # type: ignore[index]


def test_profile_peak_falls_back_to_a_wider_dtype():
    a100 = md.gpu_profile("a100-80gb")
    assert "fp8" not in a100.flops
    assert a100.peak("fp8") == a100.flops["fp16"]
    assert md.gpu_profile("h100").peak("fp8") == 2 * md.gpu_profile("h100").peak("bf16")


def test_profile_unregistered_travels_with_the_trace_and_answers_its_analyses(tmp_path):
    # A profile made with dataclasses.replace (the device's own CUDA and cuDNN
    # versions, a smaller card) and passed as gpu= without registering it:
    # md.memory and md.fits of the trace use it; the registry stays as it was.
    mine = dataclasses.replace(md.gpu_profile("h100"), name="h100-unregistered", memory=2**20)
    before = dict(profiles.gpu_profiles())
    lin = torch.nn.Linear(256, 256)
    trace = md.tracer(device="cuda", gpu=mine)(lambda m, x: m(x).sum().backward(), lin, torch.randn(64, 256))
    assert trace.gpu is mine
    assert md.memory(trace).peak == md.memory(trace, gpu="h100").peak > 0
    assert md.memory(trace, allocator="cuda").capacity == 2**20
    assert not md.fits(trace).fits  # 2 MiB segments do not fit in 1 MiB: the profile's memory was used
    assert profiles.gpu_profiles() == before
    trace.save(tmp_path / "t.json")
    assert md.Trace.load(tmp_path / "t.json").gpu == "h100-unregistered"


def test_profile_unregistered_copies_pickles_and_may_not_take_a_registered_name():
    import copy
    import pickle

    mine = dataclasses.replace(md.gpu_profile("h100"), name="h100-copied", memory=2**30)
    lin = torch.nn.Linear(8, 8)
    trace = md.tracer(device="cuda", gpu=mine)(lambda m, x: m(x).sum().backward(), lin, torch.randn(2, 8))
    assert copy.deepcopy(trace).gpu is mine
    again = pickle.loads(pickle.dumps(mine))
    assert again == mine and dict(again.flops) == dict(mine.flops)
    # the registered h100 with other figures: a saved trace would reload as the stock one
    other = dataclasses.replace(md.gpu_profile("h100"), memory=2**20)
    with pytest.raises(md.MetaDispatchError, match="registered with other figures"):
        md.MetaMode(device="cuda", gpu=other)


def test_profile_l40s_decides_capacity_and_attention():
    # CONTRIBUTING's newcomer path for a profile, tried on the L40S: its
    # capacity decides md.fits (a 30 GiB step fits on it and not on an L4),
    # and its capability (8, 9) is what torch.cuda answers, so SDPA picks
    # the backend torch picks on Ada (flash attention, as on the L4).
    def step(x):
        q = x.view(1, 8, 1024, 64)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    big = md.tracer(device="cuda", gpu="l40s")(lambda: torch.empty(30 * 2**30, dtype=torch.uint8, device="cuda"))
    assert md.fits(big, gpu="l40s").fits and not md.fits(big, gpu="l4").fits
    ops = {}
    for gpu in ("l40s", "l4"):
        with md.MetaMode(device="cuda", gpu=gpu):
            assert torch.cuda.get_device_capability() == (8, 9)
        trace = md.tracer(device="cuda", gpu=gpu)(step, torch.randn(8 * 1024 * 64, dtype=torch.float16))
        ops[gpu] = [c.op for c in trace.calls]
    assert ops["l40s"] == ops["l4"] and any("flash" in op for op in ops["l40s"])
