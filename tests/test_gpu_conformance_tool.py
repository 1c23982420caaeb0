"""tools/gpu_conformance.py needs a GPU to mean anything; here its checks run
with the CPU standing in for the GPU (``DEVICE = "cpu"``, the allocator's
counters stubbed), so that a change to metadispatch that breaks the tool
shows up in CI and not on the next lent GPU."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_conformance as tool  # noqa: E402

import metadispatch as md  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(tool, "DEVICE", "cpu")
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 0)


@pytest.mark.parametrize("name", ["nn.mha", "opt.resnet18_sgd"])
def test_gpu_conformance_tool_checks_a_step_against_its_real_run(on_cpu, name):
    if name.startswith("opt.resnet") and tool.importlib_missing("torchvision"):
        pytest.skip("torchvision not installed")
    row = tool.check(name, md.gpu_profile("h100"))
    assert (row["traces"], row["ops"], row["meta"], row["flops"], row["replay"]) == ("yes",) * 5, row
    assert row["replay_equals_eager"] == "yes", row
    assert "| yes | yes | yes | yes |" in tool.table([row])


def test_gpu_conformance_tool_reports_the_first_difference(on_cpu):
    real = [md.testing.Call("aten.mm.default", (((2, 2), torch.float32, (2, 1), 0, torch.device("cpu")),))]
    traced = [md.testing.Call("aten.bmm.default", real[0].outputs)]
    assert tool._first_difference(real, traced).startswith("#0: real aten.mm.default")
    assert tool._op_diff(real, traced) == [["replace", 0, ["aten.mm.default"], 0, ["aten.bmm.default"]]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a host without CUDA")
def test_this_gpu_profile_without_a_gpu_says_so():
    with pytest.raises(md.MetaDispatchError, match="no CUDA device"):
        md.testing.this_gpu_profile()
