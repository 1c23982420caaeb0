"""The command line, through main(argv) and once as `python -m metadispatch`."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import metadispatch as md
from metadispatch.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["trace", "summary", "replay", "check", "serve", "plan"])
def test_cli_help_on_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: metadispatch " + command in capsys.readouterr().out


def test_cli_version_prints_the_installed_versions(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"metadispatch {md.__version__} (torch {torch.__version__})\n"


def test_cli_default_trace_prints_summary(tmp_path):
    # COLUMNS: tables fit the terminal's width (pytest-xdist's workers say 80)
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100")
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "metadispatch", "trace", "--perfetto", str(tmp_path / "t.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.startswith("built-in LLaMA-7B (bf16, batch 1 x 2048 tokens): forward and backward on cuda")
    assert "aten._scaled_dot_product_flash_attention.default" in text
    assert (
        "FLOPs (backward" in text
        and "peak 62.8GiB" in text
        and "AdamW, step 2 of 2" in text
        and "1-31 (Block, each as above)" in text
    )
    assert "\r" not in out.stderr  # no progress line when not on a terminal
    # docs/cli.md shows this output in full: it must be what the command prints.
    shown = (ROOT / "docs" / "cli.md").read_text().split("$ metadispatch trace\n", 1)[1].split("```", 1)[0]
    timed = re.compile(r"traced in [\d.]+ s")
    assert timed.sub("traced in T s", text).startswith(timed.sub("traced in T s", shown))
    json.loads((tmp_path / "t.json").read_text())


def test_cli_trace_without_an_optimizer_never_imports_dynamo():
    # Note [Reference kernels without dynamo in the command line]; an
    # optimizer's step imports it itself (torch/optim/optimizer.py, _use_grad)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = ["-X", "importtime", "-m", "metadispatch", "trace", "--seq", "8", "--optimizer", "none", "--steps", "1"]
    out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "forward and backward on cuda (h100), step 1 of 1 (the first: no warmup)" in out.stdout
    assert "| torch._dynamo\n" not in out.stderr


def test_cli_default_step_never_imports_dynamo_and_traces_what_torchs_step_does(tmp_path):
    # The default command steps AdamW twice.  Its process steps torch's
    # optimizers without the dynamo import of their graph breaks (Note
    # [Reference kernels without dynamo in the command line]); main() in
    # this process steps them through torch's own wrapper.  Same trace.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    mine = tmp_path / "console.json"
    argv = ["-X", "importtime", "-m", "metadispatch", "trace", "--seq", "8", "--out", str(mine)]
    out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "AdamW, step 2 of 2 (the steady state)" in out.stdout
    assert "| torch._dynamo\n" not in out.stderr
    theirs = tmp_path / "main.json"
    assert main(["trace", "--seq", "8", "--out", str(theirs)]) == 0
    a, b = md.Trace.load(mine), md.Trace.load(theirs)
    assert a.lines() == b.lines()
    assert sum(c.phase == "optimizer" for c in a.calls) > 100  # the optimizer's calls are there, named as such


def test_cli_steps_without_graph_breaks_is_the_console_s_alone():
    # main() in the caller's process leaves torch's optimizers as they are.
    from torch.optim import optimizer

    code = optimizer._use_grad_for_differentiable(lambda *a, **k: None).__code__
    assert main(["trace", "tests.distributed_cases:tiny_llama", "--device", "cpu", "--optimizer", "sgd"]) == 0
    step = torch.optim.SGD.__dict__["step"]
    if getattr(step, "hooked", False):  # Optimizer.__init__ wrapped it in its hooks (functools.wraps)
        step = step.__wrapped__
    assert step.__code__ is code


def test_cli_main_in_the_callers_process_leaves_torch_reference_kernels_alone():
    # Only the console entry fills dynamo's wrapper caches; main() runs in
    # the user's (or pytest's) process, where torch must stay as it was.
    assert main(["trace", "tests.distributed_cases:tiny_llama", "--device", "cpu"]) == 0
    wrapped = md._compat.functions_behind_dynamo_wrappers()
    assert len(wrapped) > 100  # the walk finds them (torch 2.13: 160)
    assert not [f for f in wrapped if getattr(f, "__dynamo_disable", None) is f]


def test_cli_trace_module_callable(tmp_path, capsys):
    script = tmp_path / "mymodel.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.ones(4, 8)
    """)
    )
    assert main(["trace", f"{script}:build", "--device", "cpu", "--plot", str(tmp_path / "m.png")]) == 0
    out = capsys.readouterr().out
    assert f"{script}:build: forward and backward on cpu" in out
    assert "aten.addmm.default" in out and "0 (Linear)" in out


def test_cli_trace_hf_with_config_overrides(capsys):
    pytest.importorskip("transformers")
    assert (
        main(
            [
                "trace",
                "--hf",
                "llama",
                "--config",
                "num_hidden_layers=1",
                "--config",
                "hidden_size=64",
                "--config",
                "intermediate_size=128",
                "--config",
                "num_attention_heads=4",
                "--config",
                "num_key_value_heads=4",
                "--config",
                "vocab_size=100",
                "--seq",
                "16",
                "--forward-only",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "transformers LlamaForCausalLM (batch 1 x 16 tokens): forward on cuda" in out
    assert "layers" in out


@pytest.mark.parametrize("gpu, kernel", [("h100", "cudnn"), ("a100-80gb", "flash")])
def test_cli_trace_hf_gpu_selects_the_attention_kernel(capsys, gpu, kernel):
    pytest.importorskip("transformers")
    small = [
        "num_hidden_layers=1",
        "hidden_size=64",
        "intermediate_size=128",
        "num_attention_heads=4",
        "num_key_value_heads=4",
        "vocab_size=100",
    ]
    argv = ["trace", "--hf", "llama", "--dtype", "bf16", "--seq", "16", "--gpu", gpu]
    assert main(argv + [a for kv in small for a in ("--config", kv)]) == 0
    out = capsys.readouterr().out
    assert f"forward and backward on cuda ({gpu})" in out
    assert f"aten._scaled_dot_product_{kernel}_attention.default" in out


def test_cli_trace_out_summary_and_replay(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    assert main(["trace", "tests.models:mlp", "--device", "cpu", "--out", str(path)]) == 0
    assert main(["summary", str(path)]) == 0
    assert "calls" in capsys.readouterr().out
    assert main(["replay", str(path), "--device", "cpu"]) == 0
    assert "replay ok" in capsys.readouterr().out
