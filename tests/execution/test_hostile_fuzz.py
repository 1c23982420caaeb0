"""Random mutations of a valid trace file: load round-trips or refuses, replay is right or refuses.

Hypothesis mutates the document of a small trace (values, types, lengths,
names, nesting, key renames) and the test holds each result to the issue's
promise: loading either round-trips exactly or raises TraceFormatError, and
replay either refuses with a MetaDispatchError or runs to a verdict that is
right -- ``ok`` exactly when an eager run of the same calls on the same
tensors agrees with every record, and every mismatch it reports one that
eager run finds too -- and never changes the caller's tensors.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import metadispatch as md
from metadispatch.binding.leaves import bind_leaves
from metadispatch.ir.decode import DTYPES
from metadispatch.ir.rng import is_generator
from tests import guarded, hostile_doc
from tests.hostile_doc import Doc, ref
from tests.hostile_memory import const
from tests.position_cases import CASES
from tests.position_traces import arguments, bitwise, case_doc

_CPU = torch.device("cpu")
_BUDGET = md.Budget(bytes=1 << 26, flops=10**9)

_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.sampled_from(
        [{"t": 0}, {"t": 3}, {"t": 99}, {"dtype": "onnx"}, {"device": "cuda:1"}, {"int": "12"}, {"float": "nan"}]
    ),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)


def _paths(x, path=()):
    yield path
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, path + (i,))


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    doc = hostile_doc.base_doc(str(tmp_path_factory.mktemp("valid")))
    return doc, sorted(_paths(doc), key=repr)[1:]


def _mutate(doc: dict, paths: list, data) -> None:
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        target = doc
        try:
            for key in path[:-1]:
                target = target[key]
            action = data.draw(st.sampled_from(["replace", "delete", "grow", "rename"]))
            if action == "replace":
                target[path[-1]] = data.draw(_VALUES)
            elif action == "delete" and isinstance(target, dict):
                del target[path[-1]]
            elif action == "rename" and isinstance(target, dict):
                # a key another table uses, a near miss, or anything
                new = data.draw(st.one_of(st.sampled_from(sorted(map(str, target))), st.text(max_size=8)))
                target[new] = target.pop(path[-1])
            elif isinstance(target[path[-1]], list):
                target[path[-1]].append(data.draw(_VALUES))
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed the path
            pass


def _eager_mismatches(trace, leaves: dict, env: dict | None = None) -> set:
    """Calls whose eager result differs from the record (shape, dtype, offset, strides that matter);
    ``env`` receives every tensor the eager run made, by id."""
    env = {} if env is None else env
    env.update({tid: t.clone() for tid, t in leaves.items()})

    def real(a):
        if isinstance(a, md.TensorMeta):
            return env[a.id]
        if type(a) is tuple:
            return [real(x) for x in a]
        return _CPU if isinstance(a, torch.device) else None if is_generator(a) else a

    found = set()
    for call in trace.calls:
        out = call.func(*map(real, call.args), **{k: real(v) for k, v in call.kwargs.items()})
        results = (out,) if len(call.func._schema.returns) == 1 else tuple(out or ())
        for o, r in zip(call.outputs, results):
            for m, t in zip(o, r) if type(o) is tuple else [(o, r)]:
                if not isinstance(m, md.TensorMeta) or (t is None and m.numel == 0):
                    continue
                env[m.id] = t
                strides = [(s, a) for n, s, a in zip(m.shape, m.stride, t.stride()) if n > 1]
                if (tuple(t.shape), t.dtype, t.storage_offset()) != (m.shape, m.dtype, m.storage_offset) or (
                    0 not in m.shape and any(s != a for s, a in strides)
                ):
                    found.add(call.index)
    return found


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_fuzz_mutated_trace_loads_or_refuses_and_replays_right_or_refuses(valid, tmp_path, data):
    doc, paths = valid
    doc = json.loads(json.dumps(doc))
    _mutate(doc, paths, data)
    file = tmp_path / "m.json"
    file.write_text(json.dumps(doc))
    try:
        t = md.Trace.load(file)
    except md.TraceFormatError:
        return
    again = tmp_path / "again.json"
    t.save(again)
    assert str(md.Trace.load(again)) == str(t)  # what loads round-trips exactly
    lin, x, y = hostile_doc.user_tensors()
    originals = [p.detach().clone() for p in (x, y, *lin.parameters())]
    try:
        r = md.replay(t, (lin, x, y), budget=_BUDGET, allow_made_up=True)
    except md.MetaDispatchError:
        r = None
    assert all(torch.equal(a, b) for a, b in zip(originals, (x, y, *lin.parameters())))
    if r is not None:  # it ran: its verdict must be eager's
        with torch.no_grad():
            eager = _eager_mismatches(t, bind_leaves(t, (lin, x, y), None, None, _CPU, 0))
        assert r.ok == (not eager)
        assert {m.index for m in r.mismatches} <= eager


# -- values


_VALUE_CASES = (
    "max_pool2d_with_indices_backward",
    "embedding_dense_backward",
    "_embedding_bag",
    "nll_loss_backward",
    "segment_reduce",
    "_pad_packed_sequence",
    "div",
)


@pytest.fixture(scope="module")
def valued(tmp_path_factory):
    """The base document with a legitimate call of each op of _VALUE_CASES, gather, and max_pool's
    backward again with its indices from ``aten.full``: (document, leaves with values, calls)."""
    d = Doc(hostile_doc.base_doc(str(tmp_path_factory.mktemp("valued"))))
    done: set = set()
    for case in CASES:
        name = case.op._schema.name.split("::")[1]
        if name in _VALUE_CASES and name not in done:
            done.add(name)
            d = case_doc(d.d, case, arguments(case))
    pool = next(c for c in CASES if c.op._schema.name.endswith("max_pool2d_with_indices_backward"))
    d = case_doc(d.d, pool, arguments(pool), fill="indices")
    src, idx = const(d, torch.arange(12.0).reshape(3, 4)), const(d, torch.tensor([[0, 3], [1, 1], [2, 0]]))
    out = d.tensor(d.next_id(), [3, 2])
    d.call("aten.gather.default", [ref(src), 1, ref(idx)], {}, [ref(out)])
    d.d["output"] = ref(out)
    return d.d


def _ints(dtype: str):
    if dtype == "bool":
        return st.booleans()
    if dtype.startswith("float") or dtype.startswith("bfloat"):
        return st.one_of(st.floats(width=32), st.sampled_from([0.0, 1.0, -1.0, 0.5, 1e30]))
    info = torch.iinfo(DTYPES[dtype])
    edges = [0, 1, -1, 2, 3, 7, 15, 16, 1000, -1000, 1 << 31, -(1 << 31), info.max, info.min]
    return st.one_of(st.sampled_from([v for v in edges if info.min <= v <= info.max]), st.integers(info.min, info.max))


def _int_paths(x, path=()):
    """Paths to the (non-bool) integers in a call's arguments."""
    if type(x) is int:
        yield path
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _int_paths(v, path + (i,))


def _mutate_values(doc: dict, data) -> None:
    """Change 1-3 values: a constant's elements, a ``full``'s fill, an integer argument of any call."""
    leaves, calls = doc["leaves"]["value"], doc["calls"]
    consts = [i for i, v in enumerate(leaves) if v is not None]
    ints = [(i, p) for i, args in enumerate(calls["args"]) for p in _int_paths(args)]
    for _ in range(data.draw(st.integers(1, 3))):
        what = data.draw(st.sampled_from(["const", "int"]))
        if what == "const" and consts:
            value = leaves[data.draw(st.sampled_from(consts))]
            dtype = DTYPES[value["dtype"]]
            t = torch.frombuffer(bytearray(base64.b64decode(value["data"])), dtype=dtype).clone()
            if t.numel():
                k = data.draw(st.integers(0, t.numel() - 1))
                t[k] = data.draw(_ints(value["dtype"]))
                value["data"] = base64.b64encode(t.numpy().tobytes()).decode()
        elif ints:
            i, path = data.draw(st.sampled_from(ints))
            target = calls["args"][i]
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = data.draw(
                st.one_of(st.sampled_from([0, -1, 1, 1000, 1 << 40, -(1 << 40), (1 << 63) - 1]), st.integers(-64, 64))
            )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_fuzz_mutated_values_are_refused_or_replay_as_eager(valued, tmp_path, data):
    doc = json.loads(json.dumps(valued))
    _mutate_values(doc, data)
    file = tmp_path / "v.json"
    file.write_text(json.dumps(doc))
    try:
        t = md.Trace.load(file)
    except md.TraceFormatError:
        event("refused at load")
        return
    lin, x, y = hostile_doc.user_tensors()
    originals = [p.detach().clone() for p in (x, y, *lin.parameters())]
    try:
        r = md.replay(t, (lin, x, y), budget=_BUDGET, allow_made_up=True)
    except md.MetaDispatchError as e:
        event(f"refused: {'before running' if 'refused before running' in str(e) else type(e).__name__}")
        r = None
    assert all(torch.equal(a, b) for a, b in zip(originals, (x, y, *lin.parameters())))
    if r is not None:  # it ran: its verdict and its output are eager's
        event("replayed")
        env: dict = {}
        with torch.no_grad():
            eager = _eager_mismatches(t, bind_leaves(t, (lin, x, y), None, None, _CPU, 0), env)
        assert r.ok == (not eager)
        assert bitwise(r.output, env[t.output_meta.id])


@pytest.mark.slow  # a child process importing torch under the guard allocator
def test_hostile_fuzz_runs_under_the_guard_allocator():
    library = guarded.require()
    env = guarded.environment(library, dict(os.environ, PYTHONPATH=os.getcwd()))
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k", "not guard"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert child.returncode == 0, (child.returncode, child.stdout[-3000:], child.stderr[-2000:])
