"""`metadispatch serve`: the plan md.serve_plan gives for the same model, and usage errors as exit 2."""

import pytest
import torch

import metadispatch as md
from metadispatch.cli.main import main

transformers = pytest.importorskip("transformers")

SMALL = ["hidden_size=64", "intermediate_size=128", "num_hidden_layers=2", "num_attention_heads=4"]
SMALL += ["num_key_value_heads=2", "vocab_size=128", "max_position_embeddings=512"]


def test_serve_prints_md_serve_plans_plan(capsys):
    argv = ["serve", "--hf", "llama", "--gpu", "l4", "--max-model-len", "128", "--max-num-batched-tokens", "64"]
    argv += ["--batch", "1,4"] + [a for kv in SMALL for a in ("--config", kv)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    config = transformers.LlamaConfig(**{k: int(v) for k, v in (kv.split("=") for kv in SMALL)})
    with md.MetaMode(device="cuda", gpu="l4"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    plan = md.serve_plan(model, "l4", max_model_len=128, max_num_batched_tokens=64, batches=(1, 4))
    assert out.strip() == str(plan).strip()
    assert f"{plan.kv_tokens:,} tokens" in out and "2 × full (DynamicLayer)" in out
    assert plan.kv_per_token == 2 * 2 * 2 * 16 * 2  # bf16 (2 B): keys and values, 2 layers, 2 kv heads of 16


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf", "bert"], "serve plans a decoder-only causal LM"),
        (["--hf", "t5"], "serve plans a decoder-only causal LM"),
        (["--hf", "gpt2", "--max-model-len", "4096"], "--max-model-len 4096: longer than GPT2Config's n_positions"),
        (["--hf", "llama", "--batch", "0"], "batch sizes must be at least 1"),
        (["--hf", "llama", "--batch", "x"], "expected batch sizes"),
        (["--hf", "llama", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--hf", "llama", "--gpu", "nope"], "nope"),
        (["--hf", "llama", "--config", "no_such_key=1"], "no_such_key"),
    ],
)
def test_serve_usage_errors_exit_2(argv, message, capsys):
    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_serve_without_transformers_says_how_to_install(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert main(["serve", "--hf", "llama"]) == 2
    assert "transformers" in capsys.readouterr().err


def test_serve_tp_prints_one_ranks_plan(capsys):
    argv = ["serve", "--hf", "llama", "--tp", "2", "--max-model-len", "128", "--max-num-batched-tokens", "64"]
    assert main(argv + [a for kv in SMALL for a in ("--config", kv)]) == 0
    out = capsys.readouterr().out
    config = transformers.LlamaConfig(**{k: int(v) for k, v in (kv.split("=") for kv in SMALL)})
    with md.MetaMode(device="cuda", gpu="h100"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    plan = md.serve_plan(model, "h100", tp=2, max_model_len=128, max_num_batched_tokens=64)
    assert out.strip() == str(plan).strip()
    assert plan.kv_per_token == 2 * 2 * 1 * 16 * 2 and "collectives    4 in a prefill" in out  # one KV head a rank


def test_serve_tp_that_does_not_split_the_heads_is_a_usage_error(capsys):
    # exit 2 as every other bad argument, naming the value and the rule (it was exit 3, "the model raised")
    assert main(["serve", "--hf", "llama", "--tp", "3", *[a for kv in SMALL for a in ("--config", kv)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err) and len(err) <= 2
    assert err[0].startswith(
        "metadispatch serve: error: --tp 3 does not split num_attention_heads=4, intermediate_size"
    )
    assert "tp must divide num_attention_heads and intermediate_size" in err[0] and "vLLM's rule" in err[0]
