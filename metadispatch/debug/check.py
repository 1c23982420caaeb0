"""``md.check``: trace without stopping, then check every answer on CPU.

``md.trace`` stops at the first op no stage of the router can answer.
``md.check`` keeps going: such a call (an op with no rule, meta kernel or
decomposition; a data-dependent op on values nobody knows) is run with the
real CPU kernel on inputs materialised from its metadata (Note [Made-up data]
in ``compare.py``), and its outputs' metadata are taken from the result.
Inputs above a byte limit are refused, and the report says which and why.
After the run every call is re-run on CPU and compared (``recheck.py``).

Limits: an op answered this way has no aliasing (a view it returns is a fresh
tensor), and a data-dependent size comes from made-up data -- the report
marks it as an assumption.
"""

from __future__ import annotations

from typing import Callable

from ..core import known
from ..core.realrun import DEFAULT_LIMIT, materialize, run_real, to_meta_outputs
from ..errors import DataDependentError, MaterializeLimitError
from ..core.mode import MetaMode
from ..tracing.tracer import run_traced
from .recheck import recheck
from .report import Answer, Report
from ..core.schema import facts
from ..core.source import user_frame

__all__ = ["check", "checker"]

REAL = "real kernel"
ASSUMED = "real kernel, data assumed"


def checker(device=None, *, limit: int | None = DEFAULT_LIMIT, recheck_calls: bool = True,
            known_limit: int = known.DEFAULT_LIMIT) -> Callable[..., Report]:
    """``md.check`` with options: ``md.checker(limit=1 << 20)(fn, x)``.

    ``limit`` bounds the bytes of real inputs materialised for one call
    (``None``: no bound); ``recheck_calls=False`` skips the CPU re-check.
    """
    def run(fn: Callable, *args, **kwargs) -> Report:

        mode = MetaMode(device=device, stack=True, known_limit=known_limit)
        answers: dict = {}
        refused: list = []
        mode.fallback = _fallback(mode, limit, answers, refused)
        error = None
        try:
            run_traced(mode, fn, args, kwargs)
        except Exception as e:  # the report says where and why it stopped
            error = e
        trace = mode.trace
        for index, answer in answers.items():
            if index < len(trace.calls):
                trace.calls[index].note = answer.note
        mismatches, skipped = recheck(trace, limit) if recheck_calls else ([], [])
        return Report(trace, answers, refused, mismatches, skipped, error)

    return run


def check(fn: Callable, *args, **kwargs) -> Report:
    """Trace ``fn(*args, **kwargs)`` without stopping; report what metadata cannot answer.

    >>> import torch, metadispatch as md
    >>> report = md.check(lambda x: (x > 0).nonzero(), torch.ones(4))
    >>> [issue.op for issue in report.data_dependent]
    ['aten.nonzero.default']
    >>> print(report.trace)
    $0: f32[4] = arg args[0]
    $1: b8[4] = aten.gt.Scalar($0, 0)
    $2: i64[4, 1]{1, 4} = aten.nonzero.default($1)  # [real] <real kernel, data assumed>
    """
    return checker()(fn, *args, **kwargs)


def _fallback(mode, limit, answers: dict, refused: list):
    """The ``mode.fallback`` hook: run one call for real, or refuse."""
    def fallback(func, args, kwargs, device, error):
        data = isinstance(error, DataDependentError)
        try:
            real_args, real_kwargs = materialize(args, kwargs, limit=limit)
        except MaterializeLimitError as e:
            refused.append(Answer(facts(func).name, func, "data-dependent" if data else "unsupported",
                                  _module(mode), user_frame(), str(e)))
            raise
        out = to_meta_outputs(run_real(func, real_args, real_kwargs), device)
        answers[len(mode.trace.calls)] = Answer(
            facts(func).name, func, "data-dependent" if data else "unsupported",
            _module(mode), user_frame(), ASSUMED if data else REAL)
        return out

    return fallback


def _module(mode) -> str:
    modules = mode._recorder.modules
    return modules.current() if modules is not None else ""
