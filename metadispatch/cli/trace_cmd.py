"""``metadispatch trace``: trace a model's training step and print what it would do.

The model (the built-in LLaMA, ``MODULE:CALLABLE`` or ``--hf``: targets.py)
is built under MetaMode, so nothing is allocated; the report is
``summary.report``'s, with ``md.fits`` and ``md.runtime`` for ``--gpu``.
``--world-size`` traces one rank of an N-GPU step (plan.py), ``--max-batch``
searches with ``md.max_batch``.  Files asked for are written before the
report (Note [Files before the report]).
"""

from __future__ import annotations

import errno
import os
import time

import torch

from ..analysis.fit import fits
from ..errors import MetaDispatchError
from ..ir.text import fmt_bytes
from ..mode.mode import MetaMode
from ..spec.profiles import DEFAULT_GPU, gpu_profile
from ..tensor.tensor import value_of
from ..timing.runtime import runtime as step_time
from ..values import fed
from ..values.known import DEFAULT_LIMIT
from . import options, pipeline, summary, targets
from .options import DTYPES
from .steps import OPTIMIZERS, describe, with_built_optimizer, with_optimizer
from .targets import UsageError
from .terminal import Failure, Progress, out, stage, width

__all__ = ["add_parser", "run"]


def add_parser(sub, kw: dict):
    """Register ``trace`` on the subcommands ``sub`` and return its parser."""
    t = sub.add_parser(
        "trace",
        **kw,
        help="trace a model's training step and print what it costs",
        description="Trace a model (default: built-in LLaMA-7B) without running it; "
        "print ops, FLOPs, peak memory and a per-module table.",
    )
    at_least = options.at_least
    t.add_argument("target", nargs="?", help="MODULE:CALLABLE returning (model, example inputs)")
    t.add_argument("--hf", metavar="ARCH", help="a transformers model type built from its config, e.g. llama")
    t.add_argument("--config", metavar="KEY=VALUE", action="append", help="config overrides for --hf")
    t.add_argument("--device", type=options.device, default="cuda", help="logical device (default: cuda)")
    t.add_argument("--dtype", choices=sorted(DTYPES), help="the model's dtype (built-in, default bf16, and --hf)")
    t.add_argument(
        "--amp",
        choices=("bf16", "f16"),
        help="mixed precision: the forward under torch.autocast in this dtype, float32 weights unless --dtype",
    )
    t.add_argument("--batch", type=at_least(1), help="batch size (built-in and --hf; default 1)")
    t.add_argument("--seq", type=at_least(1), help="sequence length (default 2048 built-in, 128 --hf)")
    t.add_argument("--forward-only", action="store_true", help="trace forward only")
    limit_help = "most elements a tensor made of constants keeps its values in (default 4096; --hf: the token count)"
    t.add_argument("--known-limit", type=at_least(1), metavar="N", help=limit_help)
    t.add_argument(
        "--max-batch",
        action="store_true",
        help="search for the largest batch whose step fits on --gpu (md.max_batch; built-in and --hf)",
    )
    t.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        help="the optimizer stepped after backward (default adamw; none with --forward-only)",
    )
    t.add_argument(
        "--steps",
        type=at_least(1),
        help="steps to run; the last is traced, with the state the others left "
        "(default 2 for training: the steady state; 1 with --forward-only)",
    )
    t.add_argument("--out", metavar="FILE", help="save the trace")
    t.add_argument("--perfetto", metavar="FILE", help="write a Chrome-trace/Perfetto JSON")
    t.add_argument("--plot", metavar="FILE", help="write a memory-timeline PNG (needs matplotlib)")
    t.add_argument(
        "--gpu",
        metavar="NAME",
        type=options.gpu,
        help="trace logical cuda as this GPU (h100, a100-80gb, ...; default h100), say whether the step fits on it and estimate its time",
    )
    t.add_argument(
        "--world-size", type=at_least(1), metavar="N", help="trace one rank of an N-GPU step (docs/distributed.md)"
    )
    t.add_argument("--rank", type=at_least(0), default=0, help="the rank to trace (default 0)")
    t.add_argument(
        "--worst-rank",
        action="store_true",
        help="trace one rank of each kind (uneven shards differ) and report the one that peaks highest",
    )
    t.add_argument("--fsdp", action="store_true", help="FSDP2: fully_shard every block and the root")
    t.add_argument("--tp", type=at_least(1), default=1, metavar="K", help="tensor parallelism over K ranks")
    t.add_argument("--dp", action="store_true", help="DistributedDataParallel")
    t.add_argument(
        "--blocks",
        metavar="PATH",
        help="the module whose children --fsdp/--tp wrap (e.g. transformer.h); default: found in the model",
    )
    pipeline.add_options(t)
    summary.add_report_options(t)
    return t


def run(args) -> int:
    from ..debug.check import guessing_mode
    from ..mode.mode import MetaMode
    from ..tracing.tracer import tracer

    device = args.device
    dtype = DTYPES[args.dtype] if args.dtype else None
    amp = (torch.device(device).type, DTYPES[args.amp]) if args.amp else None
    if args.config and not args.hf:
        raise UsageError("--config needs --hf")
    if args.target and args.hf:
        raise UsageError(f"give {args.target} or --hf {args.hf}, not both")
    given = [f"--{o}" for o in ("dtype", "batch", "seq") if getattr(args, o) is not None]
    if args.target and given:  # the callable makes its own model and inputs: nothing to apply them to
        raise UsageError(
            f"{', '.join(given)}: for the built-in model and --hf only; {args.target} makes its own model and inputs"
        )
    # A pipeline's default batch: one sequence a micro-batch.
    batch = args.batch if args.batch is not None else 1 if args.pp == 1 else _pipeline_plan(args).micro
    distributed = args.world_size is not None
    if not distributed and (
        args.fsdp or args.dp or args.tp > 1 or args.pp > 1 or args.rank or args.worst_rank or args.blocks
    ):
        raise UsageError("--fsdp, --tp, --pp, --dp, --rank, --worst-rank and --blocks need --world-size")
    if args.worst_rank and args.rank:
        raise UsageError("--worst-rank picks the rank; leave out --rank")
    if distributed:
        plan = _plan(args)
    for path in (args.out, args.perfetto, args.plot):
        _writable(path)
    _plottable(args.plot)

    def build(batch: int, layers: int | None = None):  # layers: md.max_batch's shallow guesses
        if args.hf:
            overrides = targets.parse_overrides(args.config)
            if layers is not None:
                overrides["num_hidden_layers"] = layers
            return targets.hf_target(
                args.hf, overrides, device, not args.forward_only, batch, args.seq, dtype, lazy=distributed, amp=amp
            )
        if args.target:
            return targets.callable_target(args.target, device, not args.forward_only, lazy=distributed, amp=amp)
        seq = args.seq if args.seq is not None else 2048
        return targets.default_target(
            device, not args.forward_only, batch, seq, lazy=distributed, dtype=dtype, amp=amp, layers=layers
        )

    optimizer, steps = _optimizer_and_steps(args)
    # Adafactor scales its update by param.norm().item(): a value no shape follows, guessed
    kind = guessing_mode if optimizer == "adafactor" else MetaMode

    def make(**options):  # the known_limit of the command's (Note [The command line's token ids are data])
        mode = kind(**options)
        mode.known_limit = _known_limit(args, batch)
        return mode

    if args.max_batch:
        return _max_batch(args, build, make, optimizer, steps)
    with Progress("building the model"), stage("building the model"):
        t = build(batch)
    if distributed and args.pp > 1:
        return _trace_pipeline(t, plan, args)
    if distributed:
        return _trace_rank(t, plan, args)
    modes: list = []  # the mode, so that the progress line can count its calls
    gpu = args.gpu if torch.device(device).type == "cuda" else None  # the profile logical cuda answers as

    run = tracer(mode_factory=lambda: modes.append(make(device=device, gpu=gpu)) or modes[-1], warmup=steps - 1)
    start = time.perf_counter()
    with Progress("tracing", lambda: len(modes[-1].trace) if modes else 0), stage("the model raised while tracing"):
        trace = run(with_optimizer(t.step, optimizer), t.model, *t.inputs)
    seconds = time.perf_counter() - start
    wrote = _exports(trace, args)  # Note [Files before the report]
    what = "forward" if args.forward_only else "forward and backward"
    if args.amp:
        what += f" under autocast ({args.amp})"
    on = f"{device} ({getattr(trace.gpu, 'name', trace.gpu)})" if trace.gpu else device
    print(f"{t.name}: {what} on {on}, {describe(optimizer, steps)}, traced in {seconds:.1f} s")
    out(summary.report(trace, top=args.top, depth=args.depth, width=width()))
    if args.gpu:
        out(fits(trace, gpu=args.gpu))
        out(step_time(trace, gpu=args.gpu))
    for line in wrote:
        print(line)
    return 0


def _max_batch(args, build, make, optimizer: str, steps: int) -> int:
    """``--max-batch``: md.max_batch over the target's batch (Note [Searching for the largest batch])."""
    from ..planning.ac import blocks
    from ..planning.batch import max_batch

    if args.target or args.world_size is not None or args.batch is not None:
        raise UsageError("--max-batch: for the built-in model and --hf on one GPU, without --batch")
    if torch.device(args.device).type != "cuda":
        raise UsageError(f"--max-batch: asks what fits on a GPU; --device {args.device} is not cuda")
    gpu = gpu_profile(args.gpu or DEFAULT_GPU)
    first = build(2)  # not 1: the batch dimension is the inputs' size-2 one
    make_step = batch_steps(build, optimizer, first, args.device)
    try:
        depth = len(blocks(first.model))
    except MetaDispatchError:  # no nn.ModuleList: nothing to build shallower
        depth = 0
    # a guess from 2 and 4 blocks where that is shallower (Note [Searching for the largest batch])
    scale = (2, 4) if depth > 4 else None
    with Progress("searching"), stage("the model raised while tracing"):
        found = max_batch(
            make_step,
            gpu,
            warmup=steps - 1,
            scale=scale,
            mode_factory=lambda: make(device=args.device, gpu=gpu),
        )
    print(f"{first.name.split(' (')[0]}: {describe(optimizer, steps)}")
    out(found)
    return 0


def batch_steps(build, optimizer: str, first, device):
    """``make_step(batch, layers=None)`` for md.max_batch: one model a depth (``first``, built at batch 2, the full
    one), its optimizer made once, each batch its inputs resized (Note [One warm-up for two batches])."""
    built: dict = {}  # layers -> (target, its step)

    def make_step(batch: int, layers: int | None = None):
        if layers not in built:
            t = first if layers is None else build(2, layers)
            built[layers] = t, with_built_optimizer(t.step, optimizer, t.model)
        t, step = built[layers]
        return step, (t.model, *_resized(t.inputs, batch, device))

    return make_step


def _resized(inputs: tuple, batch: int, device) -> tuple:
    """The built-in and ``--hf`` inputs (built at batch 2) at ``batch``: each tensor of first dimension 2, once however
    often given (LLaMA's ids are its labels too), empty on the logical device, known ids drawn again (fed.py)."""
    made: dict = {}
    with MetaMode(device=device, record=False):
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == 2 and id(x) not in made:
                ids, new = value_of(x) if x.dtype == torch.long else None, (batch, *x.shape[1:])
                made[id(x)] = x.new_empty(new) if ids is None else fed.random_ids(int(ids.max()) + 1, new)
    return tuple(made.get(id(x), x) for x in inputs)


def _known_limit(args, batch: int) -> int:
    """The trace's known_limit: ``--known-limit``, else one covering the --hf token ids (values/fed.py)."""
    return args.known_limit or max(DEFAULT_LIMIT, batch * (args.seq or 128) if args.hf else 0)


def _optimizer_and_steps(args) -> tuple:
    """``--optimizer`` and ``--steps``: a warmed AdamW step for training, one bare forward otherwise."""
    training = not args.forward_only
    optimizer = args.optimizer or ("adamw" if training else "none")
    if optimizer != "none" and not training:
        raise UsageError(f"--optimizer {optimizer}: --forward-only has no gradients to step with")
    steps = args.steps if args.steps is not None else (2 if training else 1)
    return optimizer, steps


def _worst_rank(t, plan, args) -> tuple:
    """``--worst-rank``: one rank of each class of ranks that trace alike (Note
    [Ranks that trace alike] in plan.py); prints each class's peak and
    returns the trace of the one that peaks highest."""
    from . import plan as planning

    with stage("building the model"):
        classes = planning.rank_classes(plan, planning.param_shapes(t.build, args.device, plan.blocks))
    traced = []
    for ranks in classes:
        p = plan._replace(rank=ranks[0])
        with Progress(f"tracing rank {p.rank}"), stage("the model raised while tracing"):
            trace, first = planning.plan_step(p, t.build, t.step, args.device, *_optimizer_and_steps(args))
        traced.append((planning.step_peak(trace, first), ranks, trace, first, p))
    worst = max(traced, key=lambda x: x[0])
    kinds = f"{len(classes)} kinds of rank" if len(classes) > 1 else "every rank alike"
    print(f"{kinds} by their parameters' shapes; peak during the step:")
    for peak, ranks, *_ in traced:
        mark = "  <- worst" if ranks is worst[1] else ""
        print(f"  {_ranks(ranks)}: {fmt_bytes(peak)} ({peak:,} B){mark}")
    return worst[2], worst[3], worst[4]


def _ranks(ranks: list) -> str:
    """``rank 3`` or ``ranks 0-2`` or ``ranks 0, 2, 5`` (at most six named)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    shown = ", ".join(map(str, ranks[:6]))
    return f"ranks {shown}" + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "")


def _plan(args):
    from .plan import Plan, check_plan

    plan = Plan(
        args.world_size, args.rank, args.fsdp, args.tp, args.dp, args.blocks, _known_limit(args, args.batch or 1)
    )
    if args.pp > 1:
        pipeline.check(plan, _pipeline_plan(args), args)
    else:
        check_plan(plan)
    return plan


def _pipeline_plan(args) -> pipeline.PipelinePlan:
    return pipeline.PipelinePlan(args.pp, args.pp_schedule, args.microbatches)


def _trace_pipeline(t, plan, args) -> int:
    """``--pp P``: the asked rank's stages, then one rank of every stage (cli/pipeline.py)."""
    from . import plan as planning

    pp = _pipeline_plan(args)
    traced: dict = {}
    start = time.perf_counter()
    for rank in dict.fromkeys([plan.rank, *pipeline.stage_ranks(plan, pp)]):
        with Progress(f"tracing rank {rank}"), stage("the model raised while tracing"):
            traced[rank] = pipeline.stage_step(
                plan._replace(rank=rank), pp, t.build, args.device, *_optimizer_and_steps(args)
            )
    seconds = time.perf_counter() - start
    trace, first = traced[plan.rank]
    wrote = _exports(trace, args)  # Note [Files before the report]
    how = " + ".join(x for x, on in ((f"PP {pp.pp}", True), ("FSDP", plan.fsdp), (f"TP {plan.tp}", plan.tp > 1)) if on)
    print(f"{t.name}: {how}, rank {plan.rank} of {plan.world_size} on {args.device}, traced in {seconds:.1f} s")
    out(planning.report(trace, first, plan, args.gpu, width=width(), steps=_optimizer_and_steps(args)[1]))
    stages = {r: traced[r] for r in pipeline.stage_ranks(plan, pp)}
    out("\n".join(["", *pipeline.stage_report(stages, pp, args.gpu)]))
    for line in wrote:
        print(line)
    return 0


def _trace_rank(t, plan, args) -> int:
    """``--world-size``: one rank of the distributed step (cli/plan.py)."""
    from . import plan as planning

    start = time.perf_counter()
    if args.worst_rank:
        trace, first, plan = _worst_rank(t, plan, args)
    else:
        with Progress("tracing"), stage("the model raised while tracing"):
            trace, first = planning.plan_step(plan, t.build, t.step, args.device, *_optimizer_and_steps(args))
    seconds = time.perf_counter() - start
    wrote = _exports(trace, args)  # Note [Files before the report]
    how = " + ".join(x for x, on in (("FSDP", plan.fsdp), (f"TP {plan.tp}", plan.tp > 1), ("DDP", plan.dp)) if on)
    print(f"{t.name}: {how}, rank {plan.rank} of {plan.world_size} on {args.device}, traced in {seconds:.1f} s")
    out(planning.report(trace, first, plan, args.gpu, width=width(), steps=_optimizer_and_steps(args)[1]))
    for line in wrote:
        print(line)
    return 0


# Note [Files before the report]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``metadispatch trace --out t.json.gz | head`` closes stdout after ten lines:
# the report's next print raised BrokenPipeError, which ends the command
# quietly (console()) -- and the file, written after the report, was never
# written, with exit 0.  What the user asked to be written is written first,
# as soon as the trace exists; the report and the "wrote" lines follow.  A
# file that cannot be written fails the command (exit 3) before anything
# is printed.
def _exports(trace, args) -> list:
    """Write ``--perfetto``, ``--plot`` and ``--out``; the lines that say so."""
    from ..analysis.export import save_perfetto, save_plot

    wrote = []
    for path, save, label in (
        (args.perfetto, save_perfetto, " (open in https://ui.perfetto.dev)"),
        (args.plot, save_plot, ""),
        (args.out, lambda t, p: t.save(p), ""),
    ):
        if path:
            with stage(f"could not write {path}"):
                save(trace, path)
            wrote.append(f"wrote {path}{label}")
    return wrote


def _writable(path) -> None:
    """Refuse, before minutes of building and tracing, a file that cannot be
    written for where it is: a directory, or in a folder that does not exist."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        error: OSError = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    elif not os.path.isdir(folder):
        error = FileNotFoundError(errno.ENOENT, f"no folder {folder}", path)
    else:
        return
    raise Failure(f"could not write {path}", error)


def _plottable(path) -> None:
    """Refuse, before building and tracing, a ``--plot`` that matplotlib is
    missing for or whose extension names a format it cannot write."""
    if not path:
        return
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError as e:
        error: Exception = ImportError(
            "the memory plot needs matplotlib: pip install 'metadispatch[plot]' "
            "(in a checkout of metadispatch: pip install '.[plot]')"
        )
        raise Failure(f"could not write {path}", error) from e
    suffix = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasAgg.get_supported_filetypes()
    if suffix and suffix not in formats:
        error = ValueError(f"matplotlib writes no {suffix!r} format (it writes {', '.join(sorted(formats))})")
        raise Failure(f"could not write {path}", error)
