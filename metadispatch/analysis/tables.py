"""Tables a trace answers: plain-text rendering, the per-module tree, the shape log.

Every table here is deterministic (sorted, no addresses) and renders as
aligned plain text; ``width`` shortens the first column so that a table fits
a terminal (the command line passes the terminal's width, tests pass none).
"""

from __future__ import annotations

from collections import Counter

from ..ir.text import render
from ..ir.trace import Trace
from .flops import ancestors, fmt_count, formula_for
from .flops import flops as count_flops
from .memory import fmt_bytes
from .memory import memory as measure

__all__ = ["render", "module_table", "shape_log", "ShapeLog"]


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
        return tuple(first.get(".".join(parts[: i + 1]), 0) for i in range(len(parts)))

    return key


def module_table(trace: Trace, flops=None, memory=None, depth: int | None = None, width: int | None = None) -> str:
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
    flops = flops if flops is not None else count_flops(trace)
    memory = memory if memory is not None else measure(trace)
    # Summed per module first, then into its ancestors: per call, the walk up
    # the module path cost a third of `metadispatch trace`'s report.
    own: dict = {}  # module -> [fw calls, bw calls, fw FLOPs, bw FLOPs]
    for call, n in zip(trace.calls, flops.per_call):
        sums = own.get(call.module)
        if sums is None:
            sums = own[call.module] = [0, 0, 0, 0]
        bw = call.phase == "backward"
        sums[bw] += 1
        sums[2 + bw] += n or 0
    stats: dict = {}
    for module, (fw_calls, bw_calls, fw_flops, bw_flops) in own.items():
        for m in ancestors(module):
            s = stats.get(m) or stats.setdefault(m, Counter())
            s["fw calls"] += fw_calls
            s["bw calls"] += bw_calls
            s["fw FLOPs"] += fw_flops
            s["bw FLOPs"] += bw_flops
    for info in memory.storages.values():
        for m in ancestors(info.module):
            s = stats.get(m) or stats.setdefault(m, Counter())
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
        cls = f" ({trace.modules[name]})" if name in trace.modules else ""
        rows.append(
            (
                level,
                name.rpartition(".")[2],
                cls,
                (
                    s["fw calls"],
                    s["bw calls"],
                    fmt_count(s["fw FLOPs"]),
                    fmt_count(s["bw FLOPs"]),
                    fmt_bytes(s["params"]),
                    fmt_bytes(s["act@peak"]),
                ),
            )
        )
    rows = [
        (("<top>" if not level else "  " * level + leaf) + cls, *cells)
        for level, leaf, cls, cells in _fold_repeats(rows)
    ]
    headers = ("module", "fw calls", "bw calls", "fw FLOPs", "bw FLOPs", "params", "act@peak")
    return "\n".join(render(headers, rows, width=width))


def _fold_repeats(rows: list) -> list:
    """Fold runs of identical sibling leaves (32 transformer blocks) into one row.

    A run folds when its rows share level, class and every figure, and none
    shows children; it keeps its first row and adds ``1-31 (Block, each as above)``.
    """
    out, i = [], 0
    while i < len(rows):
        j = i + 1
        level, _, cls, cells = rows[i]
        leaf_row = i + 1 >= len(rows) or rows[i + 1][0] <= level
        while (
            leaf_row
            and j < len(rows)
            and rows[j][0] == level
            and rows[j][2] == cls
            and rows[j][3] == cells
            and (j + 1 >= len(rows) or rows[j + 1][0] <= level)
        ):
            j += 1
        out.append(rows[i])
        if j - i > 2:
            same = cls[:-1] + ", each as above)" if cls else " (each as above)"
            out.append((level, f"{rows[i + 1][1]}-{rows[j - 1][1]}", same, cells))
        else:
            out.extend(rows[i + 1 : j])
        i = j
    return out


class ShapeLog:
    """Distinct input signatures of chosen ops, with counts; print for a table.

    ``entries`` maps ``(op, signature)`` to the number of calls, where the
    signature lists each tensor input's dtype, shape and (when not
    contiguous) strides, as the trace prints them.
    """

    def __init__(self, entries: Counter) -> None:
        self.entries = entries

    def __str__(self) -> str:
        rows = [
            (op, sig, n) for (op, sig), n in sorted(self.entries.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1]))
        ]
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

    def chosen(call) -> bool:
        if ops is None:
            return formula_for(call.func) is not None
        return any(o in call.op for o in ([ops] if isinstance(ops, str) else ops))

    entries: Counter = Counter()
    for call in trace.calls:
        if chosen(call):
            entries[(call.op, ", ".join(m.type_str() for m in call.inputs))] += 1
    return ShapeLog(entries)
