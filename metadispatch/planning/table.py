"""What ``md.plan`` returns: one ``Candidate`` per configuration, ranked in a ``PlanTable``.

Kept apart from the search (train.py) so the table a user prints and
iterates is read in one place; the search fills its fields.
"""

from __future__ import annotations

from typing import Any

from ..ir.text import fmt_bytes, render
from ..ir.trace import Trace

__all__ = ["Candidate", "PlanTable", "KEYS", "rank_candidates", "short"]

KEYS = ("shard", "replicate", "tp", "ac", "micro_batch", "accum", "optimizer", "sp", "cp", "ep")


class Candidate:
    """One configuration: ``config`` (a dict of ``KEYS``), ``fits``, the
    steady-state ``peak`` (allocated) and ``reserved_peak`` bytes,
    ``step_time`` seconds and ``tokens_per_s`` (the whole job's), ``why``
    it was rejected (``None`` if it fits) and ``retrace()``."""

    def __init__(self, config: dict, planner: Any) -> None:
        self.config, self._planner = config, planner
        self.fits: bool | None = False  # None: scaled, not confirmed by a full trace
        self.peak: int | None = None
        self.reserved_peak: int | None = None
        self.step_time: float | None = None
        self.tokens_per_s: float | None = None
        self.why: str | None = None
        self.state: int | None = None  # bytes live as the optimizer step starts (Note [What scaling may reject])
        self.cached = False  # scored from a trace another candidate made
        self.scaled = False  # extrapolated from two shallower traces (Note [Scaling from two depths])
        self.ranks: dict | None = None  # a pipeline's traced ranks -> peak (Note [Scoring a pipeline configuration])

    def retrace(self) -> Trace:
        """This configuration's rank-0 step traced afresh (build, two steps; marks ``"step"``, ``"micro"``, ``"opt"``)."""
        return self._planner.trace(self.config)

    def __repr__(self) -> str:
        return f"<Candidate {short(self.config)} {'fits' if self.fits else 'rejected: ' + str(self.why)}>"


class PlanTable(list):
    """Candidates, best first: those that fit by step time, then the rejected. Print it for a table."""

    seconds: float = 0.0
    traces: int = 0
    spent: dict = {}  # "full", "k layers", "measuring" -> [count, seconds]: where the search's time went
    assumes: str = ""

    @property
    def best(self) -> Candidate | None:
        return self[0] if self and self[0].fits else None

    def __str__(self) -> str:
        rows = [
            (
                str(i + 1),
                short(c.config),
                "yes" if c.fits else "?" if c.fits is None else "no",
                fmt_bytes(c.reserved_peak) if c.reserved_peak is not None else "-",
                f"{c.step_time * 1e3:.1f}" if c.step_time is not None else "-",
                f"{c.tokens_per_s:,.0f}" if c.tokens_per_s is not None else "-",
                c.why or "",
            )
            for i, c in enumerate(self)
        ]
        where = ", ".join(f"{what} {n} in {sec:.1f} s" for what, (n, sec) in self.spent.items())
        head = f"{len(self)} candidates, {self.traces} traces, {self.seconds:.1f} s ({where}); {self.assumes}"
        if any(c.scaled for c in self):  # Note [Scaling from two depths] in train.py
            head += "; fits yes/no: a full trace's verdict, ?: scaled from shallow traces, not confirmed"
        table = render(("#", "config", "fits", "reserved", "step ms", "tokens/s", "why not"), rows, align="<<<>>><")
        return "\n".join([head, *table])


def rank_candidates(table: list) -> None:
    # confirmed fits by time, then the unconfirmed (fits None) by time, then the rejected
    order = {True: 0, None: 1, False: 2}
    table.sort(key=lambda c: (order[c.fits], c.step_time if c.step_time is not None else float("inf")))


def short(c: dict) -> str:
    pp = f"pp {c['pp']} {c['pp_schedule']} " if c.get("pp", 1) > 1 else ""
    sp = " sp" if c.get("sp") else ""
    more = "".join(f" {k} {c[k]}" for k in ("cp", "ep") if c.get(k, 1) > 1)
    return (
        f"{pp}shard {c['shard']} x rep {c['replicate'] or '-'} tp {c['tp']}{sp}{more} ac {c['ac']} "
        f"mb {c['micro_batch']} x{c['accum']} {c['optimizer']}"
    )
