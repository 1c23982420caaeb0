"""Perfetto/Chrome-trace JSON and the memory plot."""

import json

import pytest
import torch

import metadispatch as md
from metadispatch.analysis.export import chrome_trace, save_perfetto, save_plot
from tests.models import MODELS, train_step


@pytest.fixture(scope="module")
def trace():
    model, inputs = MODELS["llama"]()
    return md.trace(train_step, model, *inputs)


def test_export_perfetto_json_is_valid_chrome_trace(trace, tmp_path):
    path = tmp_path / "t.json"
    save_perfetto(trace, path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    assert all(e["ph"] in ("X", "C", "M") for e in events)
    for e in events:
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and e["dur"] >= 1
            assert all(isinstance(e[k], int) for k in ("ts", "dur", "pid", "tid"))
    ops = [e for e in events if e.get("cat") == "op"]
    assert len(ops) == len(trace) and [e["ts"] for e in ops] == list(range(len(trace)))
    assert ops[0]["args"]["inputs"] and "flops" in next(e["args"] for e in ops if e["name"] == "aten.mm.default")


def test_export_spans_nest_by_phase_and_module(trace):
    spans = sorted(
        (e for e in chrome_trace(trace)["traceEvents"] if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"])
    )
    stack = []
    for e in spans:  # every span lies inside the one open around it
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            assert e["ts"] + e["dur"] <= stack[-1]["ts"] + stack[-1]["dur"]
        stack.append(e)
    names = {e["name"] for e in spans if e["cat"] != "op"}
    assert {"forward", "backward", "layers", "attn", "q_proj"} <= names


def test_export_plot_renders_png(trace, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "m.png"
    save_plot(trace, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tables_shape_log_counts_distinct_signatures(trace):
    log = md.shape_log(trace)
    assert all(op in ("aten.mm.default", "aten.bmm.default") for op, _ in log.entries)
    assert sum(log.entries.values()) == sum(1 for c in trace if c.op in ("aten.mm.default", "aten.bmm.default"))
    assert len(md.shape_log(trace, ops="softmax")) >= 1


def test_tables_module_table_fits_width(trace):
    wide = md.module_table(trace)
    assert "  layers" in wide and "    0 (Block)" in wide
    for width in (80, 60):
        text = md.module_table(trace, width=width)
        assert max(len(line) for line in text.splitlines()) <= width


def test_module_table_folds_identical_siblings():
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)], torch.nn.ReLU())
    table = md.module_table(md.trace(lambda x: net(x).sum().backward(), torch.ones(2, 4)))
    lines = [line.strip() for line in table.splitlines()]
    # The first layer computes no input gradient, so it differs; 1..4 do not.
    assert any(line.startswith("0 (Linear)") for line in lines)
    assert any(line.startswith("1 (Linear)") for line in lines)
    assert any(line.startswith("2-4 (Linear, each as above)") for line in lines)
    assert not any(line.startswith("3 (Linear)") for line in lines)
    assert any(line.startswith("5 (ReLU)") for line in lines)
