"""Tables a trace answers: plain-text rendering, the per-module tree, the shape log.

Every table here is deterministic (sorted, no addresses) and renders as
aligned plain text; ``width`` shortens the first column so that a table fits
a terminal (the command line passes the terminal's width, tests pass none).
"""

from __future__ import annotations

from collections import Counter

from .trace import Trace

__all__ = ["render", "module_table", "shape_log", "ShapeLog"]


def render(headers: tuple, rows: list, align: str = "", width: int | None = None) -> list[str]:
    """Rows of strings as aligned lines, a blank line and a rule first.

    ``align`` has one ``<`` or ``>`` per column (default: first left, rest
    right).  With ``width``, the first column is cut (ending in ``~``), down
    to 8 characters, and then columns dropped from the right, so that no
    line is longer.

    >>> print("\\n".join(render(("op", "calls"), [("aten.mm.default", "12")])))
    <BLANKLINE>
    op               calls
    ---------------  -----
    aten.mm.default     12
    """
    align = align or "<" + ">" * (len(headers) - 1)
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    if width is not None:
        while len(widths) > 1 and 8 + sum(widths[1:]) + 2 * (len(widths) - 1) > width:
            widths.pop()
        rest = sum(widths[1:]) + 2 * (len(widths) - 1)
        widths[0] = max(8, min(widths[0], width - rest))

    def line(cells):
        cells = cells[:len(widths)]
        out = []
        for c, w, a in zip(cells, widths, align):
            c = c if len(c) <= w else c[:w - 1] + "~"
            out.append(f"{c:<{w}}" if a == "<" else f"{c:>{w}}")
        return "  ".join(out).rstrip()

    return ["", line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _module_order(trace: Trace) -> list[str]:
    """Every module that ran (and its ancestors), parents before children,
    in the order they first ran."""
    seen: dict = {"": None}
    for call in trace.calls:
        if call.module not in seen:
            parts = call.module.split(".")
            for i in range(1, len(parts) + 1):
                seen.setdefault(".".join(parts[:i]), None)
    for name in trace.modules:
        seen.setdefault(name, None)
    return sorted(seen, key=_tree_key(list(seen)))


def _tree_key(order: list):
    first = {name: i for i, name in enumerate(order)}

    def key(name: str):
        parts = name.split(".") if name else []
        return tuple(first.get(".".join(parts[:i + 1]), 0) for i in range(len(parts)))

    return key


def module_table(trace: Trace, flops=None, memory=None, depth: int | None = None,
                 width: int | None = None) -> str:
    """Per module (inclusive of its children): calls and FLOPs in forward and
    backward, parameter bytes and the activation bytes it holds at the peak.

    >>> import torch, metadispatch as md
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    >>> print(md.module_table(md.trace(lambda x: net(x).sum().backward(), torch.ones(2, 4))))
    <BLANKLINE>
    module              fw calls  bw calls  fw FLOPs  bw FLOPs  params  act@peak
    ------------------  --------  --------  --------  --------  ------  --------
    <top> (Sequential)         6        11       128       128    160B        8B
      0 (Linear)               2         8       128       128    160B        0B
      1 (ReLU)                 2         2         0         0      0B        0B
    """
    from .flops import fmt_count
    from .flops import flops as count_flops
    from .memory import fmt_bytes
    from .memory import memory as measure

    flops = flops if flops is not None else count_flops(trace)
    memory = memory if memory is not None else measure(trace)
    stats: dict = {}
    for call, n in zip(trace.calls, flops.per_call):
        for m in _ancestors(call.module):
            s = stats.setdefault(m, Counter())
            bw = "bw" if call.phase == "backward" else "fw"
            s[bw + " calls"] += 1
            s[bw + " FLOPs"] += n or 0
    for info in memory.storages.values():
        for m in _ancestors(info.module):
            s = stats.setdefault(m, Counter())
            if info.category == "params":
                s["params"] += info.allocated
            elif info.category == "activations" and info in memory.live_at_peak:
                s["act@peak"] += info.allocated
    rows = []
    for name in _module_order(trace):
        level = name.count(".") + 1 if name else 0
        if depth is not None and level > depth:
            continue
        s = stats.get(name, Counter())
        label = "<top>" if not name else "  " * level + name.rpartition(".")[2]
        if name in trace.modules:
            label += f" ({trace.modules[name]})"
        rows.append((label, s["fw calls"], s["bw calls"], fmt_count(s["fw FLOPs"]),
                     fmt_count(s["bw FLOPs"]), fmt_bytes(s["params"]), fmt_bytes(s["act@peak"])))
    headers = ("module", "fw calls", "bw calls", "fw FLOPs", "bw FLOPs", "params", "act@peak")
    return "\n".join(render(headers, rows, width=width))


def _ancestors(module: str):
    from .flops import _ancestors as ancestors

    return ancestors(module)


class ShapeLog:
    """Distinct input signatures of chosen ops, with counts; print for a table.

    ``entries`` maps ``(op, signature)`` to the number of calls, where the
    signature lists each tensor input's dtype, shape and (when not
    contiguous) strides, as the trace prints them.
    """

    def __init__(self, entries: Counter) -> None:
        self.entries = entries

    def __str__(self) -> str:
        rows = [(op, sig, n) for (op, sig), n in sorted(self.entries.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1]))]
        return "\n".join(render(("op", "inputs", "calls"), rows, align="<<>"))

    def __len__(self) -> int:
        return len(self.entries)


def shape_log(trace: Trace, ops=None) -> ShapeLog:
    """What shapes reach each kernel: by default every op with a FLOP formula
    (matmuls, convolutions, attention); ``ops`` picks others by name part.

    >>> import torch, metadispatch as md
    >>> t = md.trace(lambda a: a @ a @ a.T, torch.ones(4, 4))
    >>> print(md.shape_log(t))
    <BLANKLINE>
    op               inputs                      calls
    ---------------  --------------------------  -----
    aten.mm.default  f32[4, 4], f32[4, 4]            1
    aten.mm.default  f32[4, 4], f32[4, 4]{1, 4}      1
    """
    from .flops import formula_for

    def chosen(call) -> bool:
        if ops is None:
            return formula_for(call.func) is not None
        return any(o in call.op for o in ([ops] if isinstance(ops, str) else ops))

    entries: Counter = Counter()
    for call in trace.calls:
        if chosen(call):
            entries[(call.op, ", ".join(m.type_str() for m in call.inputs))] += 1
    return ShapeLog(entries)
