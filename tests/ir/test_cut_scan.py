"""``step_from(trace, start, before=Scan(...))``: one scan of the calls before several cuts gives each cut as
``step_from`` alone makes it (ir/cut.py), on an FSDP2 run whose storages are resized before the cuts."""

import gc

import torch
from torch.distributed.fsdp import fully_shard

import metadispatch as md
from metadispatch.ir.cut import Scan, step_from


def _steps(n: int):
    """Rank 0 of 2 logical GPUs: an FSDP2 MLP, AdamW, ``n`` steps, each marked ``step i``."""
    with md.MetaMode(device="cuda", gpu="h100", world_size=2, rank=0) as mode:
        model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        for i in range(n):
            md.mark(f"step {i}")
            model(torch.ones(4 * (i + 1), 64, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
    del model, opt
    gc.collect()  # FSDP2's modules hold themselves in cycles: their deaths are recorded now, not during a cut
    return mode.trace


def _what(t) -> tuple:
    """Everything a cut decides: its calls, leaves (kind, maker, record, value), start sizes, deaths and marks,
    and what the allocator and the roofline read of it."""
    leaves = sorted((k, v.kind, v.name, v.meta, v.value) for k, v in t.leaves.items())
    calls = [(c.index, c.op, c.inputs, c.output_metas) for c in t.calls]
    fit = md.fits(t)
    return calls, leaves, t.start_bytes, t.deaths, t.marks, fit.memory.peak, fit.reserved_peak, md.runtime(t).total


def test_cut_scan_shared_across_cuts_makes_each_cut_as_step_from_alone():
    trace = _steps(4)
    starts = [trace.marks[f"step {i}"] for i in range(4)]
    resized = [c for c in trace.calls[: starts[1]] if c.op == "inductor.resize_storage_bytes_.default"]
    assert resized  # FSDP2 freed its unsharded parameters before the cuts: start_bytes is exercised
    assert step_from(trace, starts[1]).start_bytes != trace.start_bytes
    alone = [_what(step_from(trace, s)) for s in starts]
    scan = Scan(trace.calls)
    assert [_what(step_from(trace, s, scan)) for s in starts] == alone  # scanned on, cut after cut
    assert [_what(step_from(trace, s, scan)) for s in reversed(starts)] == alone[::-1]  # back: scanned again
    assert step_from(trace, starts[2], Scan(trace.calls)).leaves.keys() == step_from(trace, starts[2]).leaves.keys()
    assert len(alone[3][1]) > len(alone[0][1])  # later cuts start from more state (AdamW's moments)
