"""The command line: ``python -m metadispatch`` (installed as ``metadispatch``).

``trace`` builds a model under MetaMode (nothing is allocated), traces a
training step and prints what it would do: ops, FLOPs, peak memory and a
per-module table.  ``summary``, ``replay`` and ``check`` work on saved traces
and models with the tools other modules provide.  Tables fit the terminal;
a progress line shows on a terminal only, once building, tracing,
checking, reading or replaying takes more than a second.

Every error is one line on stderr (and a hint where one helps); ``--debug``
adds the traceback.  Exit codes: see ``EXIT_CODES`` (and ``docs/cli.md``).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import gc
import os
import shutil
import sys
import threading
import time
import traceback

import torch

from .. import _compat
from ..analysis.fit import fits
from ..errors import MetaDispatchError
from ..ir.text import fmt_bytes, printable
from ..spec.profiles import DEFAULT_GPU, gpu_profile
from ..timing.runtime import runtime as step_time
from . import planner, serve, targets
from .steps import OPTIMIZERS, describe, with_optimizer
from .targets import UsageError

__all__ = ["main", "EXIT_CODES"]

EXIT_CODES = """exit codes:
  0  success
  1  findings: replay mismatches, check problems
  2  usage errors: a bad argument, option or --config key
  3  failures to run: a missing, unreadable or corrupt file, an unknown module,
     a model that raised, an --out/--perfetto/--plot file that could not be written
  130  interrupted (Ctrl-C)"""

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class _Progress:
    """``label: N calls`` redrawn on stderr while a model builds or a trace
    grows; on a terminal only, and only after the first second."""

    DELAY = 1.0

    def __init__(self, label: str, count=None, stream=None) -> None:
        self.label, self.count = label, count
        self.stream = stream or sys.stderr
        self.on = self.stream.isatty()
        self._stop = threading.Event()
        self._shown = False

    def __enter__(self):
        if self.on:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        if self._stop.wait(self.DELAY):
            return
        while True:
            text = self.label + (f": {self.count()} calls" if self.count is not None else "...")
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
            self._shown = True
            if self._stop.wait(0.1):
                return

    def __exit__(self, *exc) -> None:
        if self.on:
            self._stop.set()
            self._thread.join()
            if self._shown:
                self.stream.write("\r\033[K")
                self.stream.flush()


def _out(text) -> None:
    """Print ``text`` with control characters escaped: a trace file's strings
    (module names) may hold terminal escape codes."""
    print(printable(str(text), keep="\n"))


def _width() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def report(trace, *, top: int = 10, depth: int = 2, width: int | None = None) -> str:
    """Ops, FLOPs, peak memory and the module tree, as the CLI prints them."""
    from ..analysis.flops import flops, fmt_count
    from ..analysis.memory import memory
    from ..analysis.tables import module_table, render

    f, m = flops(trace), memory(trace)
    calls: dict = {}
    for call in trace.calls:
        calls[call.op] = calls.get(call.op, 0) + 1
    ops = sorted(calls, key=lambda op: (-f.by_op.get(op, 0), -calls[op], op))[:top]
    phases = {p: sum(1 for c in trace.calls if c.phase == p) for p in ("forward", "backward", "optimizer")}
    lines = [
        f"{len(trace.calls)} calls ("
        + ", ".join(f"{n} {p}" for p, n in phases.items() if n)
        + f"), {len(calls)} distinct ops"
    ]
    rows = [(op, calls[op], fmt_count(f.by_op[op]) if op in f.by_op else "-") for op in ops]
    lines += render(("op", "calls", "FLOPs"), rows, width=width)
    lines += ["", str(f).split("\n")[0] + _zero_flops(f)]
    lines += ["", str(m), module_table(trace, f, m, depth=depth, width=width)]
    return "\n".join(lines)


def _zero_flops(f) -> str:
    """The ops without a FLOP formula, said as what they are: counted as 0, as FlopCounterMode counts them."""
    if not f.uncounted:
        return ""
    calls = sum(f.uncounted.values())
    return (
        f"; {len(f.uncounted)} other ops ({calls:,} calls: views, copies, elementwise ops) count 0 FLOPs, "
        "as in FlopCounterMode, which counts matmuls, convolutions and attention"
    )


def _cmd_trace(args) -> int:
    from ..debug.check import guessing_mode
    from ..mode.mode import MetaMode
    from ..tracing.tracer import tracer

    device = args.device
    dtype = _DTYPES[args.dtype] if args.dtype else None
    amp = (torch.device(device).type, _DTYPES[args.amp]) if args.amp else None
    if args.config and not args.hf:
        raise UsageError("--config needs --hf")
    if args.target and args.hf:
        raise UsageError(f"give {args.target} or --hf {args.hf}, not both")
    given = [f"--{o}" for o in ("dtype", "batch", "seq") if getattr(args, o) is not None]
    if args.target and given:  # the callable makes its own model and inputs: nothing to apply them to
        raise UsageError(
            f"{', '.join(given)}: for the built-in model and --hf only; {args.target} makes its own model and inputs"
        )
    batch = args.batch if args.batch is not None else 1
    distributed = args.world_size is not None
    if not distributed and (args.fsdp or args.dp or args.tp > 1 or args.rank or args.worst_rank or args.blocks):
        raise UsageError("--fsdp, --tp, --dp, --rank, --worst-rank and --blocks need --world-size")
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
    make = guessing_mode if optimizer == "adafactor" else MetaMode
    if args.max_batch:
        return _max_batch(args, build, make, optimizer, steps)
    with _Progress("building the model"), _stage("building the model"):
        t = build(batch)
    if distributed:
        return _trace_rank(t, plan, args)
    modes: list = []  # the mode, so that the progress line can count its calls
    gpu = args.gpu if torch.device(device).type == "cuda" else None  # the profile logical cuda answers as
    run = tracer(mode_factory=lambda: modes.append(make(device=device, gpu=gpu)) or modes[-1], warmup=steps - 1)
    start = time.perf_counter()
    with _Progress("tracing", lambda: len(modes[-1].trace) if modes else 0), _stage("the model raised while tracing"):
        trace = run(with_optimizer(t.step, optimizer), t.model, *t.inputs)
    seconds = time.perf_counter() - start
    wrote = _exports(trace, args)  # Note [Files before the report]
    what = "forward" if args.forward_only else "forward and backward"
    if args.amp:
        what += f" under autocast ({args.amp})"
    on = f"{device} ({getattr(trace.gpu, 'name', trace.gpu)})" if trace.gpu else device
    print(f"{t.name}: {what} on {on}, {describe(optimizer, steps)}, traced in {seconds:.1f} s")
    _out(report(trace, top=args.top, depth=args.depth, width=_width()))
    if args.gpu:
        _out(fits(trace, gpu=args.gpu))
        _out(step_time(trace, gpu=args.gpu))
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

    def make_step(batch: int, layers: int | None = None):
        t = build(batch, layers)
        return with_optimizer(t.step, optimizer), (t.model, *t.inputs)

    first = build(1)
    try:
        depth = len(blocks(first.model))
    except MetaDispatchError:  # no nn.ModuleList: nothing to build shallower
        depth = 0
    # a guess from 2 and 4 blocks where that is shallower (Note [Searching for the largest batch])
    scale = (2, 4) if depth > 4 else None
    with _Progress("searching"), _stage("the model raised while tracing"):
        found = max_batch(
            make_step, gpu, warmup=steps - 1, scale=scale, mode_factory=lambda: make(device=args.device, gpu=gpu)
        )
    print(f"{first.name.split(' (')[0]}: {describe(optimizer, steps)}")
    _out(found)
    return 0


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

    with _stage("building the model"):
        classes = planning.rank_classes(plan, planning.param_shapes(t.build, args.device, plan.blocks))
    traced = []
    for ranks in classes:
        p = plan._replace(rank=ranks[0])
        with _Progress(f"tracing rank {p.rank}"), _stage("the model raised while tracing"):
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

    plan = Plan(args.world_size, args.rank, args.fsdp, args.tp, args.dp, args.blocks)
    check_plan(plan)
    return plan


def _trace_rank(t, plan, args) -> int:
    """``--world-size``: one rank of the distributed step (cli/plan.py)."""
    from . import plan as planning

    start = time.perf_counter()
    if args.worst_rank:
        trace, first, plan = _worst_rank(t, plan, args)
    else:
        with _Progress("tracing"), _stage("the model raised while tracing"):
            trace, first = planning.plan_step(plan, t.build, t.step, args.device, *_optimizer_and_steps(args))
    seconds = time.perf_counter() - start
    wrote = _exports(trace, args)  # Note [Files before the report]
    how = " + ".join(x for x, on in (("FSDP", plan.fsdp), (f"TP {plan.tp}", plan.tp > 1), ("DDP", plan.dp)) if on)
    print(f"{t.name}: {how}, rank {plan.rank} of {plan.world_size} on {args.device}, traced in {seconds:.1f} s")
    _out(planning.report(trace, first, plan, args.gpu, width=_width(), steps=_optimizer_and_steps(args)[1]))
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
            with _stage(f"could not write {path}"):
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
    raise _Failure(f"could not write {path}", error)


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
        raise _Failure(f"could not write {path}", error) from e
    suffix = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasAgg.get_supported_filetypes()
    if suffix and suffix not in formats:
        error = ValueError(f"matplotlib writes no {suffix!r} format (it writes {', '.join(sorted(formats))})")
        raise _Failure(f"could not write {path}", error)


class _Failure(Exception):
    """A failure to run (exit 3): what was being done, and the exception."""

    def __init__(self, doing: str, error: BaseException) -> None:
        super().__init__(doing)
        self.doing, self.error = doing, error


class _stage:
    """Turn any exception but a usage error into a :class:`_Failure` saying what was being done."""

    def __init__(self, doing: str) -> None:
        self.doing = doing

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, (UsageError, _Failure, KeyboardInterrupt)) or not isinstance(exc, Exception):
            return False
        raise _Failure(self.doing, exc) from exc


def _load(path, *, reads_only: bool = False):
    import metadispatch as md

    with _Progress(f"reading {path}"), _stage(f"could not read {path}"):
        try:
            return md.Trace.load(path)
        except md.TraceFormatError as e:
            if not reads_only or not any(f"'{ns}." in str(e) for ns in _WORLD_NAMESPACES):
                raise
        return _load_world(path)


# Note [A logical world's file in summary]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``metadispatch trace --world-size N --out f`` writes a rank's trace with
# the collectives and FSDP ops it recorded; loading refuses ops outside aten
# unless allowed (Note [Ops a file may name] in ir/decode.py), because replay
# runs them, and the ``fsdp`` ops exist only once torch.distributed.fsdp is
# imported.  ``summary`` runs no op: it reads metadata.  So where a file names
# an op of these namespaces, summary imports torch.distributed.fsdp -- a
# module of our choosing, not the file's -- and allows the file's ops of
# these namespaces only; every other check of the loader holds.  ``replay``
# keeps refusing them: a rank's trace replays in a real job, with a process
# group (docs/distributed.md).
# every op of the first three namespaces; of inductor's, the storage resize FSDP uses
_WORLD_OPS = ("c10d::*", "_c10d_functional::*", "fsdp::*", "inductor::resize_storage_bytes_")
_WORLD_NAMESPACES = tuple(op.split("::")[0] for op in _WORLD_OPS)


def _load_world(path):
    import torch.distributed.fsdp  # noqa: F401 -- defines the fsdp ops

    import metadispatch as md

    return md.Trace.load(path, allow_ops=_WORLD_OPS)


def _load_for_replay(path):
    """The trace at ``path``, refused with what to do instead where it is one rank of a logical world.

    A world's file names collective and FSDP ops, which the loader refuses
    ("unknown op"); it is read again the way ``summary`` reads it only to say
    what the file is -- the trace replay runs is the one loaded with every
    check (Note [A logical world's file in summary]).
    """
    import metadispatch as md

    try:
        trace = _load(path)
    except _Failure as failure:
        error = failure.error
        if not isinstance(error, md.TraceFormatError) or not any(f"'{ns}." in str(error) for ns in _WORLD_NAMESPACES):
            raise
        with _stage(f"could not read {path}"):
            world = _load_world(path).world
        if world is None:
            raise
        raise UsageError(_world_refusal(path, *world)) from None
    if trace.world is not None:
        raise UsageError(_world_refusal(path, *trace.world))
    return trace


def _world_refusal(path, size: int, rank: int) -> str:
    return (
        f"{path} is rank {rank} of a logical world of {size} ranks (metadispatch trace "
        f"--world-size {size}): its collectives exchange data with the other ranks, which one process "
        f"does not have, so it cannot be replayed here. Instead: 'metadispatch summary {path}' reads its "
        "memory, FLOPs and collectives; to check the step's values on real kernels, trace it without "
        "--world-size and replay that file; or replay each rank's trace with md.replay in that rank's "
        f"process of a real {size}-process job (docs/distributed.md)"
    )


def _cmd_summary(args) -> int:
    trace = _load(args.file, reads_only=True)
    _out(report(trace, top=args.top, depth=args.depth, width=_width()))
    return 0


def _cmd_replay(args) -> int:
    import metadispatch as md

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here; replay on --device cpu")
    trace = _load_for_replay(args.file)
    with _Progress("replaying"), _stage("replay failed"):
        # A file holds no weights or inputs: replay makes them up and checks
        # every call's metadata; the output lists what was made up.
        result = md.replay(trace, device=args.device, allow_made_up=True)
    _out(result)
    return 0 if result.ok else 1


def _cmd_check(args) -> int:
    from ..debug.check import checker
    from ..values.realrun import DEFAULT_LIMIT

    device = torch.device(args.device) if args.device is not None else None
    if device is not None and device.type != "cpu" and not args.no_recheck:
        raise UsageError(
            f"--device {args.device}: check re-runs every call on the CPU, which is no "
            f"reference for {args.device}; add --no-recheck to trace on logical "
            f"{args.device} without re-checking"
        )
    cuda = device is not None and device.type == "cuda"
    if args.gpu and not cuda:
        raise UsageError("--gpu needs --device cuda (it names the GPU logical cuda answers as)")
    gpu = (args.gpu or DEFAULT_GPU) if cuda else None
    limit = args.limit if args.limit is not None else DEFAULT_LIMIT
    with _Progress("building the model"), _stage("building the model"):
        model, inputs = targets.model_and_inputs(args.target, targets.load_callable(args.target)())
    run = checker(args.device, limit=limit, recheck_calls=not args.no_recheck, gpu=gpu)
    # A model that stops is a finding (exit 1), not a failure to run: the
    # report says where it stopped and why.
    with _Progress("checking"):
        report = run(model, *inputs)
    print(f"{args.target}: checked on {args.device or 'cpu'}" + (f" ({gpu})" if gpu else ""))
    _out(report)
    return 0 if report.ok else 1


def _gpu(text: str) -> str:
    # Checked before anything is built: an unknown name is a usage error (exit 2).
    try:
        return gpu_profile(text).name
    except MetaDispatchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _device(text: str) -> str:
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    return text


class _Version(argparse.Action):
    """``--version``: read from the installed metadata only when asked (start-up stays cheap)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import metadispatch

        print(f"metadispatch {metadispatch.__version__} (torch {torch.__version__})")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse, with one line (and a hint) for a usage error instead of the usage text."""

    def error(self, message: str):
        hint = _suggestion(self, message) or f"see {self.prog} --help"
        sys.stderr.write(f"{self.prog}: error: {message}\n  ({hint})\n")
        sys.exit(2)


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``did you mean --out?`` for a mistyped option or command (argparse before 3.12 suggests none)."""
    if message.startswith("unrecognized arguments: "):
        typed = [a.split("=")[0] for a in message.split(": ", 1)[1].split() if a.startswith("-")]
        known = _options(parser)
    elif message.startswith("argument command: invalid choice: "):
        typed = [message.split("'")[1]] if message.count("'") >= 2 else []
        known = sorted(_commands(parser))
    else:
        return ""
    for word in typed:
        close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
        if close:
            return f"did you mean {close[0]}? see {parser.prog} --help"
    return ""


def _commands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _options(parser: argparse.ArgumentParser) -> list:
    """Every option string of ``parser`` and its commands (argparse reports unknown options at the top)."""
    out = {o for a in parser._actions for o in a.option_strings}
    for sub in _commands(parser).values():
        out.update(o for a in sub._actions for o in a.option_strings)
    return sorted(out)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="metadispatch",
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.add_argument("--version", action=_Version, help="print metadispatch's and torch's versions and exit")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error"
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    kw = {"parents": [common], "epilog": EXIT_CODES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    t = sub.add_parser(
        "trace",
        **kw,
        help="trace a model's training step and print what it costs",
        description="Trace a model (default: built-in LLaMA-7B) without running it; "
        "print ops, FLOPs, peak memory and a per-module table.",
    )
    t.add_argument("target", nargs="?", help="MODULE:CALLABLE returning (model, example inputs)")
    t.add_argument("--hf", metavar="ARCH", help="a transformers model type built from its config, e.g. llama")
    t.add_argument("--config", metavar="KEY=VALUE", action="append", help="config overrides for --hf")
    t.add_argument("--device", type=_device, default="cuda", help="logical device (default: cuda)")
    t.add_argument("--dtype", choices=sorted(_DTYPES), help="the model's dtype (built-in, default bf16, and --hf)")
    t.add_argument(
        "--amp",
        choices=("bf16", "f16"),
        help="mixed precision: the forward under torch.autocast in this dtype, float32 weights unless --dtype",
    )
    t.add_argument("--batch", type=_at_least(1), help="batch size (built-in and --hf; default 1)")
    t.add_argument("--seq", type=_at_least(1), help="sequence length (default 2048 built-in, 128 --hf)")
    t.add_argument("--forward-only", action="store_true", help="trace forward only")
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
        type=_at_least(1),
        help="steps to run; the last is traced, with the state the others left "
        "(default 2 for training: the steady state; 1 with --forward-only)",
    )
    t.add_argument("--out", metavar="FILE", help="save the trace")
    t.add_argument("--perfetto", metavar="FILE", help="write a Chrome-trace/Perfetto JSON")
    t.add_argument("--plot", metavar="FILE", help="write a memory-timeline PNG (needs matplotlib)")
    t.add_argument(
        "--gpu",
        metavar="NAME",
        type=_gpu,
        help="trace logical cuda as this GPU (h100, a100-80gb, ...; default h100), say whether the step fits on it and estimate its time",
    )
    t.add_argument(
        "--world-size", type=_at_least(1), metavar="N", help="trace one rank of an N-GPU step (docs/distributed.md)"
    )
    t.add_argument("--rank", type=_at_least(0), default=0, help="the rank to trace (default 0)")
    t.add_argument(
        "--worst-rank",
        action="store_true",
        help="trace one rank of each kind (uneven shards differ) and report the one that peaks highest",
    )
    t.add_argument("--fsdp", action="store_true", help="FSDP2: fully_shard every block and the root")
    t.add_argument("--tp", type=_at_least(1), default=1, metavar="K", help="tensor parallelism over K ranks")
    t.add_argument("--dp", action="store_true", help="DistributedDataParallel")
    t.add_argument(
        "--blocks",
        metavar="PATH",
        help="the module whose children --fsdp/--tp wrap (e.g. transformer.h); default: found in the model",
    )
    for q in (
        t,
        s := sub.add_parser(
            "summary",
            **kw,
            help="print the report of a saved trace",
            description="Print ops, FLOPs, memory and modules of a saved trace.",
        ),
    ):
        q.add_argument("--top", type=_at_least(1), default=10, help="ops to list (default 10)")
        q.add_argument("--depth", type=_at_least(0), default=2, help="module tree depth (default 2)")
    s.add_argument("file", help="a saved trace")
    r = sub.add_parser(
        "replay",
        **kw,
        help="run a saved trace for real and verify it",
        description="Replay a saved trace on a real device and check every result.",
    )
    r.add_argument("file", help="a saved trace")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    c = sub.add_parser(
        "check",
        **kw,
        help="trace past unsupported ops and compare with the real kernels",
        description="Run md.check on MODULE:CALLABLE's (model, inputs) and print the "
        "report; exit 1 when it finds anything.",
    )
    c.add_argument("target", help="MODULE:CALLABLE returning (model, example inputs)")
    c.add_argument("--device", type=_device, default=None, help="logical device for factories (e.g. cuda)")
    c.add_argument(
        "--limit", type=_at_least(0), default=None, help="bytes of real inputs one call may materialise (default 1 GiB)"
    )
    c.add_argument("--no-recheck", action="store_true", help="skip the CPU re-check of every call")
    c.add_argument("--gpu", metavar="NAME", type=_gpu, help="the GPU logical cuda answers as (default h100)")
    serve.add_parser(sub, kw, _gpu, _at_least).set_defaults(run=lambda args: serve.run(args, _Progress, _stage))
    planner.add_parser(sub, kw, _gpu, _at_least).set_defaults(run=lambda args: planner.run(args, _Progress, _stage))
    t.set_defaults(run=_cmd_trace)
    s.set_defaults(run=_cmd_summary)
    r.set_defaults(run=_cmd_replay)
    c.set_defaults(run=_cmd_check)
    return p


def console() -> int:
    """The ``metadispatch`` program: :func:`main` in a process of its own.

    Only here, never in :func:`main` (which tests and users call in their
    own process), torch's reference kernels skip their dynamo import: Note
    [Reference kernels without dynamo in the command line].
    """
    _compat.skip_dynamo_in_reference_kernels()
    # Note [A command line that owns its heap]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # What torch built at import (about a million objects) lives until the process ends, so the cyclic
    # collector need not walk it again during the step, nor in the three
    # full collections of interpreter shutdown (~0.5 s of ``metadispatch
    # trace`` on 2 cores).  Frozen objects are freed by the exit itself;
    # atexit handlers, thread joins and flushes still run.  Only here: in
    # the user's process this would keep their garbage alive.
    gc.freeze()
    # MODULE:CALLABLE names the user's own modules, from where they stand, as
    # ``python -m`` would find them; an installed script's path lacks ".".
    sys.path.insert(0, os.getcwd())
    try:
        return main()
    except BrokenPipeError:
        # ``metadispatch summary t.json | head``: the reader has what it
        # wanted.  Point stdout at nothing, so that flushing it at exit does
        # not raise again, and stop as ``head`` would leave a writer.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        gc.freeze()  # and what the step built (see the Note above)


def main(argv=None) -> int:
    """Run the command line; returns the exit code (see ``EXIT_CODES``)."""
    args = _parser().parse_args(argv)
    prog = f"metadispatch {args.command}"
    try:
        return args.run(args)
    except UsageError as e:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"{prog}: error: {printable(str(e), keep=chr(10))}\n  (see {prog} --help)", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # stdout's reader went away: nothing to say, nowhere to say it (console())
    except Exception as e:  # a failure to run: one line, the traceback only with --debug
        if getattr(args, "debug", False):
            traceback.print_exc()
        doing, error = (e.doing, e.error) if isinstance(e, _Failure) else ("failed", e)
        print(f"{prog}: {doing}: {_one_line(error, doing)}", file=sys.stderr)
        if not getattr(args, "debug", False):
            print("  (run with --debug for the traceback)", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # Ctrl-C: the shell's code for SIGINT, and no traceback
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _one_line(error: BaseException, doing: str = "") -> str:
    """``FileNotFoundError: No such file or directory: 'w.pt'``, and where the
    user's code raised it; the file is left out where ``doing`` names it."""
    from ..source import traceback_frame

    if isinstance(error, OSError) and error.strerror:
        text = f"{type(error).__name__}: {error.strerror}"
        if error.filename is not None and str(error.filename) not in doing:
            text += f": {str(error.filename)!r}"  # a model's missing data file, a MODULE:CALLABLE's .py
    else:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [""]
        # "Validation error for field 'x':" says what, its next line why.
        first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
        text = f"{type(error).__name__}: {first}"
    where = None if isinstance(error, ImportError) else traceback_frame(error.__traceback__)
    # Messages quote trace files (names, keys): escaped like everything printed.
    return printable(text + (f" (at {where})" if where else ""))
