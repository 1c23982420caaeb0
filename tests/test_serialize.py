"""Trace.save / Trace.load: round trips, and every bad file refused."""

from __future__ import annotations

import gzip
import json
import pickle

import pytest
import torch

import metadispatch as md
from tests.replay_cases import build


@pytest.fixture(scope="module")
def llama_trace():
    model, fn, inputs, _ = build("llama")
    return model, inputs, md.trace(fn, model, *inputs)


def _traces():
    yield "mlp", md.trace(lambda m, x: m(x).sum(), build("mlp")[0], torch.randn(2, 6))
    yield "cuda", md.tracer(device="cuda")(lambda x: torch.cat([x, x.flip(0)]).softmax(-1),
                                            torch.randn(2, 3))
    yield "odd_values", md.trace(
        lambda x: (x.masked_fill(x > 0, float("-inf")).to(memory_format=torch.channels_last),
                   torch.full((2,), float("nan")), torch.tensor([1.0, 2.0]) * x.sum()),
        torch.randn(1, 2, 3, 3))


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
@pytest.mark.parametrize("name,trace", list(_traces()), ids=lambda v: v if isinstance(v, str) else "")
def test_serialize_round_trip_prints_identically(tmp_path, name, trace, suffix):
    path = tmp_path / f"t{suffix}"
    trace.save(path)
    loaded = md.Trace.load(path)
    assert str(loaded) == str(trace)
    assert loaded.output_meta == trace.output_meta


def test_serialize_gz_is_gzip(tmp_path, llama_trace):
    llama_trace[2].save(tmp_path / "t.json.gz")
    assert (tmp_path / "t.json.gz").read_bytes()[:2] == b"\x1f\x8b"


def test_serialize_round_trip_replays_identically(tmp_path, llama_trace):
    model, inputs, t = llama_trace
    t.save(tmp_path / "t.json.gz")
    a = md.replay(t, (model, *inputs))
    b = md.replay(md.Trace.load(tmp_path / "t.json.gz"), (model, *inputs))
    assert b.ok and torch.equal(a.output, b.output)
    assert sorted(a.grads) == sorted(b.grads)
    assert all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads)


def test_serialize_keeps_constants_and_rng_state(tmp_path):
    t = md.trace(lambda x: x * torch.tensor([3.0, -1.5]), torch.ones(2))
    t.save(tmp_path / "t.json")
    loaded = md.Trace.load(tmp_path / "t.json")
    (const,) = [leaf for leaf in loaded.leaves.values() if leaf.kind == "const"]
    assert torch.equal(const.value, torch.tensor([3.0, -1.5]))
    assert torch.equal(loaded.rng_state, t.rng_state)


# -- bad files

@pytest.fixture(scope="module")
def good_doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "t.json"
    md.trace(lambda x: (x @ x.T).relu(), torch.ones(2, 3)).save(path)
    return json.loads(path.read_text())


def _edit(doc, path, value):
    doc = json.loads(json.dumps(doc))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


_BAD_DOCS = {
    "unknown version": (lambda d: _edit(d, ["version"], 99), "unknown format version 99"),
    "not a trace": (lambda d: {"hello": "world"}, "not a trace"),
    "a JSON list": (lambda d: [1, 2, 3], "not a trace"),
    "unknown op": (lambda d: _edit(d, ["calls", 1, "op"], "aten.no_such_op.default"),
                   "calls[1].op: unknown op 'aten.no_such_op.default'"),
    "python in op": (lambda d: _edit(d, ["calls", 0, "op"], "__import__('os').system('x')"),
                     "calls[0].op: unknown op"),
    "negative size": (lambda d: _edit(d, ["leaves", 0, "meta", "tensor", 1], [2, -3]),
                      "leaves[0].meta: negative size in [2, -3]"),
    "negative offset": (lambda d: _edit(d, ["calls", 0, "outputs", 0, "tensor", 4], -1),
                        "calls[0].outputs[0] storage offset"),
    "unknown dtype": (lambda d: _edit(d, ["leaves", 0, "meta", "tensor", 2], "float99"),
                      "unknown dtype 'float99'"),
    "undefined id": (lambda d: _edit(d, ["calls", 1, "args", 0, "tensor", 0], 42),
                     "calls[1].args[0]: tensor $42 is used before"),
    "bad phase": (lambda d: _edit(d, ["calls", 2, "phase"], "sideways"), "calls[2].phase"),
    "unknown tag": (lambda d: _edit(d, ["calls", 0, "args", 0], {"pickle": "gASV"}),
                    "calls[0].args[0]: unknown tag 'pickle'"),
    "too many args": (lambda d: _edit(d, ["calls", 2, "args"], [None] * 9), "do not fit the schema"),
}


@pytest.mark.parametrize("case", list(_BAD_DOCS))
def test_serialize_bad_document_raises_trace_format_error(tmp_path, good_doc, case):
    make, message = _BAD_DOCS[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(make(good_doc)))
    with pytest.raises(md.TraceFormatError) as info:
        md.Trace.load(path)
    assert message in str(info.value) and "bad.json" in str(info.value)


_BAD_BYTES = {
    "empty": (b"", "the file is empty"),
    "truncated json": (None, "not valid JSON"),
    "truncated gzip": (None, "broken gzip data"),
    "binary": (b"\x00\xffPK\x03\x04", "not UTF-8 JSON"),
    "nan constant": (b'{"format": NaN}', "non-standard JSON constant NaN"),
}


@pytest.mark.parametrize("case", list(_BAD_BYTES))
def test_serialize_bad_bytes_raise_trace_format_error(tmp_path, good_doc, case):
    data, message = _BAD_BYTES[case]
    full = json.dumps(good_doc).encode()
    if case == "truncated json":
        data = full[: len(full) // 2]
    elif case == "truncated gzip":
        data = gzip.compress(full)[:-20]
    path = tmp_path / "bad.json"
    path.write_bytes(data)
    with pytest.raises(md.TraceFormatError, match=message):
        md.Trace.load(path)


class _Payload:
    """Unpickling this would create ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_serialize_pickle_file_is_refused_and_not_run(tmp_path):
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.json"
    path.write_bytes(pickle.dumps(_Payload(sentinel)))
    with pytest.raises(md.TraceFormatError):
        md.Trace.load(path)
    assert not sentinel.exists()


def test_serialize_code_in_strings_is_never_run(tmp_path, good_doc):
    sentinel = tmp_path / "pwned"
    code = f"open({str(sentinel)!r}, 'w')"
    doc = _edit(good_doc, ["calls", 0, "args", 1], code)  # a plain string argument
    doc = _edit(doc, ["calls", 0, "module"], code)
    doc = _edit(doc, ["leaves", 0, "name"], code)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    t = md.Trace.load(path)
    assert code in str(t) and not sentinel.exists()


def test_serialize_keeps_storage_deaths_so_memory_agrees(tmp_path, llama_trace):
    t = llama_trace[2]
    t.save(tmp_path / "t.json")
    loaded = md.Trace.load(tmp_path / "t.json")
    assert loaded.deaths == t.deaths and loaded.deaths
    assert md.memory(loaded).peak == md.memory(t).peak
