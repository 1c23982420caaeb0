"""``md.plan``'s pipeline-parallel candidates: ``search={"pp": [2, 4], "pp_schedule": ["1f1b", "gpipe"]}``.

Note [Scoring a pipeline configuration]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pipeline's ranks run different programs: each holds its own stage (the
first embeds, the last holds the head and the loss) and the schedule
keeps a different number of micro-batches in flight on each.  So every
stage is traced, one rank of each -- its first rank on a ``(pp,
replicate, shard, tp)`` mesh, which holds the largest FSDP2 and TP
shards (Note [Ranks that trace alike] in cli/plan.py) -- and the
candidate's figures are the worst stage's: ``peak`` and
``reserved_peak`` the highest, ``fits`` only if every stage fits, ``why``
naming the stage that does not.  ``ranks`` holds each traced rank's
allocated peak.  The step time is ``md.runtime`` over the stages' traces
run against each other (the bubble included: Note [A pipeline's bubble
from its stages' traces] in timing/bubble.py), optimizer step and all.

The model is split as pipeline/split.py splits it (the blocks
evenly, the first stages taking one more); each stage is wrapped as
train.py wraps a model -- per-block AC, TP on each block, FSDP2 on each
block and the stage -- and stepped by the schedule over ``accum``
micro-batches of ``micro_batch`` rows (the pipeline's micro-batches are
the accumulation: one schedule step a training step).  Two steps are
traced; the second is scored.

Limits: single-stage schedules only (GPipe, 1F1B; the interleaved and
zero-bubble ones put two stages on a rank); never scaled from shallower
traces (each stage is traced in full); the default step only (the last
stage's loss is the model's causal-LM loss); models pipeline/split.py
splits.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from ..analysis.fit import fits
from ..errors import MetaDispatchError
from ..ir.cut import step_from
from ..ir.text import fmt_bytes
from ..ir.trace import Trace
from ..mode.mode import MetaMode
from ..pipeline import split as pipeline_split
from ..timing.runtime import runtime
from ..tracing.marks import mark
from .ac import apply_ac

__all__ = ["SCHEDULES", "configs", "rule", "score", "trace"]

# pp_schedule -> torch.distributed.pipelining's class
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def configs(gpus: int, global_batch: int, search: dict, keys: tuple) -> list:
    """The pipeline configurations ``search`` names (``pp`` > 1), as dicts of ``keys`` and ``pp``, ``pp_schedule``."""
    out = []
    for pp, tp in itertools.product([p for p in search.get("pp", []) if p > 1], search.get("tp", [1, 2, 4, 8])):
        dp = gpus // (pp * tp) if gpus % (pp * tp) == 0 else 0
        if not dp and "tp" not in search:
            continue  # a default tp that does not divide: not a candidate
        mbs = search.get("micro_batch", [b for b in (1, 2, 4, 8) if dp and global_batch % (dp * b) == 0])
        for shard, ac, mb, opt, schedule in itertools.product(
            search.get("shard", _divisors(dp) if dp else [1]),
            search.get("ac", ["none", "block"]),
            mbs,
            search.get("optimizer", ["foreach", "fused"]),
            search.get("pp_schedule", ["1f1b"]),
        ):
            rep = dp // shard if dp and dp % shard == 0 else 0
            accum = global_batch // (dp * mb) if dp and global_batch % (dp * mb) == 0 else 0
            out.append({**dict(zip(keys, (shard, rep, tp, ac, mb, accum, opt))), "pp": pp, "pp_schedule": schedule})
    return out


def rule(c: dict, gpus: int, global_batch: int, heads: dict) -> str | None:
    """The divisibility rule a pipeline configuration breaks, if any (``heads``: the counts TP must divide)."""
    pp, tp = c["pp"], c["tp"]
    if gpus % (pp * tp):
        return f"pp {pp} x tp {tp} does not divide {gpus} GPUs"
    dp = gpus // (pp * tp)
    if dp % c["shard"]:
        return f"shard {c['shard']} does not divide the {dp} data-parallel ranks"
    if global_batch % (dp * c["micro_batch"]):
        return f"global batch {global_batch} is not a multiple of {dp} ranks x micro-batch {c['micro_batch']}"
    if c["pp_schedule"] not in SCHEDULES:
        return f"pp_schedule {c['pp_schedule']!r}: md.plan searches {', '.join(SCHEDULES)}"
    return next((f"tp {tp} does not divide {name}={n}" for name, n in heads.items() if n % tp), None)


def score(planner, cand, tp_plan: Callable, custom_step: bool) -> None:
    """Fill ``cand`` from a trace of each stage (Note [Scoring a pipeline configuration])."""
    c = cand.config
    step = "md.plan's pipelines step the model's own loss; a step= is not split into stages"
    cand.why = rule(c, planner.gpus, planner.global_batch, planner._heads()) or (step if custom_step else None)
    if cand.why:
        return
    key = ("pp", *sorted(c.items()))
    cand.cached = key in planner.cache
    if not cand.cached:
        try:
            planner.cache[key] = _measure(planner, c, {r: trace(planner, c, tp_plan, r) for r in _ranks(planner, c)})
        except (RuntimeError, ValueError, MetaDispatchError) as e:
            # torch refusing the schedule (fewer micro-batches than it needs) or metadispatch an op: a verdict
            planner.cache[key] = f"the step raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    found = planner.cache[key]
    if isinstance(found, str):
        cand.why, cand.fits = found, False
        return
    cand.ranks = {r: peak for r, (peak, *_) in found["ranks"].items()}
    worst = max(found["ranks"].items(), key=lambda kv: kv[1][1])
    cand.peak = max(cand.ranks.values())
    cand.reserved_peak = worst[1][1]
    cand.state = max(v[4] for v in found["ranks"].values())
    cand.fits = all(v[1] <= v[2] for v in found["ranks"].values())
    cand.step_time = found["seconds"]
    cand.tokens_per_s = planner.global_batch * planner.seq / cand.step_time if cand.step_time else None
    if not cand.fits:
        rank, (_, reserved, capacity, oom, _) = next((r, v) for r, v in found["ranks"].items() if v[1] > v[2])
        at = f": first OOM at call {oom[0]} ({oom[1]})" if oom else ""
        cand.why = f"rank {rank} (stage {rank // (planner.gpus // c['pp'])}) reserves {fmt_bytes(int(reserved))} > {fmt_bytes(capacity)}{at}"


def _ranks(planner, c: dict) -> list:
    """The first rank of each stage (Note [Scoring a pipeline configuration])."""
    return [i * (planner.gpus // c["pp"]) for i in range(c["pp"])]


def _measure(planner, c: dict, traces: dict) -> dict:
    began = time.perf_counter()
    ranks, steps = {}, []
    for rank, t in traces.items():
        s, o = t.marks["step"], t.marks["opt"]
        step = step_from(t, s)
        fit = fits(step, gpu=planner.gpu, capacity=planner.capacity)
        first = fit.first_oom_call
        oom = (first.index, first.op) if first is not None else None
        ranks[rank] = (fit.memory.peak, fit.reserved_peak, fit.capacity, oom, fit.memory.timeline[o - s])
        steps.append(step)
    seconds = runtime(steps, planner.gpu).total
    planner._spend("measuring", began)
    return {"ranks": ranks, "seconds": seconds}


def trace(planner, c: dict, tp_plan: Callable, rank: int | None = None) -> Trace:
    """Rank ``rank``'s two steps of the pipeline configuration ``c`` (default: its worst stage's first rank)."""
    from torch.distributed import pipelining  # noqa: F401 -- before the mode: Note [A pipeline stage's vote]

    if rank is None:
        found = planner.cache.get(("pp", *sorted(c.items())))
        rank = max(found["ranks"], key=lambda r: found["ranks"][r][0]) if isinstance(found, dict) else 0
    began = time.perf_counter()
    dims = {"pp": c["pp"], "replicate": c["replicate"], "shard": c["shard"], "tp": c["tp"]}
    with MetaMode(device="cuda", gpu=planner.gpu, world_size=planner.gpus, rank=rank) as mode:
        mesh = init_device_mesh("cuda", tuple(dims.values()), mesh_dim_names=tuple(dims))
        index = mesh.get_local_rank("pp")
        model = planner.make_model()
        cut = pipeline_split.split(model)
        if cut.io is not None:  # an encoder's or a vision model's stages: no causal-LM loss, no (b, seq, hidden)
            raise MetaDispatchError(f"md.plan's pipelines split causal LMs, not a {type(model).__name__}")
        if cut.blocks < c["pp"]:
            raise MetaDispatchError(f"pp {c['pp']}: the model has {cut.blocks} blocks")
        size, extra = divmod(cut.blocks, c["pp"])
        lo = index * size + min(index, extra)
        mod = cut.stage(lo, lo + size + (index < extra))
        loss, hidden, vocab = cut.loss, cut.hidden, cut.vocab
        del model, cut  # the other stages' blocks: a real rank never holds them
        _wrap(mod, c, mesh, tp_plan)
        stage = _pipeline_stage(pipelining, mod, index, c, hidden, vocab, planner.seq, mesh)
        run = getattr(pipelining, SCHEDULES[c["pp_schedule"]])(stage, n_microbatches=c["accum"], loss_fn=loss)
        opt_kw: dict = {"fused": True} if c["optimizer"] == "fused" else {"foreach": True}
        opt = torch.optim.AdamW([p for p in mod.parameters() if p.requires_grad], lr=1e-4, **opt_kw)
        ids = torch.randint(0, vocab, (c["micro_batch"] * c["accum"], planner.seq), device="cuda")
        mark("built")
        for _ in range(2):
            mark("step")
            mark("micro")
            run.step(*((ids,) if stage.is_first else ()), **({"target": ids, "losses": []} if stage.is_last else {}))
            mark("opt")
            opt.step()
            opt.zero_grad()
    planner._spend("full", began)
    return mode.trace


def _wrap(mod: Any, c: dict, mesh, tp_plan: Callable) -> None:  # a stage: .layers, a ModuleList
    """Per-block AC, TP on each block, FSDP2 on each block and the stage, as train.py wraps a model."""
    if c["ac"] == "block":
        apply_ac(mod, [f"layers.{i}" for i in range(len(mod.layers))])
    if c["tp"] > 1:
        for layer in mod.layers:
            parallelize_module(layer, mesh["tp"], tp_plan(layer))
    if c["replicate"] * c["shard"] > 1:
        dp = mesh["replicate", "shard"] if c["replicate"] > 1 else mesh["shard"]
        for layer in mod.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(mod, mesh=dp)


def _pipeline_stage(pipelining, mod, index: int, c: dict, hidden: int, vocab: int, seq: int, mesh):
    """The ``PipelineStage`` of ``mod``, its activations declared (Note [A pipeline stage's vote] in world/pipeline.py)."""
    b, n = c["micro_batch"], c["pp"]
    dtype = next(mod.parameters()).dtype
    x = torch.empty(b, seq, dtype=torch.long) if index == 0 else torch.empty(b, seq, hidden, dtype=dtype)
    out = torch.empty(b, seq, vocab if index == n - 1 else hidden, dtype=dtype, requires_grad=True)
    return pipelining.PipelineStage(
        mod,
        index,
        n,
        torch.device("cuda"),
        input_args=(x.requires_grad_(index > 0),),
        output_args=(out,),
        group=mesh["pp"].get_group(),
    )


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]
