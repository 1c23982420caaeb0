"""`metadispatch plan`: md.plan's table for the same model, and usage errors as exit 2."""

import pytest
import torch

import metadispatch as md
from metadispatch.cli.main import main

transformers = pytest.importorskip("transformers")

SMALL = ["hidden_size=64", "intermediate_size=128", "num_hidden_layers=2", "num_attention_heads=4"]
SMALL += ["num_key_value_heads=2", "vocab_size=128"]
SEARCH = ["--tp", "1,4", "--shard", "4", "--micro-batch", "2", "--optimizer", "foreach"]


def test_plan_cli_prints_md_plans_ranking(capsys):
    argv = ["plan", "--hf", "llama", "--gpus", "4", "--global-batch", "8", "--seq", "16", *SEARCH]
    assert main(argv + [a for kv in SMALL for a in ("--config", kv)]) == 0
    out = capsys.readouterr().out
    config = transformers.LlamaConfig(**{k: int(v) for k, v in (kv.split("=") for kv in SMALL)})
    search = {"tp": [1, 4], "shard": [4], "micro_batch": [2], "optimizer": ["foreach"]}
    table = md.plan(
        lambda: transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16),
        gpus=4,
        global_batch=8,
        seq=16,
        search=search,
    )
    rows = [line.split("  ")[1] for line in out.splitlines()[4:]]
    assert rows[:2] == [line.split("  ")[1] for line in str(table).splitlines()[4:6]]
    assert "shard 4 does not divide the 1 data-parallel ranks" in out and "not overlapped" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "0"], "expected positive numbers"),
        (["--hf", "bert"], "plan plans a decoder-only causal LM"),
        (["--micro-batch", "x"], "expected numbers like"),
        (["--ac", "some"], "unknown some"),
        (["--sp", "maybe"], "unknown maybe"),
        (["--cp", "0"], "expected positive numbers"),
        (["--gpu", "nope"], "nope"),
        (["--scale", "2"], "--scale 2: two depths"),
    ],
)
def test_plan_cli_usage_errors_exit_2(argv, message, capsys):
    try:
        code = main(["plan", "--hf", "llama", "--gpus", "4", "--global-batch", "8", "--seq", "16", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
