"""The replay program: the generated code, its freeing, and errors mapped
back to the recorded call."""

from __future__ import annotations

import json
import os
import tempfile

import expecttest
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import metadispatch as md
from metadispatch.binding.leaves import bind_leaves
from metadispatch.execution.program import program
from metadispatch.execution.replay import execute
from tests import hostile_memory
from tests.hostile_doc import base_doc

CPU = torch.device("cpu")


def _rebinding(x):
    y = x.t() @ x
    y = y.relu()  # the product dies here, before the last call
    return y * 2


class TestSource(expecttest.TestCase):
    def test_program_source_is_one_line_per_call_and_check(self):
        t = md.trace(_rebinding, torch.ones(3, 2))
        self.assertExpectedInline(
            program(t, CPU).source,
            """\
def run(env, gens, ck, chk, same, wr, rng, fit, pre):
    grad(True)
    t0 = env.pop(0)
    t1 = t(t0)
    ck and same(0, t1)
    t2 = mm(t1, t0)
    ck and same(1, t2)
    t3 = relu(t2)
    ck and same(2, t3)
    del t2
    t4 = mul(t3, 2)
    ck and same(3, t4)
    env[0] = t0
    env[1] = t1
    env[3] = t3
    env[4] = t4
    return
""",
        )

    def test_program_of_a_file_fences_views_and_value_sized_calls(self):
        doc = hostile_memory.value_sized(base_doc(tempfile.mkdtemp()), "bincount", 3)
        path = os.path.join(tempfile.mkdtemp(), "t.json")
        with open(path, "w") as f:
            json.dump(doc.d, f)
        t = md.Trace.load(path)
        self.assertExpectedInline(
            program(t, CPU, fenced=frozenset([6])).source,
            """\
def run(env, gens, ck, chk, same, wr, rng, fit, pre):
    grad(True)
    t0 = env.pop(0)
    t1 = t(t0)
    fit(0, t1, 1)
    ck and same(0, t1)
    t2 = env.pop(2)
    t3 = env.pop(3)
    t4 = addmm(t2, t3, t1)
    ck and same(1, t4)
    t5 = env.pop(5)
    t6 = add(t4, t5)
    ck and same(2, t6)
    del t4
    t7 = relu(t6)
    ck and same(3, t7)
    t8 = detach(t7)
    fit(4, t8, 1)
    ck and same(4, t8)
    del t6
    t9 = sum(t7)
    ck and same(5, t9)
    del t5
    t10 = env.pop(10)
    pre(6, t10)
    t11 = bincount(t10)
    fit(6, t11, 0)
    ck and same(6, t11)
    env[0] = t0
    env[1] = t1
    env[2] = t2
    env[3] = t3
    env[7] = t7
    env[8] = t8
    env[9] = t9
    env[10] = t10
    env[11] = t11
    return
""",
        )


def _run(t, args, keep_all=False):
    env, mismatches, _ = execute(t, lambda: bind_leaves(t, args, None, None, CPU, 0), CPU, True, keep_all=keep_all)
    return env, mismatches


def test_program_frees_what_the_traced_run_freed_and_keeps_the_output():
    x = torch.randn(3, 2)
    t = md.trace(_rebinding, x)
    product = t.calls[1].output_metas[0].id
    env, mismatches = _run(t, (x,))
    assert mismatches == []
    assert product not in env and t.output_meta.id in env
    torch.testing.assert_close(env[t.output_meta.id], _rebinding(x))


def test_program_keep_all_keeps_every_tensor():
    x = torch.randn(3, 2)
    t = md.trace(lambda x: (x.t() @ x).relu(), x)
    env, _ = _run(t, (x,), keep_all=True)
    assert sorted(env) == sorted({m.id for c in t.calls for m in c.inputs + c.output_metas})
    assert torch.equal(env[t.calls[0].output_metas[0].id], x.t())


def test_program_is_compiled_once_per_trace_and_device():
    t = md.trace(lambda x: x + 1, torch.ones(2))
    assert program(t, CPU) is program(t, CPU)
    assert program(t, CPU, keep_all=True) is not program(t, CPU)


def test_replay_error_names_the_failing_call():
    t = md.trace(lambda x, i: (x * 2)[i], torch.ones(4), torch.tensor([1]))
    with pytest.raises(md.ReplayError) as info:
        md.replay(t, (torch.ones(4), torch.tensor([10])))
    assert info.value.call == 1 and "call #1 " in str(info.value)
    assert "aten.index.Tensor" in str(info.value)
    assert isinstance(info.value.__cause__, IndexError)  # the kernel's own error


def test_replay_wrong_rule_for_a_multi_output_op_is_a_mismatch():
    @md.register_meta(torch.ops.aten.max.dim, override=True)
    def bad_max(x, dim, keepdim=False):
        return x.new_empty(x.shape[0]), x.new_empty(x.shape[0] + 1, dtype=torch.long)

    try:
        t = md.trace(lambda x: torch.max(x, 1), torch.randn(3, 4))
    finally:
        md.unregister_meta(torch.ops.aten.max.dim)
    r = md.replay(t, (torch.randn(3, 4),))
    (m,) = r.mismatches
    assert (m.op, m.output, m.fields) == ("aten.max.dim", 1, ("shape",))


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def _overloads(x, w):
    aten = torch.ops.aten
    y = aten.mul.Scalar(x, 2.0)  # the binding ``mul`` would pick mul.Tensor
    y = aten.add.Scalar(y, 1)
    y = aten.div.Tensor(y, torch.tensor(3.0))  # a 0-dim tensor where a Scalar overload exists
    y = torch.cat([y @ w, y.unsqueeze(0).sum(0)], dim=1).relu()
    return y.sum(dim=0, keepdim=True).t() * 0.5


def test_program_dispatches_exactly_the_recorded_overloads():
    # Note [Calling ops through their Python bindings]: where the generated
    # code calls a binding, the dispatcher sees the recorded overload itself.
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    t = md.trace(_overloads, x, w)
    prog = program(t, CPU)
    assert "= mm(" in prog.source and "mul_Scalar(" in prog.source  # both paths are exercised
    env = bind_leaves(t, (x, w), None, None, CPU, 0)
    log = _Log()
    with torch.no_grad(), log:
        prog.run(env, {}, False, None, None, None, None, None, None)
    assert log.funcs == [c.func for c in t.calls]
    torch.testing.assert_close(env[t.output_meta.id], _overloads(x, w), rtol=0, atol=0)


def _run_both(trace, args, module):
    """The generated program and the reference loop on one trace, from the same leaves."""
    from metadispatch.binding.inputs import check_inputs
    from metadispatch.binding.leaves import bind_leaves
    from metadispatch.execution.replay import execute

    cpu = torch.device("cpu")
    runs = []
    for interpreted in (False, True):
        given = check_inputs(trace, args, None, module)
        env, mismatches, _ = execute(
            trace,
            lambda given=given: bind_leaves(trace, args, None, module, cpu, 0, [], given),
            cpu,
            True,
            keep_all=True,
            interpreted=interpreted,
        )
        runs.append((env, mismatches))
    return runs


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("name", ["mlp", "cnn_batchnorm", "llama", "gpt2", "bert"])
def test_program_computes_what_the_reference_loop_computes(name):
    """Note [The reference loop]: the generated program and the plain loop
    give every id the same tensor, bit for bit, with the same metadata, and
    report the same mismatches (dropout included: the same random streams)."""
    pytest.importorskip("transformers")
    from tests.replay_cases import build

    model, fn, inputs, _ = build(name)
    trace = md.trace(lambda *a: fn(model, *a), *inputs)
    (env, mismatches), (ref_env, ref_mismatches) = _run_both(trace, inputs, model)
    assert env.keys() == ref_env.keys() and len(env) > len(trace.calls) // 2
    for tid, t in env.items():
        r = ref_env[tid]
        assert (t.shape, t.stride(), t.dtype) == (r.shape, r.stride(), r.dtype), tid
        assert _bits(t) == _bits(r), f"${tid} differs"
    assert [str(m) for m in mismatches] == [str(m) for m in ref_mismatches]


def test_program_and_reference_loop_report_the_same_wrong_rule():
    """A rule with wrong metadata is a mismatch in both, at the same call."""

    def wrong(x):
        return torch.empty(x.shape[0] + 1)

    torch.library.define("mdtest_ref::wrong", "(Tensor x) -> Tensor")
    torch.library.impl("mdtest_ref::wrong", "cpu")(lambda x: x.clone())
    md.register_meta("mdtest_ref::wrong")(wrong)
    try:
        trace = md.trace(lambda x: torch.ops.mdtest_ref.wrong(x) * 2, torch.ones(3))
        (_, mismatches), (_, ref_mismatches) = _run_both(trace, (torch.ones(3),), None)
    finally:
        md.unregister_meta("mdtest_ref::wrong")
    assert mismatches and [str(m) for m in mismatches] == [str(m) for m in ref_mismatches]
