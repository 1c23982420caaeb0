"""``F.one_hot`` runs its real-tensor branch, checks included (Note [one_hot's checks])."""

import gzip

import pytest
import torch
import torch.nn.functional as F

import metadispatch as md
from tests.eager_ops import EagerOps

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real CUDA device")


def _one_hot(x, n):
    return F.one_hot(x, n)


def _eager(x, n):
    """(ops, output or the error eager raises)."""
    with EagerOps() as log:
        try:
            out = _one_hot(x, n)
        except RuntimeError as e:
            return log.ops, str(e)
    return log.ops, out


# (classes, num_classes): in range, a class too large, a negative one, no
# class count, no classes, a count of zero
_CASES = {
    "in_range": (torch.tensor([[0, 3], [2, 1]]), 4),
    "too_large": (torch.tensor([0, 1, 5]), 4),
    "negative": (torch.tensor([0, -1, 2]), 4),
    "both_ends": (torch.tensor([-2, 9]), 4),
    "count_zero": (torch.tensor([1]), 0),
    "empty": (torch.tensor([], dtype=torch.long), 3),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_one_hot_replay_answers_as_eager_on_the_cpu(case):
    x, n = _CASES[case]
    _, expected = _eager(x, n)
    trace = md.trace(_one_hot, x, n)
    if isinstance(expected, str):
        with pytest.raises(md.ReplayError, match=expected):
            md.replay(trace, (x, n))
    else:
        result = md.replay(trace, (x, n))
        assert result.ok
        assert torch.equal(result.output, expected)


@pytest.mark.parametrize("case", ["in_range", "empty"])
def test_one_hot_records_eagers_ops_with_its_reads_as_asserts(case):
    x, n = _CASES[case]
    eager_ops, _ = _eager(x, n)
    traced = [c.op for c in md.trace(_one_hot, x, n).calls]
    # eager's two item() reads of aminmax become the comparison and its assert
    checks = ["aten.ge.Scalar", "aten._assert_async.msg", "aten.lt.Scalar", "aten._assert_async.msg"]
    assert [op for op in traced if op not in checks] == [op for op in eager_ops if "_local_scalar_dense" not in op]
    assert eager_ops.count("aten._local_scalar_dense.default") == (2 if x.numel() else 0)
    assert traced.count("aten._assert_async.msg") == (2 if x.numel() else 0)


@pytest.mark.parametrize("case", ["too_large", "negative", "count_zero"])
def test_one_hot_of_known_classes_raises_while_tracing_as_eager(case):
    values, n = _CASES[case]
    _, expected = _eager(values, n)

    def step():
        return F.one_hot(torch.tensor(values.tolist()), n)  # a literal: a known value

    with pytest.raises(RuntimeError, match=expected):
        md.trace(step)


def test_one_hot_check_stops_where_eager_raises_naming_the_users_line():
    report = md.check(_one_hot, torch.tensor([0, 1, 5]), 4)
    assert not report.ok
    assert "Class values must be smaller than num_classes." in str(report)
    assert "test_one_hot.py" in str(report)


def test_one_hot_without_a_class_count_reads_the_largest_class():
    with pytest.raises(md.DataDependentError, match="_local_scalar_dense"):
        md.trace(_one_hot, torch.tensor([0, 2]), -1)
    assert tuple(md.trace(lambda: F.one_hot(torch.tensor([0, 2]))).output.shape) == (2, 3)


def test_one_hot_on_a_logical_gpu_scatters_as_cudas_branch_and_replay_refuses_a_bad_class():
    # Onehot.cpp's non-CPU branch: no value read, zeros and scatter_
    x = torch.tensor([0, 1, 5])
    trace = md.tracer("cuda")(_one_hot, x, 4)
    assert [c.op for c in trace.calls] == ["aten.zeros.default", "aten.unsqueeze.default", "aten.scatter_.value"]
    with pytest.raises(md.ReplayError, match="out of bounds"):
        md.replay(trace, (x, 4), device="cpu")
    with pytest.raises(RuntimeError, match="num_classes should be positive"):
        md.tracer("cuda")(_one_hot, x, 0)


def test_one_hot_without_a_mode_answers_as_inside_one():
    x = md.to_meta(torch.tensor([0, 1, 2]))
    alone = F.one_hot(x, 5)
    with md.MetaMode():
        inside = F.one_hot(x, 5)
    assert type(alone) is type(inside) is md.MetaTensor
    assert (alone.shape, alone.stride(), alone.dtype) == (inside.shape, inside.stride(), inside.dtype)
    assert (alone.shape, alone.dtype) == (torch.Size([3, 5]), torch.long)


@requires_cuda
def test_one_hot_on_a_logical_gpu_records_what_real_cuda_dispatches():
    x = torch.tensor([[0, 3], [2, 1]])
    eager_ops, expected = _eager(x.cuda(), 4)
    trace = md.tracer("cuda")(_one_hot, x, 4)
    assert [c.op for c in trace.calls] == eager_ops
    result = md.replay(trace, (x.cuda(), 4))
    assert result.ok and torch.equal(result.output, expected)


@pytest.mark.parametrize("case", ["in_range", "too_large"])
def test_one_hot_trace_saved_and_loaded_replays_as_eager(case, tmp_path):
    x, n = _CASES[case]
    _, expected = _eager(x, n)
    path = tmp_path / "one_hot.json.gz"
    md.trace(_one_hot, x, n).save(path)
    loaded = md.Trace.load(path)  # Note [Checks a trace records]: eager's messages load
    if isinstance(expected, str):
        with pytest.raises(md.ReplayError, match=expected):
            md.replay(loaded, (x, n))
    else:
        assert torch.equal(md.replay(loaded, (x, n)).output, expected)


def test_one_hot_a_file_cannot_choose_the_asserts_message(tmp_path):
    path = tmp_path / "one_hot.json.gz"
    md.trace(_one_hot, torch.tensor([0, 1]), 4).save(path)
    with gzip.open(path, "rt") as f:
        text = f.read()
    assert "Class values must be non-negative." in text
    with gzip.open(path, "wt") as f:
        f.write(text.replace("Class values must be non-negative.", "\\u001b[2Jboom"))
    with pytest.raises(md.TraceFormatError, match="_assert_async.msg with these arguments"):
        md.Trace.load(path)
