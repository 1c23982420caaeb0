"""``md.check``: trace without stopping, then check every answer on CPU.

``md.trace`` stops at the first op no stage of the router can answer.
``md.check`` keeps going past every failure that means "this needs data or
a real kernel": an op with no rule, meta kernel or decomposition; a
data-dependent op on values nobody knows (metadispatch's own
``DataDependentError``, or a fake impl asking for a dynamic size); a meta
kernel refusing what the real kernel accepts (an index tensor that must be
on the CPU).  Such a call is run with the real
CPU kernel on inputs materialised from its metadata, and its outputs'
metadata are taken from the result.  Inputs above a byte limit are refused,
and the report says which and why.  If the real kernel refuses too, the
user's code is wrong, and the error raised is the real kernel's whenever
the meta kernel's would blame a tensor for being on ``meta``.

Note [Made-up values under md.check]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The inputs of such a call are, in order of preference: the values a user
gave for its site (``values=``, the value policy); known values (Note [Known
values] in known.py); made-up data, inside the bounds of how the tensor was
produced (Note [Value bounds] in bounds.py).  A made-up boolean read by
``bool(t)``/``.item()`` is False: such reads mostly guard error paths
(torchvision's ``if degenerate_boxes.any(): raise ...``).  Every made-up value a result may depend on is an
:class:`~metadispatch.report.Assumption`: noted on its call in the trace
(``<assumed 3: ...>``) and listed in the report, which also names the last
one before the run stopped.  Integer and boolean outputs of the real kernel
keep their values, so that later calls (``pad_packed_sequence`` reading the
``batch_sizes`` that ``pack_padded_sequence`` made) agree with them.

After the run every call is re-run on CPU and compared (``recheck.py``).
Limits: an op answered this way has no aliasing (a view it returns is a
fresh tensor).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _compat
from ..core import known
from ..core.bounds import bounds_of
from ..core.mode import MetaMode
from ..core.reach import find
from ..core.realrun import DEFAULT_LIMIT, flat, materialize, run_real, to_meta_outputs
from ..core.schema import facts
from ..core.source import traceback_frame, user_frame
from ..core.tensor import MetaTensor
from ..errors import DataDependentError, MaterializeLimitError, UnsupportedOpError, raised_in
from ..ir.records import type_str
from ..tracing.tracer import run_traced
from .recheck import recheck
from .report import Answer, Assumption, Report, Stop

__all__ = ["check", "checker"]

REAL = "real kernel"
_SCALAR_READ = "aten._local_scalar_dense.default"
_DYNAMIC = ("data-dependent", "data dependent", "dynamic output shape", "dynamic shape", "unbacked")


def checker(
    device=None,
    *,
    limit: int | None = DEFAULT_LIMIT,
    recheck_calls: bool = True,
    known_limit: int = known.DEFAULT_LIMIT,
    values: dict | None = None,
) -> Callable[..., Report]:
    """``md.check`` with options: ``md.checker(limit=1 << 20)(fn, x)``.

    ``limit`` bounds the bytes of real inputs materialised for one call
    (``None``: no bound); ``recheck_calls=False`` skips the CPU re-check;
    ``values`` gives the value of named sites instead of a made-up one:
    ``{"model.py:12": 3}`` (a user line, as the report prints it, with or
    without ``in fn``) or ``{"aten.nonzero.default": tensor}`` (an op) --
    a number for ``.item()``-style reads, the outputs for other ops.
    """

    def run(fn: Callable, *args, **kwargs) -> Report:
        mode = MetaMode(device=device, stack=True, known_limit=known_limit)
        state = _State(mode, limit, dict(values or {}))
        mode.fallback = state.fallback
        error = None
        # Calls run for real draw from the global and the user's generators.
        rng = _compat.rng_states()
        generators = [
            (g, g.get_state())
            for g in find({"fn": fn, "args": args, "kwargs": kwargs}, lambda o: isinstance(o, torch.Generator))
        ]
        try:
            try:
                run_traced(mode, fn, args, kwargs)
            except Exception as e:  # the report says where and why it stopped
                error = e
            trace = mode.trace
            for index, answer in state.answers.items():
                if index < len(trace.calls):
                    trace.calls[index].note = answer.note
            mismatches, skipped = recheck(trace, limit) if recheck_calls else ([], [])
        finally:
            _compat.set_rng_states(rng)
            for g, state_ in generators:
                g.set_state(state_)
        stop = _stop(error, mode, state.assumptions) if error is not None else None
        return Report(trace, state.answers, state.refused, mismatches, skipped, error, state.assumptions, stop)

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
    $2: i64[4, 1]{1, 4} = aten.nonzero.default($1)  # [real] <assumed i64[4, 1]: made-up b8[4]: (all True)>
    """
    return checker()(fn, *args, **kwargs)


class _State:
    """What one ``md.check`` run gathers: the ``mode.fallback`` hook and its findings."""

    def __init__(self, mode: MetaMode, limit, values: dict) -> None:
        self.mode, self.limit, self.values = mode, limit, values
        self.answers: dict = {}  # call index -> Answer
        self.refused: list = []  # Answers refused above the limit
        self.assumptions: list = []

    def fallback(self, func, args, kwargs, device, error):
        """Run one call for real (Note [Made-up values under md.check]), or refuse."""
        name, kind = facts(func).name, _kind(error)
        module, source = _module(self.mode), user_frame()
        reason = (str(error).strip().splitlines() or [""])[0]
        index = len(self.mode.trace.calls)
        given = self._given(name, source)
        if given is not None:
            out = given[1]
            basis = f"given by values[{given[0]!r}]"
            made_up: list = []
        else:
            made_up = [t for t in _tensors(args, kwargs) if known.value_of(t) is None]
            try:
                real_args, real_kwargs = materialize(args, kwargs, limit=self.limit, value_of=known.value_of)
            except MaterializeLimitError as e:
                self.refused.append(Answer(name, func, kind, module, source, str(e), reason))
                raise
            try:
                out = _scalar_guess(name, made_up) if made_up and name == _SCALAR_READ else None
                out = run_real(func, real_args, real_kwargs) if out is None else out
            except Exception as real_error:
                # The real kernel refuses too: the user's code is wrong.  Its
                # message, unless the meta kernel's is about anything but meta.
                if "meta" in reason.lower() or isinstance(error, (DataDependentError, UnsupportedOpError)):
                    raise real_error from error
                raise error  # noqa: B904  (the meta error is the answer; the real one stays its context)
            basis = _basis(made_up, name)
        metas = to_meta_outputs(out, device)
        self._keep_index_values(metas, out)
        note = REAL
        if given is not None or (made_up and (kind == "data-dependent" or any(_is_index(t) for t in made_up))):
            value = _show(out) if name == _SCALAR_READ else _output_types(metas) or "its outputs"
            assumption = Assumption(index, name, module, source, value, basis)
            self.assumptions.append(assumption)
            note = f"assumed {value}: {basis}"
        self.answers[index] = Answer(name, func, kind, module, source, note, reason)
        return metas

    def _given(self, name: str, source: str | None):
        """(key, value) from the value policy for this site, or None."""
        keys = [source, source.split(" in ")[0]] if source else []
        for key in keys + [name]:
            if key in self.values:
                return key, self.values[key]
        return None

    def _keep_index_values(self, metas, out) -> None:
        for m, r in zip(flat(metas), flat(out)):
            if isinstance(m, MetaTensor) and isinstance(r, torch.Tensor) and _is_index(r):
                known.know(m, r, self.mode)


def _kind(error) -> str:
    if isinstance(error, UnsupportedOpError):
        return "unsupported"
    if isinstance(error, (DataDependentError, *_compat.data_dependent_errors())):
        return "data-dependent"
    text = str(error).lower()
    return "data-dependent" if any(s in text for s in _DYNAMIC) else "refused"


def _scalar_guess(name: str, made_up: list):
    """False for a made-up boolean read (``if mask.any(): raise ...`` checks
    guard error paths), else None: the real kernel reads the made-up value."""
    (t,) = made_up
    return False if t.dtype == torch.bool and bounds_of(t) is None else None


def _is_index(t) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex)


def _tensors(args, kwargs) -> list:
    return [x for x in flat(list(args) + list(kwargs.values())) if isinstance(x, MetaTensor)]


def _basis(made_up: list, name: str) -> str:
    parts = []
    # Sizes follow from index-like data (integers, masks) where there is any.
    for t in [t for t in made_up if _is_index(t)] or made_up:
        b = bounds_of(t)
        what = f"{_type(t)}: "
        if b is not None:
            parts.append(what + str(b))
        elif t.dtype == torch.bool:
            parts.append(what + ("(read as False)" if name == _SCALAR_READ else "(all True)"))
        elif _is_index(t):
            parts.append(what + "(all 1)")
        else:
            parts.append(what + "(standard normal: no bound known)")
    return "made-up " + "; ".join(parts) if parts else "made-up inputs"


def _type(t) -> str:
    """``i64[4, 1]``: dtype, shape, and strides when ``t`` is not contiguous as
    torch sees it (size-1 dimensions' strides do not count, unlike in traces)."""
    return type_str(t.dtype, t.shape, None if t.is_contiguous() or t.dim() < 2 else t.stride())


def _output_types(metas) -> str:
    return ", ".join(_type(o) for o in flat(metas) if isinstance(o, MetaTensor))


def _show(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _module(mode) -> str:
    modules = mode._recorder.modules
    return modules.current() if modules is not None else ""


def _stop(error, mode, assumptions: list) -> Stop:
    op, where = raised_in(error)
    source = traceback_frame(error.__traceback__) or where
    return Stop(error, op, mode.stopped_in or "", source, assumptions[-1] if assumptions else None)
