"""md.fits: the reserved peak against a GPU's memory, and the first call that runs out."""

import textwrap

import pytest
import torch

import metadispatch as md
from metadispatch.cli.llama import LlamaConfig, example
from metadispatch.cli.main import main
from tests.models import MODELS, train_step

MiB = 2**20


def _trace(name="llama"):
    model, inputs = MODELS[name]()
    return md.tracer(device="cuda")(train_step, model, *inputs)


@pytest.fixture(scope="module")
def mid_llama():
    """A LLaMA with 0.3 GB of parameters in bf16, on meta: big enough for many segments."""
    config = LlamaConfig(vocab_size=32000, dim=1024, n_layers=4, n_heads=8, n_kv_heads=8, hidden_dim=2816)
    model, inputs = example(config, batch=2, seq=512, device="cuda")
    return md.tracer(device="cuda")(train_step, model, *inputs)


def test_fits_small_model_on_h100_with_headroom():
    t = _trace()
    f = md.fits(t, gpu="h100")
    r = md.memory(t, allocator="cuda", gpu="h100")
    assert f.fits and bool(f) and f.first_oom_call is None
    assert f.headroom == md.gpu_profile("h100").memory - r.reserved_peak
    # the cuBLAS workspaces (32 MiB each on an H100: the forward's thread's and
    # the backward's) are a large segment each, the rest one small one
    assert md.memory(t).by_category["workspaces"] == 2 * 32 * MiB
    assert str(f).startswith("fits on H100 80 GB: yes, peak reserved 66 MiB") and "to spare" in str(f)


@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_fits_names_the_first_oom_call_and_what_was_live(mid_llama, share):
    t = mid_llama
    full = md.memory(t, allocator="cuda")
    capacity = int(full.reserved_peak * share)
    f = md.fits(t, capacity=capacity)
    oom = f.first_oom_call
    assert not f.fits and f.headroom == capacity - f.reserved_peak < 0
    assert oom.index == md.memory(t, allocator="cuda", capacity=capacity).first_oom_call >= 0
    call = t.calls[oom.index]
    assert (oom.op, oom.module, oom.phase) == (call.op, call.module, call.phase)
    # what was live is md.memory's live set after that call, and it exceeds nothing impossible
    assert sum(oom.live_by_category.values()) == md.memory(t).timeline[oom.index]
    assert oom.largest[0][0] >= oom.largest[-1][0]
    text = str(f)
    assert "\n" not in text and "short by" in text and f"call #{oom.index} {oom.op}" in text


def test_fits_parameters_alone_too_large_say_so(mid_llama):
    params = md.memory(mid_llama).by_category["params"]
    f = md.fits(mid_llama, capacity=params // 2)
    oom = f.first_oom_call
    assert oom.index == -1 and "before the first call" in str(f)
    assert oom.live_by_category["params"] == params  # every leaf, nothing a call made
    assert oom.live_by_category["activations"] == 0


def test_fits_honours_allocator_options():
    def step(x):  # 13 MiB + 512 B each: 14 MiB segments, or 16 MiB rounded to halves of a power of two
        return (x * 2) + 1

    t = md.tracer(device="cuda")(step, torch.ones((13 * MiB + 512) // 4))
    plain = md.fits(t, capacity=45 * MiB)
    rounded = md.fits(t, capacity=45 * MiB, roundup_power2_divisions=2)
    assert plain.fits and plain.reserved_peak == 42 * MiB
    assert not rounded.fits and rounded.first_oom_call.index == 1 and rounded.reserved_peak == 48 * MiB


def test_cli_trace_gpu_prints_whether_it_fits(tmp_path, capsys, monkeypatch):
    (tmp_path / "fitmodel.py").write_text(
        textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.ones(4, 8)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["trace", "fitmodel:build", "--gpu", "a100-40gb"]) == 0
    out = capsys.readouterr().out
    # cuBLAS's 8 MiB + 128 KiB workspace on an A100 takes a 20 MiB segment
    assert "\nfits on A100 40 GB: yes, peak reserved 22 MiB of 39.6 GiB" in out
    assert "\nestimated step time on A100 40 GB: " in out


def test_fits_and_memory_take_the_gpu_the_trace_was_recorded_for():
    t = md.tracer(mode_factory=lambda: md.MetaMode(device="cuda", gpu="l4"))(lambda x: x @ x, torch.ones(64, 64))
    assert t.gpu == "l4"
    f = md.fits(t)
    assert f.gpu.name == "l4" and f.capacity == md.gpu_profile("l4").memory
    # an L4 (compute capability 8.9) gets cuBLAS's 8 MiB + 128 KiB workspace, an H100 32 MiB
    assert md.memory(t).by_category["workspaces"] == 8 * MiB + 128 * 1024
    assert md.memory(t, allocator="cuda", gpu="h100").reserved_peak == 32 * MiB + 2 * MiB
    assert md.memory(t, allocator="cuda").reserved_peak == 20 * MiB + 2 * MiB
