"""The guard-page allocator of the memory tests (tests/guarded.py, tests/pageguard.c) sees what it must.

Every memory test that runs a child under it trusts that a read or write
outside a tensor kills the child; these show it on torch tensors, with a
child that touches memory next to a tensor through ``ctypes`` -- as a kernel
following a bad index would.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests import guarded

_TOUCH = """
import ctypes, torch
x = torch.zeros({n}, dtype=torch.uint8)
ptr = x.data_ptr() + ({offset})
{action}
del x
print("survived", flush=True)
"""
_READ = "ctypes.string_at(ptr, 1)"
_WRITE = "ctypes.memset(ptr, 7, 1)"


def _run(env, n: int, offset: int, action: str):
    code = _TOUCH.format(n=n, offset=offset, action=action)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow  # starts Python with torch, twice
@pytest.mark.parametrize("action", [_READ, _WRITE], ids=["read", "write"])
def test_guarded_one_byte_past_a_tensor_kills_the_child(action):
    library = guarded.require()
    assert "survived" in _run(None, 5, 5, action).stdout  # without the guard it goes unseen
    child = _run(guarded.environment(library), 5, 5, action)
    assert child.returncode == -signal.SIGSEGV and "survived" not in child.stdout


@pytest.mark.slow  # starts Python with torch
def test_guarded_one_byte_before_a_tensor_kills_the_child_below():
    child = _run(guarded.environment(guarded.require(), below=True), 5, -1, _READ)
    assert child.returncode == -signal.SIGSEGV


@pytest.mark.slow  # starts Python with torch
def test_guarded_a_write_into_the_alignment_slack_aborts_when_freed():
    child = _run(guarded.environment(guarded.require(), exact=False), 5, 5, _WRITE)
    assert child.returncode == -signal.SIGABRT and "pageguard: write past the end of a block of 5 bytes" in child.stderr


@pytest.mark.slow  # starts Python with torch
def test_guarded_a_legitimate_model_step_runs():
    code = (
        "import torch; torch.nn.Conv2d(3, 4, 3)(torch.randn(2, 3, 8, 8)).sum().backward(); "
        "torch.nn.LSTM(6, 5)(torch.randn(4, 2, 6))[0].sum().backward(); print('ok')"
    )
    env = guarded.environment(guarded.require())
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout == "ok\n"


def test_guarded_without_a_compiler_the_tests_skip_saying_why(monkeypatch):
    monkeypatch.setattr(guarded.shutil, "which", lambda name: None)
    path, why = guarded.preload()
    assert path is None and "no C compiler" in why and "apt-get install gcc" in why
