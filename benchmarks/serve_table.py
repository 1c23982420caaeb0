"""The serving table in docs/fit-and-time.md: md.serve_plan beside the config formula people use.

    python benchmarks/serve_table.py [--gpu h100] [ARCH ...]

Each model is transformers' default config for its type (LLaMA-2-7B's shape
for ``llama``, Mistral-7B's for ``mistral``, ...), in bf16, built under a
logical GPU (no weights).  The formula column is the calculators' figure:
``2 * layers * kv_heads * head_dim * 2 B`` per token for every layer, with
concurrency at a length as capacity // (formula * length).
"""

from __future__ import annotations

import argparse
import time

import torch

import metadispatch as md

# arch -> config overrides (positions raised where 32k would pass the default's learned end)
MODELS = {
    "llama": {},
    "mistral": {"max_position_embeddings": 32768},
    "gemma2": {"max_position_embeddings": 32768},
    "qwen3_moe": {},
    "jamba": {},
    "deepseek_v3": {},
}


def formula_per_token(config) -> int:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * 2


def row(arch: str, gpu: str) -> str:
    import transformers

    config = transformers.AutoConfig.for_model(arch, **MODELS[arch])
    start = time.perf_counter()
    with md.MetaMode(device="cuda", gpu=gpu):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    plans = {n: md.serve_plan(model, gpu, max_model_len=n, batches=(1,)) for n in (4096, 32768)}
    took = time.perf_counter() - start
    p = plans[4096]
    usable = p.kv_tokens * p.kv_per_token  # the KV budget both columns share
    f = formula_per_token(config)
    kinds = "; ".join(p.layout.kinds()) if p.layout else ""
    return (
        f"| {arch} | {p.weights / 2**30:.1f} | {p.kv_per_token / 1024:.0f} | {f / 1024:.0f} | {p.kv_tokens:,} "
        f"| {p.max_concurrency:,} / {int(usable // (f * 4096)):,} "
        f"| {plans[32768].max_concurrency:,} / {int(usable // (f * 32768)):,} "
        f"| {p.ttft * 1e3:.0f} | {plans[4096].tpot * 1e3:.1f} | {took:.0f} s | {kinds} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("archs", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    print(
        "| model | weights GiB | KV KiB/token | formula KiB/token | KV tokens | concurrency at 4k (traced / formula) | at 32k | TTFT ms (2048 tokens) | TPOT ms at 4k | plan took | layers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arch in args.archs:
        try:
            print(row(arch, args.gpu), flush=True)
        except Exception as e:  # a model this table cannot plan: say so in its row
            print(f"| {arch} | {type(e).__name__}: {str(e).splitlines()[0][:120]} |", flush=True)


if __name__ == "__main__":
    main()
