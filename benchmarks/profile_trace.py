"""Where md.trace spends its time, by stage: microseconds per aten call.

    python benchmarks/profile_trace.py            # LLaMA 8L/1024 and GPT-2, fw+bw

Each stage is a function of ours wrapped with a timer for the run (cProfile
inflates small Python functions several-fold and hid what mattered).  The
wrappers add ~0.2 us per stage entered, so the total is a little above an
unwrapped trace.  Stages nest as indented; "outside dispatch" is everything
else: the model's Python, nn.Module calls, the autograd engine, and the C++
dispatcher on its way to ``__torch_dispatch__``.
"""

from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import metadispatch as md  # noqa: E402
from benchmarks.common import build, llama_config, table, train_step  # noqa: E402
from metadispatch.core import cache, dispatch, hit, record  # noqa: E402
from metadispatch.mode import mode  # noqa: E402
from metadispatch.values import known  # noqa: E402

STAGES = [  # (label, owner, attribute); owners are patched for the run
    ("inside dispatch", mode, "dispatch"),
    ("  cache-hit path (core/hit.py)", hit, "answer_hit"),
    ("    outputs and their records (hits)", hit, "_made"),
    ("    appending a call (both paths)", record.Recorder, "append"),
    ("  converting inputs", dispatch, "_convert"),
    ("  finding the device", dispatch, "_device"),
    ("  encoding inputs (TensorMetas)", record.Recorder, "encode_inputs"),
    ("  answering (cache or router)", dispatch, "_answer"),
    ("    cache keys", cache.MetaCache, "key_from_encoded"),
    ("    rebuilding outputs from the cache (full path)", cache.MetaCache, "replay"),
    ("    meta kernels and rules (misses)", dispatch, "route"),
    ("  wrapping outputs", dispatch, "_wrap_outputs"),
    ("  known values", known, "propagate"),
    ("  recording the call", record.Recorder, "record"),
]


def _timed(fn, label: str, acc: dict):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] = acc.get(label, 0) + time.perf_counter_ns() - t0

    return wrapper


def profile(step, ids, runs: int = 5) -> list:
    md.trace(step, ids)  # warm the cache, as a test suite's second trace would
    acc: dict = {}
    saved = [(owner, name, owner.__dict__[name]) for _, owner, name in STAGES]
    try:
        for label, owner, name in STAGES:
            fn = owner.__dict__[name]
            if isinstance(fn, staticmethod):
                setattr(owner, name, staticmethod(_timed(fn.__func__, label, acc)))
            else:
                setattr(owner, name, _timed(fn, label, acc))
        t0 = time.perf_counter_ns()
        for _ in range(runs):
            calls = len(md.trace(step, ids))
        total = time.perf_counter_ns() - t0
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    per_call = lambda ns: f"{ns / runs / calls / 1e3:.1f}"  # noqa: E731
    rows = [("all of md.trace", per_call(total), "100%")]
    for label, _, _ in STAGES:
        rows.append((label, per_call(acc.get(label, 0)), f"{100 * acc.get(label, 0) / total:.0f}%"))
    outside = total - acc.get(STAGES[0][0], 0)
    rows.append(("outside dispatch (model, autograd, C++)", per_call(outside), f"{100 * outside / total:.0f}%"))
    return rows


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    torch.set_num_threads(1)
    for label, cls, cfg in [
        ("LLaMA 8L/1024 fw+bw", LlamaForCausalLM, llama_config(8)),
        ("GPT-2 fw+bw", GPT2LMHeadModel, GPT2Config()),
    ]:
        model, ids = build(cls, cfg, md.MetaMode())
        print(table(profile(train_step(model), ids), (f"stage ({label})", "us/call", "share")))
        print()


if __name__ == "__main__":
    main()
