"""What a trace holds, and how fast it saves and loads.

    python benchmarks/bench_footprint.py

- bytes of Python heap held per recorded call (tracemalloc, trace kept alive);
- resident-memory growth while tracing a LLaMA-7B-sized forward+backward on
  logical cuda (the model is built on meta first, outside the measurement);
- save + load time over the time it took to record the same trace.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import tracemalloc

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import metadispatch as md  # noqa: E402
from benchmarks.common import best_of, build, llama_config, rss, table, train_step  # noqa: E402


def _llama_step(cfg, device="cpu"):
    from transformers import LlamaForCausalLM

    model, ids = build(LlamaForCausalLM, cfg, md.MetaMode(device=device))
    return train_step(model), ids


def bytes_per_call() -> tuple:
    step, ids = _llama_step(llama_config(8))
    md.trace(step, ids)  # warm caches and imports
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t = md.trace(step, ids)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return len(t), held / len(t)


def rss_7b() -> tuple:
    from transformers import LlamaConfig

    step, ids = _llama_step(LlamaConfig(), device="cuda")  # defaults: LLaMA-7B
    gc.collect()
    before = rss()
    t = md.trace(step, ids)
    return len(t), (rss() - before) / 2**20


def save_load() -> tuple:
    step, ids = _llama_step(llama_config(8))
    record = best_of(lambda: md.trace(step, ids), 7)
    t = md.trace(step, ids)
    path = os.path.join(tempfile.mkdtemp(), "t.json.gz")
    save = best_of(lambda: t.save(path), 7)
    load = best_of(lambda: md.Trace.load(path), 7)
    return record, save, load, os.path.getsize(path)


def main() -> list:
    torch.set_num_threads(1)
    calls, per_call = bytes_per_call()
    calls7, grown = rss_7b()
    record, save, load, size = save_load()
    rows = [
        ("trace bytes per call (8-layer LLaMA, fw+bw)", f"{per_call:.0f} B", "<= 1024 B", f"{calls} calls"),
        ("RSS growth, LLaMA-7B fw+bw trace", f"{grown:.1f} MB", "< 50 MB", f"{calls7} calls"),
        (
            "save + load / record",
            f"{(save + load) / record:.2f}x",
            "<= 0.5x",
            f"record {record * 1e3:.0f} ms, save {save * 1e3:.0f} ms, load {load * 1e3:.0f} ms, "
            f"{size / 1024:.0f} KiB gz",
        ),
    ]
    print(table(rows, ("measure", "value", "target", "detail")))
    return rows


if __name__ == "__main__":
    main()
