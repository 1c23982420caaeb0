"""Hostile trace files, one promise of replay at a time (docs/trace-format.md, "Threat model").

Each test builds one attack of tests/hostile_memory.py, loads it and
replays it against the caller's tensors: what replay runs stays inside the
memory it holds, never writes the caller's tensors, and stays within its
budget.  The corpus (test_hostile.py) runs the same files, with the
memory-unsafe ones, in a child process first.
"""

from __future__ import annotations

import json

import pytest
import torch

import metadispatch as md
from metadispatch.binding.writes import written_leaves
from metadispatch.trust.costs import CALL_WORK
from tests import hostile_memory as attacks
from tests.hostile_doc import Doc, base_doc, ref, user_tensors

_UNLIMITED = md.Budget(bytes=None, flops=None)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_doc(str(tmp_path_factory.mktemp("base")))


def _load(tmp_path, doc: Doc) -> md.Trace:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc.d))
    return md.Trace.load(path)


def _callers():
    lin, x, y = user_tensors()
    tensors = (x, y, *lin.parameters())
    return (lin, x, y), tensors, [(t.detach().clone(), t.untyped_storage().data_ptr()) for t in tensors]


def _unchanged(tensors, before) -> bool:
    return all(torch.equal(t, v) and t.untyped_storage().data_ptr() == p for t, (v, p) in zip(tensors, before))


# -- memory: nothing reads or writes outside what replay holds


@pytest.mark.parametrize("index", [6, 1 << 30])
def test_hostile_replay_refuses_sparse_tensors_before_running_anything(tmp_path, base, index):
    with pytest.raises(md.ReplayError, match=r"_sparse_coo_tensor_with_dims_and_tensors.*belongs to sparse tensors"):
        md.replay(_load(tmp_path, attacks.sparse_into_dense(base, index)))


def test_hostile_replay_sparse_tensor_over_the_callers_values_never_writes_them(tmp_path, base):
    args, tensors, before = _callers()
    with pytest.raises(md.ReplayError, match="sparse_coo"):
        md.replay(_load(tmp_path, attacks.sparse_over_caller(base)), args)
    assert _unchanged(tensors, before)


def test_hostile_replay_refuses_a_view_past_its_storage_before_anything_reads_it(tmp_path, base):
    with pytest.raises(md.ReplayError, match=r"call #\d+ aten._reshape_alias.default returned a view .* beyond"):
        md.replay(_load(tmp_path, attacks.reshape_alias_past_storage(base, write=False)), allow_made_up=True)


# -- the caller's tensors: written only where the schema or _UNANNOTATED_WRITES says, and then copies


@pytest.mark.parametrize("op", list(attacks.NORMS))
def test_hostile_replay_norms_update_copies_of_the_callers_statistics(tmp_path, base, op):
    args, tensors, before = _callers()
    # Without limits: batch_norm_update_stats has no meta kernel to size it by.
    r = md.replay(_load(tmp_path, attacks.norm_on_callers_statistics(base, op)), args, budget=_UNLIMITED)
    assert r.ok and _unchanged(tensors, before)


@pytest.mark.parametrize("build", [attacks.set_growing_callers_storage, attacks.set_data_then_write])
def test_hostile_replay_set_never_grows_or_writes_the_callers_storage(tmp_path, base, build):
    args, tensors, before = _callers()
    md.replay(_load(tmp_path, build(base)), args)
    assert _unchanged(tensors, before)
    assert args[2].untyped_storage().nbytes() == 16


def test_hostile_replay_written_leaves_follow_set_to_its_source(tmp_path, base):
    d = attacks.chained_set(base, 3)
    z = d.d["calls"]["outputs"][-1][0]
    d.call("aten.add_.Tensor", [z, 1], {}, [z])
    t = _load(tmp_path, d)
    assert max(t.leaves) in written_leaves(t)


def test_hostile_replay_set_then_write_replays_like_eager_and_keeps_the_callers_tensor():
    def f(y):
        z = torch.empty(0)
        z.set_(y)
        return z.add_(1) * 2

    y = torch.randn(3)
    expected = f(y.clone())
    t = md.trace(f, y)
    before = y.clone()
    r = md.replay(t, (y,))
    assert r.ok and torch.equal(r.output, expected)
    assert torch.equal(y, before)


# -- sizes replay cannot take from the file


@pytest.mark.parametrize("op", ["bincount", "repeat_interleave"])
def test_hostile_replay_refuses_sizes_read_from_values_beyond_the_record(tmp_path, base, op):
    t = _load(tmp_path, attacks.value_sized(base, op, 20_000_000))
    with pytest.raises(md.ReplayError, match="would allocate 160000000 bytes from its inputs' values"):
        md.replay(t, allow_made_up=True)
    assert md.replay(_load(tmp_path, attacks.value_sized(base, op, 1)), allow_made_up=True).ok


def test_hostile_replay_refuses_more_list_outputs_than_recorded_before_building_them(tmp_path, base):
    with pytest.raises(md.ReplayError, match="aten.unbind.int would return 4194304 tensors; the trace records 1"):
        md.replay(_load(tmp_path, attacks.unbind_rows(base, 1 << 22)), allow_made_up=True)


def test_hostile_replay_refuses_a_data_dependent_result_unlike_its_record(tmp_path, base):
    with pytest.raises(md.ReplayError, match=r"aten.nonzero.default returned torch.int64\[3, 1\] where the trace"):
        md.replay(_load(tmp_path, attacks.data_dependent_lie(base)), allow_made_up=True)


def test_hostile_replay_runs_a_call_it_cannot_size_only_without_a_budget(tmp_path, base):
    t = _load(tmp_path, attacks.no_meta_kernel(base))
    args, _, _ = _callers()
    with pytest.raises(md.ReplayError, match="aten._add_relu.Scalar: replay cannot tell .* no meta kernel"):
        md.replay(t, args)
    assert md.replay(t, args, budget=md.Budget(bytes=None, flops=None)).ok


# -- budgets: what replay really does


def test_hostile_replay_budget_counts_the_elements_a_call_reads(tmp_path, base):
    t = _load(tmp_path, attacks.zero_stride_reduction(base, "sum", 1 << 62))
    with pytest.raises(md.BudgetExceededError, match="aten.sum.default") as info:
        md.replay(t, allow_made_up=True)
    assert info.value.need > 1 << 62  # elements read, or the bytes of a copy of them


def test_hostile_replay_budget_counts_a_kernels_copy_of_overlapping_elements(tmp_path, base):
    t = _load(tmp_path, attacks.zero_stride_reduction(base, "median", 10_000_000))
    with pytest.raises(md.BudgetExceededError, match="aten.median.default") as info:
        md.replay(t, allow_made_up=True, budget=md.Budget(bytes=16 << 20, flops=None))
    assert info.value.what == "bytes" and info.value.need > 4 * 10_000_000


def test_hostile_replay_budget_counts_a_matrix_power_by_its_exponent(tmp_path, base):
    t = _load(tmp_path, attacks.matrix_power(base, 64, (1 << 62) - 1))
    with pytest.raises(md.BudgetExceededError, match="aten.matrix_power.default"):
        md.replay(t, allow_made_up=True, budget=md.Budget(bytes=None, flops=10**7))
    assert md.replay(_load(tmp_path, attacks.matrix_power(base, 64, 3)), allow_made_up=True).ok


def test_hostile_replay_budget_counts_every_call_before_walking_them(tmp_path, base):
    t = _load(tmp_path, attacks.many_calls(base, 2000))
    with pytest.raises(md.BudgetExceededError, match=f"replay's own work for its {len(t)} calls") as info:
        md.replay(t, allow_made_up=True, budget=md.Budget(bytes=None, flops=2000 * CALL_WORK))
    assert info.value.call == -1
    assert md.replay(t, allow_made_up=True).ok


def test_hostile_replay_budget_names_the_call_that_crosses_it():
    x = torch.randn(256, 256)
    t = md.trace(lambda x: (x @ x).relu() @ x, x)
    mm = [c.index for c in t.calls if c.op == "aten.mm.default"]
    # The first product by its formula, relu by the elements it reads and
    # writes, each with replay's own cost per call (Note [Budgets]).
    flops = (2 * 256**3 + CALL_WORK) + (2 * 256 * 256 + CALL_WORK)
    with pytest.raises(md.BudgetExceededError) as info:
        md.replay(t, (x,), budget=md.Budget(bytes=None, flops=flops))
    assert info.value.call == mm[1] and info.value.what == "flops"
    assert f"call #{mm[1]} aten.mm.default" in str(info.value)
    assert md.replay(t, (x,), budget=md.Budget(bytes=None, flops=2 * flops)).ok


def test_hostile_replay_loaded_trace_budget_counts_real_sizes_not_recorded_ones(tmp_path):
    t = md.trace(lambda x: torch.zeros(1000) + x.sum(), torch.ones(2))
    t.save(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    doc["calls"]["args"][0][0] = [1 << 30]  # zeros([2**30]), still recorded as f32[1000]
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(md.BudgetExceededError, match="call #0 aten.zeros.default"):
        md.replay(md.Trace.load(tmp_path / "t.json"), budget=md.Budget(bytes=1 << 20, flops=None))


def test_hostile_replay_sizes_a_view_that_copies(tmp_path, base):
    """``contiguous`` of an expanded tensor returns ``Tensor(a)`` by its schema and a copy in fact."""
    d = Doc(base)
    e = attacks.made_up(d, [1 << 30], [0])
    d.call("aten.contiguous.default", [ref(e)], {}, [ref(d.tensor(d.next_id(), [1 << 30]))])
    with pytest.raises(md.BudgetExceededError, match="aten.contiguous.default") as info:
        md.replay(_load(tmp_path, d), allow_made_up=True, budget=md.Budget(bytes=1 << 30, flops=None))
    assert info.value.what == "bytes"
