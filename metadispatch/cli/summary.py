"""``metadispatch summary``: the report of a saved trace, and how the CLI reads a file.

``report`` is what ``trace`` prints after tracing too: ops, FLOPs, peak
memory and the module tree.  ``load`` reads a file with every check of the
loader; a logical world's file is read too, as metadata only (Note [A
logical world's file in summary]).
"""

from __future__ import annotations

from . import options
from .terminal import Progress, out, stage, width

__all__ = ["add_parser", "add_report_options", "load", "load_world", "report", "run", "WORLD_NAMESPACES"]


def add_parser(sub, kw: dict):
    """Register ``summary`` on the subcommands ``sub`` and return its parser."""
    s = sub.add_parser(
        "summary",
        **kw,
        help="print the report of a saved trace",
        description="Print ops, FLOPs, memory and modules of a saved trace.",
    )
    add_report_options(s)
    s.add_argument("file", help="a saved trace")
    return s


def add_report_options(parser) -> None:
    """``--top`` and ``--depth``: how much of the report to print (``trace`` and ``summary``)."""
    parser.add_argument("--top", type=options.at_least(1), default=10, help="ops to list (default 10)")
    parser.add_argument("--depth", type=options.at_least(0), default=2, help="module tree depth (default 2)")


def run(args) -> int:
    trace = load(args.file, reads_only=True)
    out(report(trace, top=args.top, depth=args.depth, width=width()))
    return 0


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


def load(path, *, reads_only: bool = False):
    """The trace at ``path``; ``reads_only``: also a logical world's file, for its metadata."""
    import metadispatch as md

    with Progress(f"reading {path}"), stage(f"could not read {path}"):
        try:
            return md.Trace.load(path)
        except md.TraceFormatError as e:
            if not reads_only or not any(f"'{ns}." in str(e) for ns in WORLD_NAMESPACES):
                raise
        return load_world(path)


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
WORLD_NAMESPACES = tuple(op.split("::")[0] for op in _WORLD_OPS)


def load_world(path):
    import torch.distributed.fsdp  # noqa: F401 -- defines the fsdp ops

    import metadispatch as md

    return md.Trace.load(path, allow_ops=_WORLD_OPS)
