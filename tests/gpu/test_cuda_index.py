"""torch.cuda's device questions under MetaMode(device="cuda:N") answer the mode's GPU, N.

Note [The logical GPU's index] in gpu/cuda_answers.py.  Without it
``current_device()`` answered 0 under ``cuda:1``, so
``torch.device("cuda", torch.cuda.current_device())`` named a GPU the logical
machine lacks, and ``with torch.cuda.device(1)`` raised "compiled without CUDA".
"""

import re

import pytest
import torch

import metadispatch as md

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the logical machine is the host's")

_QUESTIONS = ("get_device_name", "get_device_capability", "get_device_properties", "mem_get_info")


def _outside():
    out = []
    for f in (torch.cuda.current_device, torch.cuda.device_count, torch.accelerator.current_device_index):
        try:
            out.append(f())
        except (AssertionError, RuntimeError) as e:
            out.append(type(e))
    return out


def test_current_device_is_the_modes_index():
    for own, index in [("cuda", 0), ("cuda:1", 1), ("cuda:3", 3)]:
        with md.MetaMode(device=own):
            assert torch.cuda.current_device() == torch.accelerator.current_device_index() == index
            assert torch.cuda.device_count() == 1
            here = torch.device("cuda", torch.cuda.current_device())
            assert torch.zeros(2, device=here).device == torch.zeros(2).device == here


def test_device_questions_answer_the_modes_index_and_refuse_another():
    profile = md.gpu_profile("h100")
    with md.MetaMode(device="cuda:1", gpu="h100"):
        for name in _QUESTIONS:
            f = getattr(torch.cuda, name)
            assert f(1) == f("cuda:1") == f() == f(torch.device("cuda:1"))
            with pytest.raises(md.UnsupportedFeatureError, match=rf"torch.cuda.{name}\(0\).*'cuda:1'"):
                f(0)
        assert torch.cuda.get_device_name(1) == profile.title
        assert torch.cuda.get_device_properties(1).total_memory == profile.memory
        assert torch.cuda.mem_get_info(1)[1] == profile.memory


def test_set_device_and_device_context_select_the_modes_gpu():
    before = _outside()
    with md.MetaMode(device="cuda:1"):
        torch.cuda.set_device(1)
        torch.cuda.set_device("cuda:1")
        torch.cuda.set_device(-1)  # torch's no-op
        with torch.cuda.device(1):
            assert torch.cuda.current_device() == 1
            assert torch.empty(2, device="cuda").device == torch.device("cuda:1")
        with torch.cuda.device(None):
            assert torch.cuda.current_device() == 1
        with pytest.raises(md.UnsupportedFeatureError, match=r"torch.cuda.set_device\(0\)"):
            torch.cuda.set_device(0)
        with pytest.raises(md.UnsupportedFeatureError, match=r"torch.cuda.device\(0\)"):
            with torch.cuda.device(0):
                pass
        assert torch.cuda.current_device() == 1
    assert _outside() == before


def test_a_logical_worlds_rank_accepts_its_local_rank():
    # torchrun's torch.cuda.set_device(local_rank): every rank's GPU is the mode's (cuda:0)
    with md.MetaMode(device="cuda", world_size=4, rank=2):
        torch.cuda.set_device(2)
        with torch.cuda.device(2):
            assert torch.empty(1, device="cuda").device == torch.device("cuda:0")
        assert torch.cuda.get_device_name(2) == torch.cuda.get_device_name()


def test_answers_are_restored_on_exit_and_on_an_exception():
    before = _outside()
    with pytest.raises(ZeroDivisionError):
        with md.MetaMode(device="cuda:2"):
            assert torch.cuda.current_device() == 2
            raise ZeroDivisionError
    assert _outside() == before
    with md.MetaMode(device="cuda"):  # a later mode answers its own index, not the last one's
        assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("world", [None, 2])
def test_set_device_returns_none_and_refuses_a_non_cuda_device_as_eager(world):
    # eager: set_device returns None (it answered 0 for index 0, the index itself `and None`), and a
    # cpu or meta device is a ValueError before any index is read -- in a logical world too
    kinds = ["cpu", torch.device("cpu"), "meta"]
    eager = []
    for d in kinds:
        with pytest.raises(ValueError, match="Expected a cuda device") as e:
            torch.cuda.set_device(d)
        eager.append(type(e.value))
    with md.MetaMode(device="cuda", world_size=world):
        assert torch.cuda.set_device(0) is None and torch.accelerator.set_device_index(0) is None
        assert torch.cuda.set_device(torch.cuda.device(0)) is None
        for d, kind in zip(kinds, eager, strict=True):
            for f in (torch.cuda.set_device, torch.cuda.get_device_name, torch.cuda.mem_get_info):
                with pytest.raises(kind, match=rf"torch.cuda.\w+\({re.escape(repr(d))}\).*expected a cuda device"):
                    f(d)
