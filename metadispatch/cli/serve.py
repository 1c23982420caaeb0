"""``metadispatch serve``: ``md.serve_plan`` for a transformers causal LM built from its config.

The model is built under a logical GPU (no weights, no memory), so the plan
for a 70B model takes seconds on a laptop; every figure is read from the
model's own prefill, decode and cache (Note [Serving figures from the cache
the model writes]).
"""

from __future__ import annotations

import argparse

from . import targets
from .options import DTYPES, at_least, gpu
from .terminal import Progress, stage

__all__ = ["add_parser", "run"]


def add_parser(sub, kw: dict):
    """Register ``serve`` on the subcommands ``sub`` and return its parser."""
    s = sub.add_parser(
        "serve",
        **kw,
        help="plan serving a causal LM on a GPU: KV cache, concurrency, TTFT and TPOT",
        description="Trace a transformers causal LM's prefill and decode on a logical GPU and print its "
        "serving plan: weights, KV bytes per token per layer kind, KV capacity, concurrency, TTFT and TPOT.",
    )
    s.add_argument("--hf", metavar="ARCH", required=True, help="a transformers causal LM type, e.g. llama")
    s.add_argument("--config", metavar="KEY=VALUE", action="append", help="config overrides")
    s.add_argument("--gpu", metavar="NAME", type=gpu, default="h100", help="the GPU (default h100)")
    s.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weights and KV dtype (default bf16)")
    s.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel GPUs (default 1)")
    s.add_argument("--max-model-len", type=at_least(2), default=4096, help="tokens per sequence (default 4096)")
    s.add_argument(
        "--max-num-batched-tokens", type=at_least(1), default=2048, help="tokens of one prefill (default 2048)"
    )
    s.add_argument(
        "--gpu-memory-utilization", type=_fraction, default=0.9, help="share of the GPU's memory used (default 0.9)"
    )
    s.add_argument("--block-size", type=at_least(1), default=16, help="tokens per KV block (default 16)")
    s.add_argument(
        "--batch", type=_batches, default=(1,), metavar="B[,B...]", help="decode batch sizes to time (default 1)"
    )
    return s


def run(args) -> int:
    config = targets.hf_config(args.hf, targets.parse_overrides(args.config))  # says how to install transformers
    import transformers

    from ..mode.mode import MetaMode
    from ..planning.tp import split_problems
    from ..serving.serve import serve_plan

    targets.require_causal_lm(args.hf, config, "serve")
    problems = split_problems(config, args.tp)
    if problems:  # a usage error, before anything is built
        raise targets.UsageError(
            f"--tp {args.tp} does not split {', '.join(problems)}; tp must divide num_attention_heads and "
            "intermediate_size"
        )
    for option, tokens in (
        ("--max-model-len", args.max_model_len),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
    ):
        targets.check_positions(config, "causal", tokens, option)
    with Progress("building the model"), stage("building the model"):
        with MetaMode(device="cuda", gpu=args.gpu):
            model = transformers.AutoModelForCausalLM.from_config(config).to(DTYPES[args.dtype])
    with Progress("tracing"), stage("the model raised while tracing"):
        plan = serve_plan(
            model,
            args.gpu,
            tp=args.tp,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            block_size=args.block_size,
            batches=args.batch,
        )
    print(plan)
    return 0


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,8,32, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes must be at least 1, got {text!r}")
    return values
