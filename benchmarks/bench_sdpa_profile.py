"""Peak memory of a transformers LLaMA training step on logical CUDA, per GPU profile.

SDPA's kernel on a logical CUDA device is the one a GPU of the mode's profile
runs (Note [SDPA backend choice]); before, logical CUDA always recorded the math
decomposition, which keeps the S x S scores for backward.  This prints md.memory's
peak for transformers' LLaMA (default config = LLaMA-7B, bf16, batch 1 x 2048 tokens,
forward + backward) as recorded under each profile, under the math kernel (what was
recorded before), and for the built-in LLaMA-7B that calls flash attention by hand.

    python benchmarks/bench_sdpa_profile.py [--seq 2048] [--small]

``--small`` runs a 2-layer, 1024-wide LLaMA instead (seconds, for a quick look).
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import metadispatch as md
from metadispatch.cli import targets


def _peak(target, gpu, backends=None) -> tuple:
    for p in target.model.parameters():  # each step starts without gradients
        p.grad = None
    with sdpa_kernel(backends) if backends else _nothing():
        trace = md.tracer(device="cuda", gpu=gpu)(target.step, target.model, *target.inputs)
    kernels = collections.Counter(
        c.op.split(".")[1] for c in trace.calls if "attention" in c.op and "backward" not in c.op
    )
    return md.memory(trace).peak, ", ".join(f"{k} x{n}" for k, n in kernels.items()) or "math decomposition"


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--small", action="store_true", help="2 layers, hidden 1024")
    args = parser.parse_args()
    overrides = (
        {
            "num_hidden_layers": 2,
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
        }
        if args.small
        else {}
    )
    hf = targets.hf_target("llama", overrides, "cuda", True, 1, args.seq, torch.bfloat16)
    print(f"{hf.name}, bf16, forward + backward, torch {torch.__version__}")
    rows = [(f"gpu={g}", *_peak(hf, g)) for g in ("h100", "h200", "b200", "a100-80gb", "l4")]
    rows.append(("math kernel (before)", *_peak(hf, "h100", [SDPBackend.MATH])))
    if not args.small:
        builtin = targets.default_target("cuda", True, 1, args.seq)
        rows.append(("built-in LLaMA-7B", *_peak(builtin, "h100")))
    width = max(len(r[0]) for r in rows)
    for name, peak, kernels in rows:
        print(f"{name:<{width}}  {peak / 2**30:6.1f} GiB  {kernels}")


if __name__ == "__main__":
    main()
