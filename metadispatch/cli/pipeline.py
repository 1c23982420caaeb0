"""``metadispatch trace --world-size N --pp P``: a pipeline-parallel step, one rank of each stage.

The model (the built-in LLaMA, ``--hf llama``, ``--hf gpt2`` or a
``MODULE:CALLABLE`` building one) is split into contiguous runs of blocks
as torchtitan splits it (stages.py: the first stage embeds, the last
applies the final norm and the head), one ``PipelineStage`` per stage, and stepped by the
schedule ``--pp-schedule`` names over ``--microbatches`` micro-batches, on a
``(pp, dp, tp)`` mesh: ``--tp K`` splits each stage's blocks, ``--fsdp``
shards each stage over the remaining ``N / (P K)`` ranks.  Multi-stage
schedules give each rank two stages, looped (interleaved) or folded back
(V-shaped, ZBV and DualPipeV).

The report is the asked rank's (cli/plan.py's), then each stage's peak --
one rank of every stage traced, the stages' memory differs -- and, with
``--gpu``, ``md.runtime`` over those traces: the step with its bubble
(Note [A pipeline's bubble from its stages' traces] in timing/bubble.py).

Limits: only the families stages.py writes out are split -- decoders,
encoders and vision models (pipeline/families.py); others, and
encoder-decoders, are refused (build ``PipelineStage`` yourself,
docs/distributed.md); blocks are split evenly,
the first stages taking one more where they do not divide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ..ir.cut import step_from
from ..ir.text import fmt_bytes
from ..mode.mode import MetaMode
from ..tracing.marks import mark
from . import stages
from .options import at_least
from .plan import Plan, shard_blocks, split_blocks, step_peak
from .steps import with_optimizer
from .targets import UsageError

__all__ = [
    "SCHEDULES",
    "PipelinePlan",
    "add_options",
    "check",
    "stage_step",
    "run_stages",
    "stage_ranks",
    "stage_report",
]


def _looped(r: int, p: int) -> tuple:
    return (r, r + p)


def _folded(r: int, p: int) -> tuple:
    return (r, 2 * p - 1 - r)


# --pp-schedule: torch's class name, and the stages rank r of p holds (one, or two placed so).
SCHEDULES: dict[str, tuple[str, Callable | None]] = {
    "gpipe": ("ScheduleGPipe", None),
    "1f1b": ("Schedule1F1B", None),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", _looped),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", _looped),
    "zbv": ("ScheduleZBVZeroBubble", _folded),
    "dualpipev": ("ScheduleDualPipeV", _folded),
}


class PipelinePlan(NamedTuple):
    pp: int
    schedule: str = "1f1b"
    microbatches: int | None = None  # default: one per stage

    @property
    def stages(self) -> int:
        return self.pp * (1 if SCHEDULES[self.schedule][1] is None else 2)

    @property
    def micro(self) -> int:
        return self.microbatches or self.stages

    def stages_of(self, pp_rank: int) -> tuple:
        place = SCHEDULES[self.schedule][1]
        return (pp_rank,) if place is None else place(pp_rank, self.pp)


def add_options(t) -> None:
    """``--pp``, ``--pp-schedule``, ``--microbatches`` on ``trace``'s parser."""
    t.add_argument("--pp", type=at_least(1), default=1, metavar="P", help="pipeline parallelism over P stages")
    t.add_argument(
        "--pp-schedule",
        choices=tuple(SCHEDULES),
        default="1f1b",
        help="the pipeline schedule (torch.distributed.pipelining; default 1f1b)",
    )
    t.add_argument("--microbatches", type=at_least(1), metavar="M", help="micro-batches a step (default: one a stage)")


def check(plan: Plan, pp: PipelinePlan, args) -> None:
    """Refuse what a pipeline cannot run before anything is built (a usage error)."""
    if not 0 <= plan.rank < plan.world_size:
        raise UsageError(f"--rank {plan.rank}: not a rank of a world of {plan.world_size}")
    if plan.world_size % (pp.pp * plan.tp):
        raise UsageError(f"--pp {pp.pp} x --tp {plan.tp} does not divide --world-size {plan.world_size}")
    if plan.dp or args.worst_rank:
        raise UsageError("--pp combines with --fsdp and --tp; not with --dp or --worst-rank (every stage is reported)")
    if args.forward_only:
        raise UsageError("--pp: a pipeline schedule steps training; --forward-only has no backward to schedule")
    if args.batch is not None and args.batch % pp.micro:
        raise UsageError(f"--microbatches {pp.micro} does not divide --batch {args.batch}")


def _spans(n: int, parts: int) -> list:
    """``[lo, hi)`` of ``parts`` contiguous runs of ``n`` blocks, the first ones longer by one."""
    size, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + size + (i < extra)
        out.append((lo, hi))
        lo = hi
    return out


def stage_step(
    plan: Plan, pp: PipelinePlan, build: Callable, device="cuda", optimizer: str = "adamw", steps: int = 2
) -> tuple:
    """Trace ``plan.rank``'s stages under the schedule; (trace, index of the last step's first call)."""
    from torch.distributed import pipelining  # noqa: F401 -- before the mode: Note [A pipeline stage's vote]

    with MetaMode(device=device, world_size=plan.world_size, rank=plan.rank) as mode:
        mode.known_limit = plan.known_limit or mode.known_limit
        run_stages(plan, pp, build, device, optimizer, steps)
    return mode.trace, mode.trace.marks["step"]


def run_stages(plan: Plan, pp: PipelinePlan, build: Callable, device="cuda", optimizer="adamw", steps: int = 2):
    """This rank's part of the pipeline step, in the world torch.distributed is
    initialised with -- a logical one (:func:`stage_step`) or a real job's;
    returns the stages' modules."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = build()
    cut = stages.split(model, plan.blocks)
    ids, labels = inputs[0], inputs[1] if len(inputs) > 1 else inputs[0]
    if cut.blocks < pp.stages:
        raise UsageError(f"--pp {pp.pp} ({pp.stages} stages): the model has {cut.blocks} blocks")
    if ids.shape[0] % pp.micro:
        raise UsageError(f"--microbatches {pp.micro} does not divide the batch of {ids.shape[0]}")
    dp = plan.world_size // (pp.pp * plan.tp)
    mesh = init_device_mesh(torch.device(device).type, (pp.pp, dp, plan.tp), mesh_dim_names=("pp", "dp", "tp"))
    spans = _spans(cut.blocks, pp.stages)
    io = cut.io(spans, ids[: ids.shape[0] // pp.micro]) if cut.io is not None else None
    mods, held = [], []
    for index in pp.stages_of(mesh.get_local_rank("pp")):
        mod = cut.stage(*spans[index])
        if plan.tp > 1:
            split_blocks(mod, mesh["tp"], "layers")
        if plan.fsdp:
            shard_blocks(mod, mesh["dp"], "layers")
        held.append(_stage(pipelining, mod, cut, index, pp.stages, ids, pp.micro, device, mesh, io))
        mods.append(mod)
    loss = cut.loss
    del model, cut  # the other stages' blocks (cut.stage holds the model): a real rank never holds them
    kind = getattr(pipelining, SCHEDULES[pp.schedule][0])
    run = kind(held if len(held) > 1 else held[0], n_microbatches=pp.micro, loss_fn=loss)
    first, last = any(s.is_first for s in held), any(s.is_last for s in held)

    def step(_model, ids, labels):
        run.step(*((ids,) if first else ()), **({"target": labels, "losses": []} if last else {}))

    stepped = with_optimizer(step, optimizer)
    whole = nn.ModuleList(mods)
    mark("built")
    for _ in range(steps):
        mark("step")
        stepped(whole, ids, labels)
    return whole


def _stage(pipelining, mod: nn.Module, cut: stages.Split, index: int, n: int, ids, micro: int, device, mesh, io):
    """The ``PipelineStage`` of ``mod``, its activations declared (Note [A pipeline stage's vote]);
    ``io``: each stage's found on the meta device (Note [Pipeline stages of encoders and vision models])."""
    b, seq = ids.shape[0] // micro, ids.shape[1]
    dtype = next(mod.parameters()).dtype
    if io is not None:
        x, out = (torch.empty(t.shape, dtype=t.dtype) for t in io[index])
        out.requires_grad_(True)
    else:
        x = torch.empty(b, seq, dtype=torch.long) if index == 0 else torch.empty(b, seq, cut.hidden, dtype=dtype)
        out = torch.empty(b, seq, cut.vocab if index == n - 1 else cut.hidden, dtype=dtype, requires_grad=True)
    return pipelining.PipelineStage(
        mod,
        index,
        n,
        torch.device(device),
        input_args=(x.requires_grad_(index > 0),),
        output_args=(out,),
        group=mesh["pp"].get_group(),
    )


def stage_ranks(plan: Plan, pp: PipelinePlan) -> list:
    """One rank of each pipeline rank's stages: its place on the mesh's first row (dp 0, tp 0)."""
    return [i * (plan.world_size // pp.pp) for i in range(pp.pp)]


def stage_report(traces: dict, pp: PipelinePlan, gpu: str | None) -> list:
    """Each pipeline rank's stages and peak during the step; with ``gpu``, the step and its bubble."""
    from ..timing.runtime import runtime

    lines = [f"pipeline: {pp.stages} stages on {pp.pp} ranks, {pp.schedule}, per-stage peak during the step:"]
    for i, (rank, (trace, start)) in enumerate(traces.items()):
        held = ", ".join(map(str, pp.stages_of(i)))
        peak = step_peak(trace, start)
        lines.append(f"  rank {rank} (stage{'s' if ',' in held else ''} {held}): {fmt_bytes(peak)} ({peak:,} B)")
    if gpu:
        lines.append(str(runtime([step_from(t, s) for t, s in traces.values()], gpu=gpu)))
    return lines
