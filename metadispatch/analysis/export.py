"""Exports: a Chrome-trace/Perfetto JSON of the calls, a PNG of memory.

A trace has no clock, so the JSON puts call ``i`` at microsecond ``i`` with
a duration of one: the timeline reads in call order, and spans for the phase
and each enclosing module wrap the runs of calls made inside them, so the
Perfetto UI (ui.perfetto.dev, or chrome://tracing) shows the module tree
as nested slices.  Each call's slice carries its inputs' and outputs'
types, its module and its FLOPs as arguments; counter tracks show live
bytes per memory category.

The plot needs matplotlib (``pip install metadispatch[plot]``).
"""

from __future__ import annotations

import json
import os

from ..ir.trace import Trace
from .flops import ancestors
from .flops import flops as count_flops
from .memory import CATEGORIES
from .memory import memory as measure

__all__ = ["chrome_trace", "save_perfetto", "save_plot"]


def _span(name: str, cat: str, ts: float, dur: float, args: dict | None = None) -> dict:
    ev = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": 0}
    if args:
        ev["args"] = args
    return ev


def _nesting(call) -> list:
    """Names of the spans that enclose a call, outermost first."""
    return [call.phase] + [m for m in ancestors(call.module) if m]


def chrome_trace(trace: Trace, flops=None, memory=None, clock=None) -> dict:
    """The trace as a Chrome trace-event dict (``json.dump`` it to a file).

    Call ``i`` spans ``clock[i]`` to ``clock[i + 1]`` (one tick a call by
    default; ``md.runtime`` passes estimated microseconds).

    >>> import torch, metadispatch as md
    >>> from metadispatch.analysis.export import chrome_trace
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> events = chrome_trace(md.trace(net, torch.ones(3, 4)))["traceEvents"]
    >>> [(e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    [('aten.t.default', 0, 1), ('aten.addmm.default', 1, 1), ('0', 0, 2), ('forward', 0, 2)]
    """
    clock = clock if clock is not None else range(len(trace.calls) + 1)
    flops = flops if flops is not None else count_flops(trace)
    memory = memory if memory is not None else measure(trace)
    events: list = []
    open_spans: list = []  # [name, start] for the enclosing phase and modules

    def close_to(depth: int, end: int) -> None:
        while len(open_spans) > depth:
            name, start = open_spans.pop()
            cat = "phase" if not open_spans else "module"
            label = name if cat == "phase" else name.rpartition(".")[2] or name
            args = {"module": name, "class": trace.modules.get(name, "")} if cat == "module" else None
            events.append(_span(label, cat, clock[start], clock[end] - clock[start], args))

    for i, call in enumerate(trace.calls):
        want = _nesting(call)
        common = 0
        while common < len(open_spans) and common < len(want) and open_spans[common][0] == want[common]:
            common += 1
        close_to(common, i)
        open_spans.extend([name, i] for name in want[common:])
        args = {
            "inputs": [m.type_str() for m in call.inputs],
            "outputs": [m.type_str() for m in call.output_metas],
            "call": f"#{i}",
            "module": call.module,
            "rule": call.rule,
        }
        if flops.per_call[i] is not None:
            args["flops"] = flops.per_call[i]
        events.append(_span(call.op, "op", clock[i], clock[i + 1] - clock[i], args))
    close_to(0, len(trace.calls))
    for i in range(len(trace.calls)):
        bytes_ = {c: memory.by_category_timeline[c][i] for c in CATEGORIES}
        events.append({"name": "live bytes", "ph": "C", "ts": clock[i], "pid": 0, "args": bytes_})
    meta = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "metadispatch trace"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "calls"}},
    ]
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ns",
        "otherData": {"calls": len(trace.calls), "flops": flops.total, "peak_bytes": memory.peak},
    }


def save_perfetto(trace: Trace, path, flops=None, memory=None) -> None:
    """Write :func:`chrome_trace` as JSON; open it in ui.perfetto.dev."""
    with open(path, "w") as f:
        json.dump(chrome_trace(trace, flops, memory), f)


def save_plot(trace: Trace, path, memory=None) -> None:
    """A PNG of live bytes per category over the calls, with the peak marked."""
    try:
        # The object API with an Agg canvas: no pyplot, so no backend switch
        # and no global figure state left behind in the user's process.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the memory plot needs matplotlib: pip install metadispatch[plot]") from e
    memory = memory if memory is not None else measure(trace)
    # The largest binary unit the peak fills at least once.
    unit, gib = next(((u, 2**e) for u, e in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if memory.peak >= 2**e), ("B", 1))
    xs = range(len(memory.timeline))
    series = [
        (c, [b / gib for b in memory.by_category_timeline[c]])
        for c in CATEGORIES
        if any(memory.by_category_timeline[c])
    ]
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if series:
        ax.stackplot(xs, *[s for _, s in series], labels=[c for c, _ in series])
    if memory.peak_call is not None:
        ax.axvline(memory.peak_call, color="k", linestyle=":", linewidth=1)
        ax.annotate(
            f"peak {memory.peak / gib:.2f} {unit}",
            (memory.peak_call, memory.peak / gib),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    ax.set_xlabel("call")
    ax.set_ylabel(f"live {unit}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    # The format from the name's extension, PNG without one -- written to
    # ``path`` itself (savefig alone would write ``path.png``).
    fig.savefig(path, format=os.path.splitext(str(path))[1][1:].lower() or "png")
