"""``metadispatch trace --world-size N``: one rank of an N-GPU training step.

The model is built, wrapped and stepped inside ``MetaMode(world_size=N,
rank=r)``: ``--fsdp`` shards every block and the root with ``fully_shard``,
``--tp K`` parallelises each block's attention and MLP (colwise, then
rowwise) over groups of K ranks (with ``--fsdp``: a 2-D mesh, FSDP over
N/K), ``--dp`` wraps the model in ``DistributedDataParallel``.  AdamW
steps twice and the second step is reported (``--optimizer``,
``--steps``: cli/steps.py).  The report is the rank's peak during the step
(building the full model first is not a cost a real run pays when it
builds on the meta device), its collectives, and whether the peak fits the
GPU.

The blocks are found in the model (Note [Finding a model's blocks] in
blocks.py) or named with ``--blocks``.  With ``--gpu`` the report adds the
reserved memory the caching allocator would hold (its simulation,
analysis/allocator.py) and the step's estimated time with its collectives
(``md.runtime``: one stream, communication not overlapped with compute).

Limits: tensor parallelism splits LLaMA-style attention and MLPs and
``fc1``/``fc2`` MLPs only; no expert or context parallelism from the
command line (``--pp`` is cli/pipeline.py's; docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ..analysis.memory import memory, step_text
from ..debug.check import guessing_mode
from ..ir.cut import step_from
from ..ir.text import fmt_bytes, render
from ..ir.trace import Trace
from ..mode.mode import MetaMode
from ..spec.profiles import gpu_profile
from ..timing.comms import comms
from ..timing.runtime import runtime
from ..tracing.marks import mark
from .blocks import COLWISE, ROWWISE, find_blocks, tp_layers
from .steps import with_optimizer
from .targets import UsageError

__all__ = [
    "Plan",
    "plan_step",
    "check_plan",
    "report",
    "param_shapes",
    "rank_classes",
    "step_peak",
    "shard_blocks",
    "split_blocks",
]

_HEAD_COUNTS = ("n_heads", "n_kv")  # the built-in LLaMA's attention; transformers' infers them


class Plan(NamedTuple):
    world_size: int
    rank: int = 0
    fsdp: bool = False
    tp: int = 1
    dp: bool = False
    blocks: str | None = None  # --blocks: the container of the blocks, else found
    known_limit: int | None = None  # the trace's known_limit (trace_cmd.py), else the mode's


def check_plan(plan: Plan) -> None:
    """Refuse what cannot work before anything is built (a usage error)."""
    if not 0 <= plan.rank < plan.world_size:
        raise UsageError(f"--rank {plan.rank}: not a rank of a world of {plan.world_size}")
    if plan.world_size % plan.tp:
        raise UsageError(f"--tp {plan.tp} does not divide --world-size {plan.world_size}")
    if plan.dp and (plan.fsdp or plan.tp > 1):
        raise UsageError("--dp combines with neither --fsdp nor --tp here; use --fsdp --tp for 2-D")
    if not (plan.fsdp or plan.dp or plan.tp > 1):
        raise UsageError("--world-size needs a parallelism: --fsdp, --tp K or --dp")


def plan_step(
    plan: Plan, build: Callable, step: Callable, device="cuda", optimizer: str = "adamw", steps: int = 2
) -> tuple[Trace, int]:
    """Trace ``plan.rank``'s step; returns the trace and the index of the last step's first call.

    ``steps`` steps run, each ``step`` then ``optimizer`` (cli/steps.py);
    the report is of the last, with what the others left (the steady
    state), and leaves out the build: marks ``"built"`` and ``"step"``.
    """
    from torch.distributed.device_mesh import init_device_mesh  # here: FSDP's import is 0.4 s a plain trace skips

    make = guessing_mode if optimizer == "adafactor" else MetaMode  # (cli/trace_cmd.py: Adafactor reads .item())
    with make(device=device, world_size=plan.world_size, rank=plan.rank) as mode:
        mode.known_limit = plan.known_limit or mode.known_limit
        model, inputs = build()
        dp = plan.world_size // plan.tp
        mesh = init_device_mesh(torch.device(device).type, (dp, plan.tp), mesh_dim_names=("dp", "tp"))
        if plan.tp > 1:
            split_blocks(model, mesh["tp"], plan.blocks)
        if plan.fsdp:
            shard_blocks(model, mesh["dp"], plan.blocks)
        if plan.dp:
            model = nn.parallel.DistributedDataParallel(model)
        stepped = with_optimizer(step, optimizer)
        mark("built")
        for _ in range(steps):
            mark("step")
            stepped(model, *inputs)
    return mode.trace, mode.trace.marks["step"]


def param_shapes(build: Callable, device="cuda", blocks: str | None = None) -> dict:
    """Each parameter's global shape and the dimension tensor parallelism
    splits (``None``: replicated), by name, from the model built (not
    wrapped) in a MetaMode."""
    with MetaMode(device=device):
        model, _ = build()
        split = {}
        for prefix, block in find_blocks(model, blocks):
            for name, how in tp_layers(block).items():
                split[f"{prefix}.{name}.weight"] = 0 if how == "colwise" else 1
                if how == "colwise":
                    split[f"{prefix}.{name}.bias"] = 0
        return {name: (tuple(p.shape), split.get(name)) for name, p in model.named_parameters()}


def rank_classes(plan: Plan, shapes: dict) -> list:
    """The world's ranks grouped by the local shape of every parameter, in rank order.

    Note [Ranks that trace alike]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Ranks whose parameters have the same local shapes run the same program:
    the same calls on the same shapes, so the same peak.  FSDP2 and DTensor
    split a dimension of size ``d`` over ``n`` ranks as ``torch.chunk`` does
    (``ceil(d / n)`` each, the last ones shorter or empty), so the shapes are
    known for every rank without tracing it; the worst rank is found by
    tracing one rank of each class -- a few, whatever the world size.  Tensor
    parallelism shards a block's colwise linears on dim 0 and its rowwise
    ones on dim 1 (their biases replicated) over ``tp``; FSDP then shards
    dim 0 of what each rank holds over the data-parallel ranks (a 2-D mesh's
    strided shards are taken to be contiguous chunks).
    """
    dp = plan.world_size // plan.tp
    classes: dict = {}
    for r in range(plan.world_size):
        i, j = divmod(r, plan.tp)
        key = tuple(_local_shape(shape, split, plan, dp, i, j) for shape, split in shapes.values())
        classes.setdefault(key, []).append(r)
    return list(classes.values())


def _local_shape(shape: tuple, dim: int | None, plan: Plan, dp: int, i: int, j: int) -> tuple:
    local = list(shape)
    if plan.tp > 1 and dim is not None and dim < len(local):
        local[dim] = _chunk(local[dim], plan.tp, j)
    if plan.fsdp and local:
        local[0] = _chunk(local[0], dp, i)
    return tuple(local)


def _chunk(d: int, n: int, k: int) -> int:
    """Rank ``k``'s share of ``d`` split over ``n`` as ``torch.chunk`` splits it."""
    c = -(-d // n)
    return max(0, min(c, d - k * c))


def step_peak(trace: Trace, start: int) -> int:
    """The rank's peak bytes during the step (from call ``start`` on)."""
    return max(memory(trace).timeline[start:], default=0)


def shard_blocks(model: nn.Module, mesh, blocks: str | None) -> None:
    """``--fsdp``: ``fully_shard`` each block over ``mesh``, then the root."""
    from torch.distributed.fsdp import fully_shard

    for _, block in find_blocks(model, blocks):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def split_blocks(model: nn.Module, mesh, blocks: str | None) -> None:
    """``--tp``: each block's attention and MLP colwise then rowwise over ``mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    found = find_blocks(model, blocks)
    if not any(tp_layers(block) for _, block in found):
        raise UsageError(
            f"--tp {tp}: no linear in {type(model).__name__}'s blocks is named as tensor parallelism "
            f"splits it ({', '.join(COLWISE)} colwise; {', '.join(ROWWISE)} rowwise)"
        )
    for _, block in found:
        plan = {
            name: ColwiseParallel() if how == "colwise" else RowwiseParallel() for name, how in tp_layers(block).items()
        }
        for name, m in block.named_modules():
            for count in _HEAD_COUNTS:
                if isinstance(getattr(m, count, None), int):
                    if getattr(m, count) % tp:
                        raise UsageError(f"--tp {tp}: {name}.{count}={getattr(m, count)} is not divisible")
                    setattr(m, count, getattr(m, count) // tp)  # each rank runs its own heads
        parallelize_module(block, mesh, plan)


def report(trace: Trace, start: int, plan: Plan, gpu: str | None, width: int | None = None, steps: int = 1) -> str:
    """The rank's peak during the step (the last of ``steps``), its collectives, and whether it fits ``gpu``."""
    step = step_from(trace, start)  # with what the build and the steps before left live from its start
    step.warmup = steps - 1
    m = memory(step)
    peak = m.peak
    lines = [f"rank {plan.rank} of {plan.world_size}: peak {fmt_bytes(peak)} during the step", f"{step_text(step)}."]
    at = m.peak_call if peak else None
    if at is not None:  # what is live then, by category (Note [Roles from the step's calls])
        rows = [(c, fmt_bytes(t[at]), f"{100 * t[at] / peak:.1f}%") for c, t in m.by_category_timeline.items() if t[at]]
        lines += render(("category", "at peak", "share"), rows, align="<>>", width=width)
    c = comms(trace, start, gpu=gpu) if gpu else comms(trace, start)
    timed = f", about {c.seconds * 1e3:.2f} ms on {gpu}'s links" if c.seconds is not None else ""
    lines.append(f"{len(c.calls)} collectives in the step, {fmt_bytes(c.bytes)} payload{timed}")
    lines.append(c.table(width=width, modules=False))
    if gpu:
        lines += ["", *_on_gpu(trace, start, peak, gpu)]
    return "\n".join(lines)


def _on_gpu(trace: Trace, start: int, peak: int, gpu: str) -> list:
    """Reserved memory (the caching allocator simulated) and the step's
    estimated time with its collectives, on ``gpu``."""
    profile = gpu_profile(gpu)
    reserved = max(memory(trace, allocator="cuda", gpu=profile).reserved_timeline[start:], default=0)
    verdict = "fits" if reserved <= profile.memory else "does NOT fit"
    r = runtime(trace, profile)
    step = sum(r.per_call[start:])
    network = sum(t for t, b in zip(r.per_call[start:], r.bound[start:]) if b == "network")
    return [
        f"{verdict} on {profile.name} ({fmt_bytes(profile.memory)}): {fmt_bytes(peak)} allocated at peak, "
        f"{fmt_bytes(reserved)} reserved by the caching allocator (simulated)",
        f"step time about {step * 1e3:.2f} ms, {network * 1e3:.2f} ms of it in collectives "
        "(md.runtime: one stream, collectives not overlapped with compute; uncalibrated)",
    ]
