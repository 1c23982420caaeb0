"""Replay time over eager time, forward + backward, for the same model.

    python benchmarks/bench_replay.py            # CPU, and CUDA when available

Eager runs the model with autograd; replay runs the recorded trace (forward
and backward calls) with metadata checks on.  Each is timed in phases of its
own (see ``_best_seconds``), best of ``--repeat`` after warm-up.  Targets:
replay/eager <= 1.10 (issue 3), <= 1.05 (issue 6).

Each model is measured twice, in processes of their own (glibc reads its
settings at start-up):

* ``default`` -- glibc's malloc as it comes.  Tensors above its mmap threshold
  are mapped fresh and returned to the kernel when freed, so every step pays
  page faults, and how many depends on the allocation history (the same eager
  step, one after another: 32,000 to 240,000 minor faults, 1.6 to 2.4 s on
  the 1024-wide LLaMA).  Both sides pay it, unevenly.
* ``retained`` -- ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
  set so that freed memory stays in the process: after warm-up neither side
  faults, and the ratio is that of the kernels and the Python around them.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import metadispatch as md  # noqa: E402


def _llama(hidden: int, layers: int, vocab: int = 1024, heads: int = 8):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=512, attn_implementation="eager"))


def _step(model, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits


MODELS = {  # name -> (model, batch, sequence length)
    "llama-tiny": (lambda: _llama(64, 2), 2, 32),
    "llama-small": (lambda: _llama(256, 4), 4, 128),
    # issue 6's model: hidden 1024, 8 layers, 16 heads, vocab 32000, 1 x 128
    "llama-1024x8": (lambda: _llama(1024, 8, vocab=32000, heads=16), 1, 128),
}


def _best_seconds(fns, repeat: int, device) -> list:
    """Best wall time of each function, each measured in a phase of its own.

    Interleaving eager and replay runs makes each start from the allocator
    state the other left: whichever follows pays first-touch page faults for
    memory the other returned to the OS (seen: 0 minor faults for an eager
    step after an eager step, 175,000 after a replay step).  So each function
    warms up twice and is then timed ``repeat`` times in a row; the phases
    alternate twice to share slow spells of a busy machine.
    """
    best = [float("inf")] * len(fns)
    for _ in range(2):
        for i, fn in enumerate(fns):
            for rnd in range(repeat + 2):  # two warm-up runs
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if rnd >= 2:
                    best[i] = min(best[i], time.perf_counter() - t0)
    return best


def bench(name: str, device: torch.device, repeat: int) -> tuple:
    build, batch, seq = MODELS[name]
    torch.manual_seed(0)
    model = build().to(device)
    ids = torch.randint(0, 1024, (batch, seq), device=device)
    trace = md.tracer(device=device)(_step, model, ids)
    eager_model = copy.deepcopy(model)

    def eager():
        eager_model.zero_grad(set_to_none=True)
        _step(eager_model, ids)

    def replay():
        md.replay(trace, (model, ids), device=device)

    return (len(trace), *_best_seconds([eager, replay], repeat, device))


ALLOCATORS = {  # name -> environment for the measuring process
    "default": {},
    "retained": {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--malloc", choices=[*ALLOCATORS, "both"], default="both")
    opts = parser.parse_args()
    if opts.malloc == "both":
        print(f"{'model':<12} {'device':<7} {'malloc':<8} {'calls':>6} {'eager ms':>9} "
              f"{'replay ms':>10} {'ratio':>6}", flush=True)
        for name in opts.models:
            for malloc, env in ALLOCATORS.items():
                subprocess.run([sys.executable, __file__, "--repeat", str(opts.repeat),
                                "--models", name, "--malloc", malloc],
                               env={**os.environ, **env}, check=True)
        return
    torch.set_num_threads(1)  # as the other benchmarks: one thread, less noise
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    for device in devices:
        for name in opts.models:
            repeat = min(opts.repeat, 2) if name == "llama-1024x8" else opts.repeat
            calls, eager, replay = bench(name, device, repeat)
            print(f"{name:<12} {device.type:<7} {opts.malloc:<8} {calls:>6} {eager * 1e3:>9.2f} "
                  f"{replay * 1e3:>10.2f} {replay / eager:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
