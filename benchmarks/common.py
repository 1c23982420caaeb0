"""Shared helpers for the benchmarks: timing, models, the machine line."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), Python {platform.python_version()}"
    )


def best_of(fn, repeat: int = 5, warmup: int = 1) -> float:
    """Median CPU time of ``fn()`` in seconds after ``warmup`` runs.

    CPU time of this process rather than wall time: the work is
    single-threaded (``torch.set_num_threads(1)``), so on an idle machine the
    two agree, and on a shared one CPU time is not inflated by other work.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def llama_config(layers: int = 8, hidden: int = 1024, heads: int = 16, vocab: int = 32000):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=2048,
    )


def build(model_cls, cfg, ctx):
    """``(model, input ids)``, both made under ``ctx`` (a mode or a device)."""
    with ctx:
        model = model_cls(cfg)
        ids = torch.randint(0, cfg.vocab_size, (1, 128))
    return model, ids


def train_step(model, backward: bool = True):
    """``step(ids) -> logits``: the forward, and the backward of the LM loss."""

    def step(ids):
        out = model(input_ids=ids, labels=ids if backward else None)
        if backward:
            out.loss.backward()
        return out.logits

    return step


def rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def table(rows: list[tuple], header: tuple) -> str:
    from metadispatch.analysis.tables import render

    return "\n".join(render(header, rows)[1:])  # without render's leading blank line
