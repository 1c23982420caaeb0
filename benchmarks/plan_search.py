"""The ``md.plan`` searches in docs/plan.md: the table, the time, and where the time went.

    python benchmarks/plan_search.py 13b-a100 [--scale 2,4] [--top 12]
    python benchmarks/plan_search.py 7b-h100 [--scale 1,2]

Each case is transformers' ``LlamaConfig`` with the model's published shape,
bf16 parameters, built under logical GPUs (no weights).  The head line says
how many candidates, how many programs were traced (full depth and at the
scaled depths) and the seconds spent tracing and measuring (allocator,
timeline, roofline); wall time on a shared machine; the line after it, the
process's CPU seconds and the load average (1 minute) as it began and ended.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import metadispatch as md

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40),
}
# case -> (shape, gpus, gpu, global batch, seq, search)
CASES = {
    "7b-h100": ("7b", 64, "h100", 512, 4096, {"micro_batch": [1, 2, 4], "ac": ["none", "block"]}),
    "13b-a100": ("13b", 8, "a100-40gb", 64, 4096, {"micro_batch": [1, 2, 4], "optimizer": ["fused"]}),
}


def maker(shape: str):
    import transformers

    base = {**SHAPES[shape], "vocab_size": 32000}
    base["num_key_value_heads"] = base["num_attention_heads"]

    def make(layers=None):
        cfg = transformers.LlamaConfig(**{**base, **({"num_hidden_layers": layers} if layers else {})})
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)

    return make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--scale", help="A,B: md.plan(scale=(A, B))")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--confirm", type=int, default=5)
    args = p.parse_args()
    shape, gpus, gpu, batch, seq, search = CASES[args.case]
    scale = tuple(int(x) for x in args.scale.split(",")) if args.scale else None
    cpu, load = time.process_time(), os.getloadavg()[0]
    table = md.plan(
        maker(shape), gpus=gpus, gpu=gpu, global_batch=batch, seq=seq, search=search, scale=scale, confirm=args.confirm
    )
    cpu = time.process_time() - cpu
    lines = str(table).splitlines()
    print(f"{cpu:.1f} s of CPU; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("\n".join(lines[: 4 + args.top]))
    rejected = [c for c in table if c.fits is False]
    print(f"... {len(table) - args.top} more; {len(rejected)} rejected, {sum(c.fits is True for c in table)} fit")
    for c in rejected:
        print(
            f"  {c.config['shard']}x{c.config['replicate']} tp {c.config['tp']} {c.config['ac']} "
            f"mb {c.config['micro_batch']}: {c.why}"
        )


if __name__ == "__main__":
    main()
