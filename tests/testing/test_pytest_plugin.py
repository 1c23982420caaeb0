"""The pytest plugin, used the way a project would: a test file run by pytest.

Each test writes a test file into a temporary folder and runs pytest on it
in a subprocess.  The plugin is active through its entry point once
metadispatch is installed; from a source checkout it is loaded with ``-p``.
"""

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

USES_FIXTURE_AND_MARKER = """
import pytest
import torch

import metadispatch as md


@pytest.mark.metadispatch(device="cuda")
def test_marker_sets_device(meta_mode):
    y = torch.nn.Linear(4, 2)(torch.empty(3, 4))
    assert isinstance(y, md.MetaTensor) and y.device == torch.device("cuda", 0)
    assert [c.op for c in meta_mode.trace][-1] == "aten.addmm.default"


@pytest.mark.parametrize("meta_mode", ["cpu", "cuda:1"], indirect=True)
def test_indirect_parameter_sets_device(meta_mode):
    assert torch.empty(2).device == meta_mode.device


def test_mode_ends_with_the_test():
    assert type(torch.empty(2)) is torch.Tensor
"""

GOLDEN = '''

@pytest.mark.metadispatch(device="cuda")
def test_golden(meta_mode, expect_trace):
    torch.nn.functional.relu(torch.empty(3, 4) @ torch.empty(4, 2))
    expect_trace(meta_mode, """""")
'''


def _plugin_args() -> list:
    installed = any(ep.value == "metadispatch_pytest" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "metadispatch_pytest"]


def _pytest(folder: Path, *, accept: bool = False, only_ours: bool = False) -> subprocess.CompletedProcess:
    """pytest on ``folder``, as a project runs it; ``only_ours``: with this
    plugin alone, not every plugin installed here (xdist, hypothesis: ~1.5 s
    of CPU a run that the fixture and marker tests do not need)."""
    env = {k: v for k, v in os.environ.items() if k not in ("EXPECTTEST_ACCEPT", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if accept:
        env["EXPECTTEST_ACCEPT"] = "1"
    if only_ours:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "--strict-markers",
        "-p",
        "no:cacheprovider",
        *(["-p", "metadispatch_pytest"] if only_ours else _plugin_args()),
        str(folder),
    ]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def _write(folder: Path, source: str) -> Path:
    (folder / "pytest.ini").write_text("[pytest]\n")  # keep pytest from looking further up
    path = folder / "test_user.py"
    path.write_text(textwrap.dedent(source))
    return path


@pytest.mark.slow
def test_pytest_plugin_fixture_marker_and_golden_trace(tmp_path):
    # One file, three runs (each run imports torch, so they are few):
    # the golden string starts empty and fails, EXPECTTEST_ACCEPT=1 fills
    # it in, and then it passes as written.
    path = _write(tmp_path, USES_FIXTURE_AND_MARKER + GOLDEN)

    first = _pytest(tmp_path, only_ours=True)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "1 failed, 4 passed" in first.stdout and "EXPECTTEST_ACCEPT=1" in first.stdout

    accepted = _pytest(tmp_path, accept=True, only_ours=True)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    source = path.read_text()
    assert 'expect_trace(meta_mode, """\\\n' in source
    assert (
        "\n".join(
            [
                "$0: f32[3, 4]@cuda:0 = aten.empty.memory_format([3, 4], device='cuda:0')",
                "$1: f32[4, 2]@cuda:0 = aten.empty.memory_format([4, 2], device='cuda:0')",
                "$2: f32[3, 2]@cuda:0 = aten.mm.default($0, $1)",
                "$3: f32[3, 2]@cuda:0 = aten.relu.default($2)",
                '""")',
            ]
        )
        in source
    )

    again = _pytest(tmp_path, only_ours=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "5 passed" in again.stdout


TORCH_FREE = """
import sys

import pytest


def test_nothing_heavy_is_imported():
    assert [m for m in ("torch", "metadispatch") if m in sys.modules] == []


@pytest.mark.metadispatch(device="cuda")
def test_the_marker_alone_imports_nothing_either():
    assert [m for m in ("torch", "metadispatch") if m in sys.modules] == []
"""

USES_FIXTURE = """
import sys


def test_fixture_imports_on_first_use(meta_mode):
    assert "metadispatch" in sys.modules and "torch" in sys.modules
"""


def test_pytest_plugin_loading_imports_neither_torch_nor_metadispatch(tmp_path):
    # A torch-free project's suite, run with the plugin loaded (the entry
    # point, or -p from a checkout): the plugin must cost it nothing.
    _write(tmp_path, TORCH_FREE)
    result = _pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_pytest_plugin_fixture_imports_metadispatch_when_used(tmp_path):
    _write(tmp_path, USES_FIXTURE)
    result = _pytest(tmp_path, only_ours=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
