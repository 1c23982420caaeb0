"""The value and shape checks replay runs before a loaded trace's calls (trust/value_checks.py, shape_checks.py).

Each case of tests/position_cases.py is written into a trace file as an
attacker would (tests/position_traces.py) and replayed: the legitimate
call bit for bit as eager computes it, every bad variant refused with a
``ReplayError`` naming the call and the argument, before the kernel runs.
Replay runs without a budget here, so that nothing but the check stands
between the file and the kernel.
"""

from __future__ import annotations

import json

import pytest
import torch

import metadispatch as md
from metadispatch.execution.program import program
from metadispatch.trust.index_checks import CHECKS, Refusal, index_check
from metadispatch.trust.positions import CHECKED, position
from tests.hostile_doc import base_doc, user_tensors
from tests.position_cases import CASES, DIRECT
from tests.position_traces import arguments, bitwise, case_doc, eager

_UNLIMITED = md.Budget(bytes=None, flops=None)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_doc(str(tmp_path_factory.mktemp("base")))


def _load(tmp_path, doc) -> md.Trace:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc.d))
    return md.Trace.load(path)


def _id(case) -> str:
    return str(case.op).removeprefix("aten.")


_BAD = [pytest.param(case, bad, id=f"{_id(case)}-{bad[0]}-{k}") for case in CASES for k, bad in enumerate(case.bad)]


@pytest.mark.parametrize("case", CASES, ids=[f"{_id(c)}-{k}" for k, c in enumerate(CASES)])
def test_index_checks_legitimate_call_replays_bit_exactly_as_eager(tmp_path, base, case):
    a = arguments(case)
    r = md.replay(_load(tmp_path, case_doc(base, case, a)), user_tensors(), budget=_UNLIMITED)
    got, want = r.output, eager(case, a)
    if case.outputs is not None:
        got, want = tuple(got)[: case.outputs], tuple(want)[: case.outputs]
    assert r.ok and bitwise(got, want)


@pytest.mark.parametrize("case, bad", _BAD)
def test_index_checks_refuse_a_bad_value_naming_the_argument(tmp_path, base, case, bad):
    named = bad[2] if len(bad) > 2 else bad[0]
    lin, x, y = user_tensors()
    before = [t.detach().clone() for t in (x, y, *lin.parameters())]
    t = _load(tmp_path, case_doc(base, case, arguments(case, bad)))
    with pytest.raises(
        md.ReplayError, match=rf"call #\d+ {str(case.op)} refused before running: its argument '{named}'"
    ):
        md.replay(t, (lin, x, y), budget=_UNLIMITED)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, y, *lin.parameters())))


_FULL = [
    c
    for c in CASES
    if c.op._schema.name.split("::")[1]
    in (
        "max_pool2d_with_indices_backward",
        "max_pool3d_with_indices_backward",
        "adaptive_max_pool2d_backward",
        "adaptive_max_pool3d_backward",
        "embedding_dense_backward",
    )
]


@pytest.mark.parametrize("case", _FULL, ids=_id)
def test_index_checks_refuse_indices_made_in_the_file_by_full(tmp_path, base, case):
    """The issue's finding: indices far out of range from ``aten.full``, not a constant."""
    name = "indices"
    bad = (name, lambda a: torch.full_like(a[name], 1 << 40))
    t = _load(tmp_path, case_doc(base, case, arguments(case, bad), fill=name))
    assert "aten.full.default" in [c.op for c in t.calls]
    with pytest.raises(md.ReplayError, match=rf"argument '{name}' holds 1099511627776"):
        md.replay(t, user_tensors(), budget=_UNLIMITED)


@pytest.mark.parametrize("case", DIRECT, ids=_id)
def test_index_checks_checks_of_ops_no_cpu_replay_runs_refuse_directly(case):
    check = index_check(case.op)
    check(arguments(case))  # the legitimate arguments pass
    for bad in case.bad:
        with pytest.raises(Refusal) as info:
            check(arguments(case, bad))
        assert info.value.arg == (bad[2] if len(bad) > 2 else bad[0])


def test_index_checks_every_check_has_a_case():
    exercised = {index_check(c.op) for c in CASES + DIRECT}
    assert {name for name, fn in CHECKS.items() if fn not in exercised} == set()


def test_index_checks_every_case_is_of_a_checked_op():
    assert [str(c.op) for c in CASES + DIRECT if position(c.op).kind != CHECKED] == []


def test_index_checks_run_for_loaded_traces_only(tmp_path):
    """A trace recorded in this process is trusted as code is: its program checks nothing."""
    x = torch.randn(1, 2, 4, 4)
    out, idx = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    params = ([2, 2], [2, 2], [0, 0], [1, 1], False)
    t = md.trace(lambda g, x, i: torch.ops.aten.max_pool2d_with_indices_backward(g, x, *params, i), out, x, idx)
    cpu = torch.device("cpu")
    assert "pre(" not in program(t, cpu).source
    t.save(tmp_path / "t.json")
    assert "pre(" in program(md.Trace.load(tmp_path / "t.json"), cpu, fenced=frozenset()).source
