"""``md.Report``: what ``md.check`` found, as data and as a readable table.

Four lists, each grouped by op: ops with no rule (answered by the real
kernel, or refused above the size limit), ops whose meta kernel refused what
the real kernel accepts, data-dependent ops (answered from made-up data:
their sizes are assumptions), and calls whose metadata differ from the real
CPU kernel's.  Then every made-up value, one :class:`Assumption` each, and
where the run stopped, if it did (:class:`Stop`).  ``str(report)`` prints them
with a skeleton ``@md.register_meta`` rule for each op with no rule.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.registry import rule_skeleton
from ..ir.assumptions import Assumption
from ..mode.realcode import DRAWN_FOR_REAL

__all__ = ["Report", "Answer", "OpIssue", "Assumption", "Stop", "made_up"]


def made_up(a: Assumption) -> bool:
    """Whether ``a`` was made up: neither given by ``values=`` nor drawn for real (a DataLoader's rows)."""
    return not a.basis.startswith(("given by", DRAWN_FOR_REAL))


class Answer(NamedTuple):
    """One call ``md.check`` answered with the real kernel (or refused to)."""

    op: str
    func: object  # the OpOverload
    kind: str  # "unsupported", "refused" (by the meta kernel) or "data-dependent"
    module: str
    source: str | None
    note: str  # the trace note, or why it was refused
    reason: str = ""  # the first line of what the meta kernel or router raised


class Stop(NamedTuple):
    """Where and why the run stopped."""

    error: BaseException
    op: str | None  # the aten call it came out of, if any
    module: str  # "" at top level
    source: str | None  # the user's line that raised (or called the op that did)
    after: Assumption | None  # the last made-up value before it, if any

    def __str__(self) -> str:
        message = (str(self.error).strip().splitlines() or [""])[0]
        where = ", ".join(
            ([f"in {self.op}"] if self.op else []) + [f"module {self.module or '<top>'}", f"at {self.source or '?'}"]
        )
        line = f"Stopped: {type(self.error).__name__}: {message} ({where})"
        if self.after is not None:
            line += f"\n  after a made-up value: {self.after}"
        return line


class OpIssue(NamedTuple):
    """Every call of one op with one kind of problem."""

    op: str
    func: object
    count: int
    modules: tuple  # in order of first appearance; "" is top level
    source: str | None  # the first user line that called it
    refused: str | None  # why it was not run for real, if it was not
    outputs: tuple  # the first call's output types, e.g. ("i64[3, 1]",)
    reason: str = ""  # what the meta kernel said when it refused

    def skeleton(self) -> str:
        return rule_skeleton(self.func)


def _group(answers, refused, kind, trace) -> list[OpIssue]:
    groups: dict = {}
    for index, a in list(answers.items()) + [(None, r) for r in refused]:
        if a.kind != kind:
            continue
        g = groups.setdefault(
            a.op,
            {
                "func": a.func,
                "count": 0,
                "modules": [],
                "source": None,
                "refused": None,
                "outputs": (),
                "reason": a.reason,
            },
        )
        g["count"] += 1
        if a.module not in g["modules"]:
            g["modules"].append(a.module)
        g["source"] = g["source"] or a.source
        if index is None:
            g["refused"] = a.note
        elif not g["outputs"] and index < len(trace.calls):
            g["outputs"] = tuple(m.type_str() for m in trace.calls[index].output_metas)
    return [
        OpIssue(op, g["func"], g["count"], tuple(g["modules"]), g["source"], g["refused"], g["outputs"], g["reason"])
        for op, g in groups.items()
    ]


class Report:
    """What ``md.check`` found.

    ``unsupported``, ``meta_refused`` and ``data_dependent`` are lists of
    :class:`OpIssue`, ``assumptions`` of :class:`Assumption`, ``mismatches``
    of :class:`~metadispatch.ir.compare.Mismatch` (``made_up``: the assumptions
    not given by ``values=``); ``skipped`` the calls the CPU re-check could not
    run, ``error`` the exception that stopped the run (None when it ran to
    the end) and ``stop`` where it stopped, ``trace`` everything recorded,
    ``unused_values`` the keys of ``values=`` that named no site.
    """

    def __init__(
        self,
        trace,
        answers,
        refused,
        mismatches,
        skipped,
        error,
        assumptions=(),
        stop: Stop | None = None,
        unused_values: tuple = (),
    ) -> None:
        self.trace = trace
        self.unsupported = _group(answers, refused, "unsupported", trace)
        self.meta_refused = _group(answers, refused, "refused", trace)
        self.data_dependent = _group(answers, refused, "data-dependent", trace)
        self.assumptions = list(assumptions)
        self.mismatches = mismatches
        self.skipped = skipped
        self.error = error
        self.stop = stop
        self.unused_values = tuple(unused_values)

    @property
    def made_up(self) -> list:
        """The assumptions that are made-up values (not given by ``values=``, nor drawn for real)."""
        return [a for a in self.assumptions if made_up(a)]

    @property
    def ok(self) -> bool:
        """True when every call was answered from metadata and re-checked equal,
        and nothing the run read was made up."""
        return not (
            self.unsupported
            or self.meta_refused
            or self.data_dependent
            or self.mismatches
            or self.error
            or self.made_up
        )

    def __repr__(self) -> str:
        refused = f"{len(self.meta_refused)} refused by meta kernels, " if self.meta_refused else ""
        return (
            f"<Report: {len(self.trace)} calls, {len(self.unsupported)} unsupported, {refused}"
            f"{len(self.data_dependent)} data-dependent, {len(self.mismatches)} mismatches"
            f"{f', {len(self.made_up)} made-up value' + 's' * (len(self.made_up) > 1) if self.made_up else ''}"
            f"{', stopped' if self.error else ''}>"
        )

    def __str__(self) -> str:
        lines = [repr(self)[1:-1].replace("Report: ", "md.check: ")]
        if self.error is not None:
            stop = self.stop or Stop(self.error, None, "", None, None)
            lines += [""] + str(stop).splitlines()
        cols = ("op", "calls", "modules", "first called at")
        if self.unsupported:
            lines += ["", "Ops with no rule (answered by the real CPU kernel)"]
            lines += _table(
                cols + ("",), [_row(i) + (f"REFUSED: {i.refused}" if i.refused else "",) for i in self.unsupported]
            )
        if self.meta_refused:
            lines += [
                "",
                "Ops whose meta kernel refused what the real kernel accepts (answered by the real CPU kernel)",
            ]
            lines += _table(
                cols + ("the meta kernel said",),
                [_row(i) + (f"REFUSED: {i.refused}" if i.refused else i.reason[:100],) for i in self.meta_refused],
            )
        if self.data_dependent:
            lines += ["", "Data-dependent ops (answered from made-up data: sizes are assumptions)"]
            lines += _table(
                cols + ("assumed",),
                [
                    _row(i) + (i.refused and "REFUSED: " + i.refused or ", ".join(i.outputs),)
                    for i in self.data_dependent
                ],
            )
        if self.assumptions:
            lines += ["", "Made-up values (assumptions: what follows them depends on them)"]
            lines += _table(
                ("call", "op", "assumed", "because", "at"),
                [(f"#{a.index}", a.op, a.value, a.basis, a.source or "?") for a in self.assumptions],
            )
        if self.mismatches:
            lines += ["", "Metadata that differ from the real CPU kernel (recorded != real)"]
            lines += _table(
                ("call", "op", "module", "rule", "problem"),
                [(f"#{m.index}", m.op, m.module or "<top>", m.rule, "; ".join(m.problems)) for m in self.mismatches],
            )
        if self.unused_values:
            keys = ", ".join(repr(k) for k in self.unused_values)
            lines += ["", f"values= keys that named no site (a typo, or a line that never ran): {keys}"]
        if self.skipped:
            lines += [
                "",
                f"{len(self.skipped)} calls not re-checked on CPU "
                f"(first: #{self.skipped[0][0]} {self.skipped[0][1]}: {self.skipped[0][2]})",
            ]
        for issue in self.unsupported:
            lines += ["", f"# A rule for {issue.op}:", issue.skeleton()]
        return "\n".join(lines)


def _row(issue: OpIssue) -> tuple:
    modules = ", ".join(m or "<top>" for m in issue.modules[:3])
    if len(issue.modules) > 3:
        modules += f", ... ({len(issue.modules)})"
    return issue.op, str(issue.count), modules, issue.source or "?"


def _table(header: tuple, rows: list) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
