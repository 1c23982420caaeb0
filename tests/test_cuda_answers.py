"""torch.cuda under a logical-GPU MetaMode: the profile's answers in its thread only
(Note [The logical GPU answers per thread] in core/cuda_answers.py)."""

import threading

import pytest
import torch

import metadispatch as md

_FUNCTIONS = ("is_available", "device_count", "get_device_name", "get_device_capability", "get_device_properties")


def _torch_functions():
    return {name: getattr(torch.cuda, name) for name in (*_FUNCTIONS, "mem_get_info", "synchronize")} | {
        "nvtx." + n: getattr(torch.cuda.nvtx, n) for n in ("range_push", "range_pop", "mark")
    }


def _asked():
    """What code asking about the GPU sees: each answer, or the error's type."""
    seen = {}
    for name in _FUNCTIONS:
        try:
            seen[name] = getattr(torch.cuda, name)()
        except Exception as e:  # torch's own answer on a host without the GPU
            seen[name] = type(e)
    return seen


@pytest.mark.parametrize("gpu", ["h100", "a100-40gb", "l4"])
def test_cuda_answers_are_the_profiles(gpu):
    profile = md.gpu_profile(gpu)
    with md.MetaMode(device="cuda", gpu=gpu):
        props = torch.cuda.get_device_properties(0)
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        assert torch.cuda.get_device_capability() == profile.compute_capability == (props.major, props.minor)
        assert torch.cuda.get_device_name() == props.name == profile.title
        assert props.total_memory == profile.memory and props.multi_processor_count == profile.sm_count
        assert torch.cuda.mem_get_info() == (profile.memory, profile.memory)
        torch.cuda.set_device(0)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.range_pop()


def test_cuda_answers_model_code_asking_for_the_gpu_traces():
    def step(x):
        major, _ = torch.cuda.get_device_capability()  # as transformers does before _grouped_mm
        return x * major

    trace = md.tracer(device="cuda", gpu="h100")(step, torch.randn(3))
    assert trace.calls[-1].args[1] == 9


def test_cuda_answers_nothing_outside_the_mode_and_after_an_exception():
    before, functions = _asked(), _torch_functions()
    with pytest.raises(ValueError):
        with md.MetaMode(device="cuda", gpu="h100"):
            with md.MetaMode(device="cuda", gpu="h100"):
                assert torch.cuda.is_available()
            assert torch.cuda.is_available()
            raise ValueError
    assert _torch_functions() == functions and _asked() == before


def test_cuda_answers_an_inner_mode_on_another_device_gets_torchs():
    before = _asked()
    with md.MetaMode(device="cuda", gpu="h100"):
        with md.MetaMode(device="cpu"):
            assert _asked() == before
        assert torch.cuda.is_available()


def test_cuda_answers_other_threads_get_torchs_and_their_own_profiles():
    before = _asked()
    entered, asked = threading.Barrier(3), threading.Barrier(3)
    seen = {}

    def in_mode(gpu):
        with md.MetaMode(device="cuda", gpu=gpu):
            entered.wait()
            seen[gpu] = torch.cuda.get_device_name()
            asked.wait()

    def outside():
        entered.wait()  # both modes are entered now
        seen["none"] = _asked()
        asked.wait()

    threads = [threading.Thread(target=in_mode, args=(g,)) for g in ("h100", "l4")] + [threading.Thread(target=outside)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"h100": md.gpu_profile("h100").title, "l4": md.gpu_profile("l4").title, "none": before}
    assert _asked() == before
