"""What the command line writes and says, as a new user meets it (issue 28 item 7).

Each output asked for is written, or the command fails with exit 3 and one
line; each message is plain English, numbers in the report's units.
"""

import io
import sys
import textwrap

import pytest
import torch
from torch import nn

import metadispatch as md
from metadispatch.cli.main import main
from metadispatch.ir.text import fmt_bytes

USAGE, FAILURE = 2, 3


def _run(argv, capsys):
    """(exit code, stdout, stderr) of main(argv), whether it returns or argparse exits."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class _ClosedAfter(io.StringIO):
    """A stdout whose reader (``| head``) goes away after its first line."""

    def write(self, text):
        if self.getvalue():
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


@pytest.mark.parametrize("option", ["--out", "--perfetto"])
def test_cli_outputs_files_are_written_when_stdout_closes_early(option, tmp_path, monkeypatch):
    # Note [Files before the report]: `metadispatch trace --out t.json.gz | head`
    path = tmp_path / ("t.json.gz" if option == "--out" else "t.perfetto.json")
    monkeypatch.setattr(sys, "stdout", _ClosedAfter())
    with pytest.raises(BrokenPipeError):  # console() stops quietly on it
        main(["trace", "tests.models:mlp", "--device", "cpu", option, str(path)])
    assert path.exists() and path.stat().st_size > 0
    if option == "--out":  # the whole trace: as a run whose stdout stays open writes it
        monkeypatch.setattr(sys, "stdout", io.StringIO())
        assert main(["trace", "tests.models:mlp", "--device", "cpu", "--out", str(tmp_path / "whole.json")]) == 0
        assert md.Trace.load(path).lines() == md.Trace.load(tmp_path / "whole.json").lines()


def test_cli_outputs_wrote_lines_follow_the_report(tmp_path, capsys):
    path = tmp_path / "t.json"
    code, out, _ = _run(["trace", "tests.models:mlp", "--device", "cpu", "--out", str(path)], capsys)
    assert code == 0 and out.rstrip().splitlines()[-1] == f"wrote {path}"


def test_cli_outputs_replay_refusal_names_the_device_to_replay_on(tmp_path, capsys):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    path = tmp_path / "cuda.json"
    md.tracer(device="cuda")(lambda m, x: m(x).sum().backward(), model, torch.randn(2, 3, 8, 8)).save(path)
    code, _, err = _run(["replay", str(path)], capsys)
    assert code == FAILURE
    line = err.splitlines()[0]
    assert "aten.cudnn_batch_norm.default has no cpu kernel: the trace was recorded for cuda" in line
    assert "Replay it on cuda, or trace the step for cpu. Nothing was run" in line
    assert "chose it" not in line and "replay there" not in line


@pytest.fixture
def module_file(tmp_path):
    script = tmp_path / "mods.py"
    script.write_text(
        textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def forward(self, x):
                return x

        model = Net()
        size = 3
    """)
    )
    return script


@pytest.mark.parametrize("command", ["trace", "check"])
@pytest.mark.parametrize(
    "name, what",
    [("model", "is an nn.Module (Net)"), ("Net", "is the nn.Module class Net"), ("size", "is a int, not a function")],
)
def test_cli_outputs_a_model_as_the_target_is_a_usage_error(command, name, what, module_file, capsys):
    code, _, err = _run([command, f"{module_file}:{name}", "--device", "cpu"], capsys)
    assert code == USAGE, err
    assert what in err.splitlines()[0] and "returning (model, example inputs)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["trace", "--outt", "t.json"], "did you mean --out?"),
        (["trace", "--forward_only"], "did you mean --forward-only?"),
        (["summary", "t.json", "--topp", "3"], "did you mean --top?"),
        (["trce"], "did you mean trace?"),
    ],
)
def test_cli_outputs_a_mistyped_option_gets_a_suggestion(argv, suggestion, capsys):
    code, _, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == USAGE and len(lines) == 2 and suggestion in lines[1]


def test_cli_outputs_an_unknown_option_far_from_any_gets_the_help_hint(capsys):
    code, _, err = _run(["trace", "--zzzzzz"], capsys)
    assert code == USAGE and err.strip().splitlines()[1] == "  (see metadispatch --help)"


def test_cli_outputs_hf_without_transformers_says_how_to_install_from_a_checkout(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    code, _, err = _run(["trace", "--hf", "gpt2", "--device", "cpu"], capsys)
    assert code == USAGE
    assert "pip install 'metadispatch[hf]'" in err and "pip install '.[hf]'" in err


def test_cli_outputs_golden_traces_without_expecttest_say_what_to_install(monkeypatch):
    from metadispatch.testing import assert_trace

    monkeypatch.setitem(sys.modules, "expecttest", None)
    with pytest.raises(ModuleNotFoundError, match="need expecttest, which a plain install of metadispatch lacks"):
        assert_trace(md.trace(lambda x: x + 1, torch.ones(2)), "")


def test_cli_outputs_zero_flop_ops_read_as_counted_zero(tmp_path, capsys):
    path = tmp_path / "t.json"
    code, out, _ = _run(["trace", "tests.models:mlp", "--device", "cpu", "--out", str(path)], capsys)
    f = md.flops(md.Trace.load(path))
    calls = sum(f.uncounted.values())
    line = next(x for x in out.splitlines() if "FLOPs (" in x)
    assert f"{len(f.uncounted)} other ops ({calls:,} calls: views, copies, elementwise ops) count 0 FLOPs" in line
    assert "as in FlopCounterMode" in line and "no formula" not in line


@pytest.mark.parametrize("n, text", [(1000 * 2**20, "1000MiB"), (1023 * 2**30, "1023GiB"), (999 * 2**10, "999KiB")])
def test_cli_outputs_bytes_never_print_as_exponents(n, text):
    assert fmt_bytes(n) == text


def test_cli_outputs_comms_prints_a_summary_not_a_row_per_module():
    from tests.distributed_cases import traced_rank

    trace, _ = traced_rank(0, 2, "fsdp-foreach")
    comms = md.comms(trace)
    text = str(comms)
    rows = {(c.kind, c.group.name if c.group else "-", c.phase) for c in comms.calls}
    assert text.splitlines()[0] == f"{len(comms.calls)} collectives, {fmt_bytes(comms.bytes)} ({comms.bytes:,} B)"
    assert len(text.splitlines()) == 1 + 3 + len(rows) + 1  # head, blank, header and rule, rows, hint
    assert len(comms.table().splitlines()) >= len(text.splitlines()) - 2  # per module: .table()
    assert "e+" not in text
