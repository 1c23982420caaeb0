"""``metadispatch plan``: ``md.plan`` for a transformers causal LM built from its config.

The model is built on N logical GPUs (no weights, no memory); every
configuration of the search is traced on rank 0 and ranked by its
steady-state step time among those whose reserved peak fits
(planning/train.py).  (cli/plan.py is ``trace --world-size``'s.)
"""

from __future__ import annotations

import argparse

import torch

from . import targets
from .options import at_least, gpu
from .targets import UsageError
from .terminal import Progress, stage

__all__ = ["add_parser", "run"]

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def add_parser(sub, kw: dict):
    """Register ``plan`` on the subcommands ``sub`` and return its parser."""
    s = sub.add_parser(
        "plan",
        **kw,
        help="rank training configurations (FSDP2/HSDP, TP/SP, CP, EP, AC, micro-batch, optimizer) on N logical GPUs",
        description="Trace every configuration's rank 0 on N logical GPUs and print them ranked by step time "
        "among those whose steady-state reserved peak fits.",
    )
    s.add_argument("--hf", metavar="ARCH", required=True, help="a transformers causal LM type, e.g. llama")
    s.add_argument("--config", metavar="KEY=VALUE", action="append", help="config overrides")
    s.add_argument("--gpus", type=at_least(1), required=True, help="GPUs in the job")
    s.add_argument("--gpu", metavar="NAME", type=gpu, default="h100", help="the GPU (default h100)")
    s.add_argument("--global-batch", type=at_least(1), required=True, help="sequences per optimizer step")
    s.add_argument("--seq", type=at_least(1), required=True, help="tokens per sequence")
    s.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="parameters' dtype (default bf16)")
    for name, what in (
        ("tp", "TP degrees"),
        ("shard", "FSDP2 shard degrees"),
        ("micro-batch", "micro-batches"),
        ("cp", "context-parallel degrees (default 1)"),
        ("ep", "expert-parallel degrees, MoE models (default 1)"),
    ):
        s.add_argument(f"--{name}", type=_ints, metavar="N[,N...]", help=f"{what} to search (default: all)")
    s.add_argument("--sp", type=_words, metavar="off,on", help="sequence parallelism with TP (default off)")
    s.add_argument("--ac", type=_words, metavar="none,block", help="activation checkpointing (default both)")
    s.add_argument("--optimizer", type=_words, metavar="foreach,fused", help="AdamW implementations (default both)")
    s.add_argument(
        "--scale", type=_ints, metavar="A,B", help="trace A and B layers and extrapolate (md.plan(scale=); a screen)"
    )
    s.add_argument("--top", type=at_least(1), default=20, help="rows to print (default 20)")
    return s


def run(args) -> int:
    config = targets.hf_config(args.hf, targets.parse_overrides(args.config))
    import transformers

    from ..planning.train import plan

    targets.require_causal_lm(args.hf, config, "plan")
    targets.check_positions(config, "causal", args.seq, "--seq")
    keys = {"tp": args.tp, "shard": args.shard, "micro_batch": args.micro_batch, "ac": args.ac, "cp": args.cp}
    search = {k: v for k, v in {**keys, "ep": args.ep, "optimizer": args.optimizer}.items() if v}
    bad = set(search.get("ac", ())) - {"none", "block"} | set(search.get("optimizer", ())) - {"foreach", "fused"}
    bad |= set(args.sp or ()) - {"off", "on"}
    if bad:
        raise UsageError(
            f"--ac/--optimizer/--sp: unknown {', '.join(sorted(bad))} "
            "(ac: none, block; optimizer: foreach, fused; sp: off, on)"
        )
    if args.sp:
        search["sp"] = [w == "on" for w in args.sp]

    if args.scale is not None and len(args.scale) != 2:
        raise UsageError(f"--scale {','.join(map(str, args.scale))}: two depths, e.g. --scale 2,4")

    def make(layers=None):
        c = config if layers is None else type(config)(**{**config.to_dict(), "num_hidden_layers": layers})
        return transformers.AutoModelForCausalLM.from_config(c).to(_DTYPES[args.dtype])

    with Progress("planning"), stage("the model raised while tracing"):
        table = plan(
            make,
            gpus=args.gpus,
            gpu=args.gpu,
            global_batch=args.global_batch,
            seq=args.seq,
            search=search,
            scale=tuple(args.scale) if args.scale else None,
        )
    text = str(table).splitlines()
    print("\n".join(text[: 4 + args.top]))  # the head, a blank line, the column heads and rule
    if len(table) > args.top:
        print(f"... {len(table) - args.top} more")
    return 0


def _ints(text: str) -> list:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _words(text: str) -> list:
    return [w.strip() for w in text.split(",") if w.strip()]
