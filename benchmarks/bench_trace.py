"""Tracing speed: md.trace against FakeTensorMode, the meta device, a passthrough mode
and the Python floor of a recording tracer (benchmarks/floor.py).

Every figure is a ratio measured side by side in one run.  Run:

    python benchmarks/bench_trace.py
"""

from __future__ import annotations

import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import metadispatch as md  # noqa: E402
from benchmarks.common import best_of, build, llama_config, machine, table, train_step  # noqa: E402
from benchmarks.floor import FloorMode  # noqa: E402


class Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def measure(model_cls, cfg, backward: bool, repeat: int = 5, cold: bool = False) -> dict:
    """Times of one step under each tool.  Both caches are process-wide and
    warm after the first run; with ``cold`` both are cleared before every run
    (the first trace of a model in a fresh process)."""
    times = {}
    model, ids = build(model_cls, cfg, torch.device("meta"))
    step = train_step(model, backward)
    times["meta device"] = best_of(lambda: step(ids), repeat)

    def passthrough():
        with Passthrough():
            step(ids)

    times["passthrough mode"] = best_of(passthrough, repeat)

    fake = FakeTensorMode()
    fmodel, fids = build(model_cls, cfg, fake)
    fstep = train_step(fmodel, backward)

    def run_fake():
        if cold:
            FakeTensorMode.cache_clear()
        with fake:
            fstep(fids)

    times["FakeTensorMode"] = best_of(run_fake, repeat)

    mmodel, mids = build(model_cls, cfg, md.MetaMode())
    mstep = train_step(mmodel, backward)
    calls = len(md.trace(mstep, mids))

    def run_md():
        if cold:
            md.core.cache.clear()
        md.trace(mstep, mids)

    times["md.trace"] = best_of(run_md, repeat)

    floor_cache: dict = {}  # process-wide, as md's and Fake's caches are
    fl_model, fl_ids = build(model_cls, cfg, FloorMode())
    fl_step = train_step(fl_model, backward)

    def run_floor():
        if cold:
            floor_cache.clear()
        with FloorMode(floor_cache):
            fl_step(fl_ids)

    times["floor (e)"] = best_of(run_floor, repeat)
    return {"times": times, "calls": calls}


def micro(repeat: int = 200) -> list[tuple]:
    x = torch.randn(64, 64)
    img = torch.randn(8, 16, 32, 32)
    w = torch.randn(32, 16, 3, 3)
    ops = {
        "add": lambda a, b, c, d: a + b,
        "mm": lambda a, b, c, d: a @ b,
        "view": lambda a, b, c, d: a.view(-1),
        "transpose": lambda a, b, c, d: a.transpose(0, 1),
        "conv2d": lambda a, b, c, d: torch.nn.functional.conv2d(c, d),
        "softmax": lambda a, b, c, d: torch.softmax(a, -1),
    }
    rows = []
    fake = FakeTensorMode()
    fa, fb, fc, fd = (fake.from_tensor(t) for t in (x, x, img, w))
    mode = md.MetaMode()
    ma, mb, mc, md_ = (mode.from_tensor(t) for t in (x, x, img, w))
    for name, op in ops.items():

        def run_fake(op=op):
            with fake:
                for _ in range(repeat):
                    op(fa, fb, fc, fd)

        def run_md(op=op):
            with md.MetaMode():
                for _ in range(repeat):
                    op(ma, mb, mc, md_)

        tf, tm = best_of(run_fake, 5) / repeat, best_of(run_md, 5) / repeat
        rows.append((name, f"{tm * 1e6:.1f} us", f"{tf * 1e6:.1f} us", f"{tm / tf:.2f}x"))
    return rows


def scale(layers=(8, 16, 32), repeat: int = 3) -> list[tuple]:
    """md.trace time per call on deeper models: flat means linear in calls."""
    from transformers import LlamaForCausalLM

    rows = []
    for n in layers:
        model, ids = build(LlamaForCausalLM, llama_config(n), md.MetaMode())
        step = train_step(model, True)
        calls = len(md.trace(step, ids))
        t = best_of(lambda step=step, ids=ids: md.trace(step, ids), repeat)
        rows.append((f"LLaMA {n}L/1024 fw+bw", calls, f"{t * 1e3:.0f} ms", f"{t / calls * 1e6:.1f} us"))
    return rows


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    torch.set_num_threads(1)
    print(machine())
    print()
    rows = []
    cases = [
        ("LLaMA 8L/1024 fw+bw", LlamaForCausalLM, llama_config(8), True, False),
        ("LLaMA 8L/1024 fw", LlamaForCausalLM, llama_config(8), False, False),
        ("GPT-2 (defaults) fw+bw", GPT2LMHeadModel, GPT2Config(), True, False),
        ("LLaMA 8L/1024 fw+bw, cold", LlamaForCausalLM, llama_config(8), True, True),
        ("GPT-2 fw+bw, cold", GPT2LMHeadModel, GPT2Config(), True, True),
    ]
    for label, cls, cfg, backward, cold in cases:
        r = measure(cls, cfg, backward, cold=cold)
        t = r["times"]
        rows.append(
            (
                label,
                r["calls"],
                *(f"{t[k] * 1e3:.0f} ms" for k in t),
                f"{t['md.trace'] / r['calls'] * 1e6:.1f} us",
                f"{t['md.trace'] / t['FakeTensorMode']:.2f}x",
                f"{t['md.trace'] / t['floor (e)']:.2f}x",
            )
        )
    head = ("model", "calls", "meta", "passthrough", "FakeTensorMode", "md.trace", "floor (e)", "md per call")
    print(table(rows, (*head, "md/Fake", "md/floor")))
    print()
    print(table(micro(), ("op", "MetaMode", "FakeTensorMode", "ratio")))
    print()
    print(table(scale(), ("model", "calls", "md.trace", "per call")))


if __name__ == "__main__":
    main()
