"""Hostile trace files, one promise at a time: what loading, printing and the
command line do with a file anyone wrote (docs/trace-format.md, "Threat model").

The corpus (test_hostile.py) checks every attack class at once in a child
process; these name the promise each attack tests, so a failure says which.
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch

import metadispatch as md
from metadispatch.cli.main import main
from tests import hostile_memory
from tests.hostile_doc import Doc, base_doc, ref

_ESC = "\x1b]0;owned\x07\x1b[2J"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_doc(str(tmp_path_factory.mktemp("base")))


def _write(tmp_path, doc, name="t.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc.d if isinstance(doc, Doc) else doc))
    return str(path)


def test_hostile_load_output_naming_an_undefined_tensor_is_refused(tmp_path, base):
    d = Doc(base)
    d.d["output"] = {"t": d.tensor(999, [3])}
    with pytest.raises(md.TraceFormatError, match=r"output: tensor \$999 is used before"):
        md.Trace.load(_write(tmp_path, d))


def test_hostile_load_long_integer_in_a_version_2_file_is_refused_with_its_place(tmp_path, base):
    d = Doc(base)
    d.d["version"], d.d["output"] = 2, 12345
    (tmp_path / "t.json").write_text(json.dumps(d.d).replace("12345", "9" * 5000))
    with pytest.raises(md.TraceFormatError, match=r"an integer of 5000 digits at line 1 column \d+"):
        md.Trace.load(tmp_path / "t.json")


def test_hostile_load_counts_json_values_before_parsing(tmp_path, base):
    text = json.dumps(base).encode()
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(text[:-1] + b', "pad": [' + b"[]," * 200000 + b"[]]}"))
    with pytest.raises(md.TraceFormatError, match="JSON values, more than 100000"):
        md.Trace.load(tmp_path / "t.json.gz", max_values=100000)
    assert len(md.Trace.load(_write(tmp_path, base), max_values=100000)) == len(base["calls"]["op"])


def test_hostile_load_refuses_more_than_64_dimensions(tmp_path, base):
    d = Doc(base)
    d.d["tensors"]["shape"][0] = [1] * 65
    d.d["tensors"]["stride"][0] = [1] * 65
    with pytest.raises(md.TraceFormatError, match=r"tensors.shape\[0\]: 65 dimensions"):
        md.Trace.load(_write(tmp_path, d))


@pytest.mark.parametrize(
    "op,args",
    [
        ("aten._functional_assert_async.msg", lambda z, tok: [z, "boom", tok]),
        ("aten._functional_assert_scalar.default", lambda z, tok: [False, "boom", tok]),
        ("aten._functional_sym_constrain_range.default", lambda z, tok: [1, 2, 3, tok]),
        ("aten._test_warn_in_autograd.default", lambda z, tok: [z]),
    ],
)
def test_hostile_load_refuses_ops_that_exist_to_raise(tmp_path, base, op, args):
    d = Doc(base)
    n = d.next_id()
    tok, z = ref(d.tensor(n, [0])), ref(d.tensor(n + 1, []))
    d.call("aten.empty.memory_format", [[0]], {}, [tok])
    d.call("aten.zeros.default", [[]], {}, [z])
    d.call(op, args(z, tok), {}, [ref(d.tensor(n + 2, [0]))])
    with pytest.raises(md.TraceFormatError, match="exists to raise or warn"):
        md.Trace.load(_write(tmp_path, d))


@pytest.mark.parametrize(
    "field,value",
    [("modules", {_ESC + "fc": 5}), ("grads", {_ESC + "w": 99}), ("rng_cuda", {_ESC: "AAAA"})],
)
def test_hostile_load_errors_escape_keys_from_the_file(tmp_path, base, capsys, field, value):
    d = Doc(base)
    d.d[field] = value
    assert main(["summary", _write(tmp_path, d)]) == 3
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b]0;owned" in err


def test_hostile_load_printing_clips_strings_repeated_on_every_line(tmp_path, base):
    d = Doc(base)
    d.d["calls"]["module"] = [d.s("m" * 65536)] * len(d.d["calls"]["module"])
    d.d["calls"]["note"] = [d.s("n" * 65536)] * len(d.d["calls"]["note"])
    t = md.Trace.load(_write(tmp_path, d))
    assert max(map(len, t.lines())) < 500
    assert "mmm..." in str(t) and "nnn...>" in str(t)


def test_hostile_load_repro_writes_non_finite_floats_inside_containers(tmp_path, base):
    call = md.Trace.load(_write(tmp_path, hostile_memory.complex_nan_argument(base)))[-1]
    out: list = []
    exec(compile(call.repro(), "<repro>", "exec"), {"print": out.append})
    assert out and all(line.startswith("output 0:") for line in out)
    assert "complex(float('nan'), float('inf'))" in call.repro()


def test_hostile_load_effect_ops_load_only_when_allowed(tmp_path, base):
    d = Doc(base)
    d.call("aten._print.default", ["hello"], {}, [])
    path = _write(tmp_path, d)
    with pytest.raises(md.TraceFormatError, match="replay will not run aten._print.default"):
        md.Trace.load(path)
    assert md.Trace.load(path, allow_ops=["aten::_print"])[-1].op == "aten._print.default"


def test_hostile_load_summary_escapes_terminal_codes(tmp_path, base, capsys):
    d = Doc(base)
    d.d["calls"]["module"] = [d.s(_ESC + "fc")] * len(d.d["calls"]["module"])
    d.d["modules"][_ESC + "fc"] = "Linear"
    assert main(["summary", _write(tmp_path, d)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b]0;owned\\x07\\x1b[2Jfc" in out


def test_hostile_load_a_record_function_marker_holding_a_tensor_is_refused(tmp_path):
    # Replay skips a marker (Note [record_function ranges in a trace]), so a
    # tensor a hand-edited one "defines" would reach later calls undefined.
    def step(x):
        with torch.profiler.record_function("r"):
            return x * 2

    md.trace(step, torch.randn(3)).save(tmp_path / "ok.json")
    doc = Doc(json.loads((tmp_path / "ok.json").read_text()))
    assert md.Trace.load(_write(tmp_path, doc, "same.json")).calls[0].op.startswith("profiler.")
    enter = doc.d["ops"].index("profiler._record_function_enter_new.default")
    row = doc.d["calls"]["op"].index(enter)
    doc.d["calls"]["outputs"][row] = [ref(doc.tensor(99, [3]))]
    with pytest.raises(md.TraceFormatError, match="record_function marker and holds no tensors"):
        md.Trace.load(_write(tmp_path, doc, "marker.json"))


# A call without an argument its schema requires loaded, then replay called the op without it
# and raised a raw AttributeError (issue 27).
_MISSING = {
    "index": ("aten.index_select.default", lambda x: [ref(x), 1], {}),
    "indices": (
        "aten.max_pool2d_with_indices_backward.default",
        lambda x: [ref(x), ref(x), [1, 1], [1, 1], [0, 0], [1, 1], False],
        {},
    ),
    "out": ("aten.add.out", lambda x: [ref(x), ref(x)], {}),  # keyword-only
    "other": ("aten.mul.Tensor", lambda x: [], {"self": None}),
}


@pytest.mark.parametrize("arg", list(_MISSING))
def test_hostile_load_refuses_a_call_missing_a_required_argument(tmp_path, base, arg):
    op, args, kwargs = _MISSING[arg]
    d = Doc(base)
    x = d.leaf_index("args[1]")
    kwargs = {k: ref(x) for k in kwargs}
    d.call(op, args(x), kwargs, [ref(d.tensor(d.next_id(), [2, 4]))])
    with pytest.raises(md.TraceFormatError, match=rf"calls.args\[\d+\]: {op} is missing its required argument '{arg}'"):
        md.Trace.load(_write(tmp_path, d))
