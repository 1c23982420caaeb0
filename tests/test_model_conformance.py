"""A quick subset of tools/model_conformance.py: real model steps on a logical
CPU against the real CPU run -- op sequence, output and gradient metadata,
FLOPs against FlopCounterMode, peak memory against md.LiveStorages, FakeTensorMode,
replay against the eager step, materialize against the eager build, and a
logical-CUDA trace."""

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import model_conformance as conformance  # noqa: E402

QUICK = [
    "nn.mha",
    "nn.convnet_channels_last",
    "nn.autocast_convnet",
    "nn.custom_op",
    "nn.compiled",
    "nn.optimizer_in_backward",
    "nn.hook_shapes",
    pytest.param("hf.gpt2", marks=pytest.mark.slow),
    pytest.param("tv.resnet18_channels_last", marks=pytest.mark.slow),
    pytest.param("timm.convnext_atto", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name", QUICK)
def test_model_conformance_quick_subset(name):
    needs = conformance.CONFIGS[name].needs
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} not installed")
    row = conformance.check(name)
    expected = {c: "yes" for c in conformance.COLUMNS if c not in ("config", "notes")}
    assert {c: row[c] for c in expected} == expected, row["notes"]


@pytest.mark.slow
def test_model_conformance_reports_a_mismatch():
    # The LSTM's oneDNN workspace is not modelled: the tool must say so.
    row = conformance.check("nn.lstm")
    assert row["ops"] == "yes" and row["meta"] == "no" and row["memory"].startswith("no")
    # ... and replay refuses the trace (a workspace of another size) though its values are eager's.
    assert row["replay"] == "no" and "not ok" in row["notes"] and "values equal eager's" in row["notes"]


def test_model_conformance_dataloader_epoch_replays_eagers_epoch():
    # The loader's seed and permutation run for real outside the trace
    # (Note [A DataLoader inside a traced step]): eager's log holds their 5
    # calls, the trace does not; every value is eager's, and so is the peak
    # (their tensors die before it; the 92 B once put down to them were
    # mse_loss's storage: Note [Reduced losses keep the loss's storage]).
    row = conformance.check("nn.dataloader_epoch")
    assert row["traces"] == row["flops"] == row["replay"] == row["materialize"] == row["cuda"] == "yes", row["notes"]
    assert row["ops"] == "no (174 vs 179 calls)" and row["memory"] == "yes"


def test_model_conformance_column_failure_is_a_result():
    # CTC's loss needs its inputs' values: md.trace and the logical-CUDA trace fail,
    # which the row says; materialize, which does not run the step, still holds.
    row = conformance.check("nn.ctc")
    assert row["traces"] == "error" and row["cuda"] == "error" and row["materialize"] == "yes"
    assert "DataDependentError" in row["notes"]
    # --expect compares it with the docs' row, whose columns after a failed trace read "-".
    assert conformance.differences([row], {"nn.ctc": conformance.expected(DOC, "2.13")["nn.ctc"]}) == []


DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "model-conformance.md")


def test_docs_tables_name_every_configuration():
    # CI compares a whole run with these tables (--expect): each names every
    # configuration its environment runs, and only known ones.
    for version, count in (("2.14", 50), ("2.13", 32)):
        rows = conformance.expected(DOC, version)
        assert len(rows) == count and set(rows) <= set(conformance.CONFIGS), version
        assert all(set(r) == set(conformance.COLUMNS[1:-1]) for r in rows.values())


def test_expect_reports_each_difference():
    want = conformance.expected(DOC, "2.14")
    row = {"config": "nn.gru", **want["nn.gru"], "notes": "anything"}
    assert conformance.differences([row], {"nn.gru": want["nn.gru"]}) == []
    changed = dict(row, ops="no")
    assert conformance.differences([changed], {"nn.gru": want["nn.gru"]}) == ["nn.gru: {'ops': 'yes -> no'}"]
    # A row the run lacks, a library not installed (left out) and a model
    # that cannot be built (a difference):
    assert conformance.differences([], {"nn.gru": want["nn.gru"]}) == ["nn.gru: only in the docs"]
    absent = {"config": "tv.resnet18", "skipped": "torchvision not installed"}
    assert conformance.differences([row, absent], {"nn.gru": want["nn.gru"]}) == []
    broken = {"config": "nn.gru", "skipped": "cannot build: ValueError: x"}
    assert conformance.differences([broken], {"nn.gru": want["nn.gru"]})[0].startswith(
        "nn.gru: {'traces': 'yes -> skipped'"
    )


def test_expect_reads_an_error_row_as_the_table_prints_it():
    # nn.ctc's row: the columns after an error are "-" in the table and in the comparison.
    want = conformance.expected(DOC, "2.14")
    row = {"config": "nn.ctc", "notes": "", **{c: v for c, v in want["nn.ctc"].items() if v != "-"}}
    assert conformance.differences([row], {"nn.ctc": want["nn.ctc"]}) == []
