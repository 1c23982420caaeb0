"""An int device (``device=1``, ``.to(0)``) under a MetaMode on a logical GPU is that GPU's index.

Note [An int device is the logical GPU's index] in tensor/tensor.py: torch
reads an int as an index of the host's accelerator and raises on a host
without one; a trace models a CUDA machine, so the int is ``cuda:N``, checked
as ``"cuda:N"`` is (Note [A factory's named device] in mode/devices.py).
"""

import pytest
import torch

import metadispatch as md

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the logical machine is the host's")


def test_int_device_outside_a_mode_is_torchs_error_on_this_host():
    # what the mode replaces: torch's own answer on a host without CUDA
    with pytest.raises(RuntimeError):
        torch.empty(2, device=0)


@pytest.mark.parametrize("make", [torch.empty, torch.zeros, torch.ones, torch.tensor, torch.arange])
def test_int_device_names_the_modes_gpu_by_its_index(make):
    for own, index in [("cuda", 0), ("cuda:1", 1)]:
        with md.MetaMode(device=own):
            t = make(2, device=index) if make is not torch.tensor else make([1.0, 2.0], device=index)
            named = make(2, device=f"cuda:{index}") if make is not torch.tensor else make([1.0], device=f"cuda:{index}")
        assert t.device == named.device == torch.device("cuda", index)


def test_int_device_the_logical_machine_lacks_is_refused_as_its_name_is():
    for own, other in [("cuda", 1), ("cuda:1", 0)]:
        errors = []
        for device in (other, f"cuda:{other}"):
            with md.MetaMode(device=own), pytest.raises(md.UnsupportedFeatureError) as info:
                torch.empty(2, device=device)
            errors.append(str(info.value))
        assert errors[0] == errors[1]
        assert f"device='cuda:{other}'" in errors[0]


def test_int_device_on_a_logical_world_is_the_ranks_own_gpu():
    with md.MetaMode(device="cuda", world_size=4, rank=2):
        by_int, by_name = torch.zeros(2, device=2), torch.zeros(2, device="cuda:2")
        assert by_int.device == by_name.device == torch.device("cuda:0")
        assert (by_int + by_name).device == by_name.device


def test_int_device_in_tensor_to_and_cuda():
    real = torch.ones(2)
    with md.MetaMode(device="cuda"):
        x = torch.ones(2)
        assert x.to(0).device == x.to("cuda:0").device == x.cuda(0).device == torch.device("cuda:0")
        assert x.to(0) is x  # already there: torch returns the tensor itself
        assert x.to(0, torch.float16).dtype == torch.float16
        assert x.to(device=0).device == torch.device("cuda:0")
        assert real.to(0).device == torch.device("cuda:0")  # a real tensor's stand-in
        assert x.to(torch.float64).dtype == torch.float64  # a dtype is not a device


def test_int_device_in_a_traced_step_is_the_same_program_as_naming_cuda():
    def by_int(x):
        return x + torch.arange(3, device=0, dtype=x.dtype)

    def by_name(x):
        return x + torch.arange(3, device="cuda:0", dtype=x.dtype)

    traces = [md.tracer(device="cuda")(f, torch.ones(3)) for f in (by_int, by_name)]
    assert traces[0].output.device == torch.device("cuda:0")
    assert [c.op for c in traces[0].calls] == [c.op for c in traces[1].calls]


def test_moving_to_the_local_ranks_gpu_on_a_logical_world_is_the_ranks_own():
    """torchrun's ``model.cuda(local_rank)`` / ``x.to(f"cuda:{local_rank}")``: the rank's GPU (it made a cuda:3
    tensor, and ``x.to("cuda:3") + x`` raised a device mismatch), as a factory naming it is."""
    model = torch.nn.Linear(2, 2)
    with md.MetaMode(device="cuda", world_size=4, rank=3):
        x = torch.ones(2)
        moved = [x.to("cuda:3"), x.cuda(3), x.to(3), x.to(device="cuda:3"), x.to("cuda:3", torch.float16)]
        assert {t.device for t in moved} == {torch.device("cuda:0")}
        assert (moved[0] + x).device == torch.device("cuda:0")
        model.cuda(3)
        assert model(x).device == torch.device("cuda:0")


def test_moving_to_a_gpu_the_logical_machine_lacks_is_refused_as_a_factory_is():
    with md.MetaMode(device="cuda"):
        x = torch.ones(2)
        for move in (lambda: x.to("cuda:1"), lambda: x.cuda(1), lambda: x.to(1), lambda: torch.ones(2).to("cuda:1")):
            with pytest.raises(md.UnsupportedFeatureError, match=r"Tensor.to\(..., device='cuda:1'\)"):
                move()
        assert x.to("cuda:0") is x and x.to("cpu").device == torch.device("cpu")
