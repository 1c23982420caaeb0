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
user's code is wrong (or the made-up inputs are: the report says so), and
the error raised is the real kernel's -- what a real run would say, never
one blaming a tensor for being on ``meta``.  Outputs are on the logical
device, except those the kernel always puts on the CPU (a packed
sequence's ``batch_sizes``).

Note [Made-up values under md.check]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The inputs of such a call are, in order of preference: the values a user
gave for its site (``values=``, the value policy); known values (Note [Known
values] in known.py, which under md.check include the user's integer and
boolean example inputs: ``know_index_inputs`` in assume.py); made-up data, inside the
bounds of how the tensor was produced (Note [Value bounds] in bounds.py).  A made-up boolean read by
``bool(t)``/``.item()`` is False: such reads mostly guard error paths
(torchvision's ``if degenerate_boxes.any(): raise ...``).  A read outside
any op (``t.tolist()``, ``t.numpy()``) gets a made-up value the same way
(``mode.read_fallback``).  Every made-up value a result may depend on is an
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
from ..errors import DataDependentError, MaterializeLimitError, UnsupportedOpError, raised_in
from ..ir.records import type_str
from ..mode.mode import MetaMode
from ..source import traceback_frame, user_frame
from ..spec.schema import facts
from ..tensor.tensor import MetaTensor
from ..tracing.reach import find
from ..tracing.tracer import check_restore, run_traced
from ..values import known
from ..values.assume import SCALAR_READ, checked_given, given, is_index, know_index_inputs, site_values
from ..values.bounds import bounds_of
from ..values.realrun import CPU, DEFAULT_LIMIT, flat, materialize, run_real, to_meta_outputs
from .recheck import recheck
from .report import Answer, Assumption, Report, Stop, made_up

__all__ = ["check", "checker", "guessing_mode"]

REAL = "real kernel"
_DYNAMIC = ("data-dependent", "data dependent", "dynamic output shape", "dynamic shape", "unbacked")


def checker(
    device=None,
    *,
    limit: int | None = DEFAULT_LIMIT,
    recheck_calls: bool = True,
    known_limit: int = known.DEFAULT_LIMIT,
    values: dict | None = None,
    gpu=None,
    restore: str = "machinery",
) -> Callable[..., Report]:
    """``md.check`` with options: ``md.checker(limit=1 << 20)(fn, x)``.

    ``limit`` bounds the bytes of real inputs materialised for one call
    (``None``: no bound); ``recheck_calls=False`` skips the CPU re-check;
    ``values`` gives the value of named sites instead of a made-up one:
    ``{"model.py:12": 3}`` (a user line, as the report prints it, with or
    without ``in fn``) or ``{"aten.nonzero.default": tensor}`` (an op) --
    a number for ``.item()``-style reads, the outputs for other ops;
    ``gpu`` the profile logical CUDA answers as (``MetaMode(gpu=...)``);
    ``restore`` what the check gives back as it was, as ``md.tracer``'s
    (Note [What md.trace gives back] in tracing/tracer.py).
    """
    check_restore(restore)

    def run(fn: Callable, *args, **kwargs) -> Report:
        mode = MetaMode(device=device, stack=True, known_limit=known_limit, gpu=gpu)
        state = _State(mode, limit, site_values(values, "md.checker"))
        mode.fallback, mode.read_fallback = state.fallback, state.read
        error = None
        # Calls run for real draw from the global and the user's generators.
        rng = _compat.rng_states()
        generators = [
            (g, g.get_state())
            for g in find({"fn": fn, "args": args, "kwargs": kwargs}, lambda o: isinstance(o, torch.Generator))
        ]
        know_index_inputs(mode, args, kwargs)
        try:
            try:
                run_traced(mode, fn, args, kwargs, restore)
            except Exception as e:  # the report says where and why it stopped
                error = e
            trace = mode.trace
            calls = trace.calls  # notes go on new records in the calls' places (OpCall is immutable)
            for index, answer in state.answers.items():
                if index < len(calls):
                    calls[index] = calls[index].replace(note=answer.note)
            for index, notes in state.read_notes.items():
                call = calls[index]
                calls[index] = call.replace(note="; ".join(([call.note] if call.note else []) + notes))
            mismatches, skipped = recheck(trace, limit) if recheck_calls else ([], [])
        finally:
            _compat.set_rng_states(rng)
            for g, state_ in generators:
                g.set_state(state_)
        stop = _stop(error, mode, state.assumptions) if error is not None else None
        if error is not None:
            without_frames(error)  # Note [A report keeps no frames]
        unused = tuple(k for k in state.values if k not in state.used)
        return Report(trace, state.answers, state.refused, mismatches, skipped, error, state.assumptions, stop, unused)

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


def guessing_mode(
    device=None, *, gpu=None, world_size: int | None = None, rank: int = 0, limit=DEFAULT_LIMIT, values=None
) -> MetaMode:
    """A MetaMode whose ``.item()`` and other data-dependent calls run on made-up values, as under ``check``.

    For steps whose memory does not follow the values they read: Adafactor
    scales its update by ``param.norm().item()``, a number that changes no
    shape and no allocation; ``md.tracer(mode_factory=guessing_mode)``
    traces it.  Each read is kept as an assumption in
    ``mode.guesses.assumptions``; a step whose shapes follow such a value is
    traced for the made-up one, which ``md.check`` reports.

    >>> import torch, metadispatch as md
    >>> from metadispatch.debug.check import guessing_mode
    >>> t = md.tracer(mode_factory=guessing_mode)(lambda x: x * float(x.sum()), torch.ones(3))
    >>> [c.op for c in t]
    ['aten.sum.default', 'aten._local_scalar_dense.default', 'aten.mul.Tensor']
    """
    mode = MetaMode(device=device, gpu=gpu, world_size=world_size, rank=rank)
    state = _State(mode, limit, site_values(values, "md.checker"))
    mode.fallback, mode.read_fallback = state.fallback, state.read
    mode.__dict__["guesses"] = state  # its assumptions, as md.check reports them
    return mode


class _State:
    """What one ``md.check`` run gathers: the ``mode.fallback`` hook and its findings."""

    def __init__(self, mode: MetaMode, limit, values: dict) -> None:
        self.mode, self.limit, self.values = mode, limit, values
        self.answers: dict = {}  # call index -> Answer
        self.refused: list = []  # Answers refused above the limit
        # the trace's own list: a guessing mode's made-up values are listed in
        # every trace it records (md.tracer(mode_factory=guessing_mode), FitCheck)
        self.assumptions: list = mode.trace.assumptions
        self.read_notes: dict = {}  # call index -> notes of reads of its outputs (``read``)
        self.used: set = set()  # keys of ``values`` that named a site

    def fallback(self, func, args, kwargs, device, error):
        """Run one call for real (Note [Made-up values under md.check]), or refuse."""
        name, kind = facts(func).name, _kind(error)
        module, source = _module(self.mode), user_frame()
        reason = (str(error).strip().splitlines() or [""])[0]
        index = len(self.mode.trace.calls)
        found = given(self.values, self.used, name, source)
        if found is not None:
            out = checked_given(name, *found)
            basis = f"given by values[{found[0]!r}]"
            made_up: list = []
        else:
            made_up = [t for t in _tensors(args, kwargs) if known.value_of(t) is None]
            try:
                real_args, real_kwargs = materialize(args, kwargs, limit=self.limit, value_of=known.value_of)
            except MaterializeLimitError as e:
                self.refused.append(Answer(name, func, kind, module, source, str(e), reason))
                raise
            basis = _basis(made_up, name)
            try:
                out = _scalar_guess(name, made_up) if made_up and name == SCALAR_READ else None
                out = run_real(func, real_args, real_kwargs) if out is None else out
            except Exception as real_error:
                # The real kernel refuses too: the user's code is wrong, or
                # the made-up inputs are (then the report names them).  Its
                # message is what a real run says; the meta one, which may
                # blame a tensor for being on meta, stays its context.
                if _values_matter(kind, made_up):
                    self.assumptions.append(Assumption(index, name, module, source, "inputs it refused", basis))
                raise real_error from error
        metas = _on_devices(name, out, device)
        self._keep_index_values(metas, out)
        note = REAL
        if found is not None or _values_matter(kind, made_up):
            value = _show(out) if _is_scalar(out) else _output_types(metas) or "its outputs"
            assumption = Assumption(index, name, module, source, value, basis)
            self.assumptions.append(assumption)
            note = f"assumed {value}: {basis}"
        self.answers[index] = Answer(name, func, kind, module, source, note, reason)
        return metas

    def read(self, t, what: str) -> torch.Tensor:
        """The value of ``t`` for ``Tensor.tolist()``/``.numpy()``: given, or
        made up inside its bounds, and an assumption either way."""
        name, module, source = f"Tensor.{what}", _module(self.mode), user_frame()
        found = given(self.values, self.used, name, source)
        # Called from user code with the mode on: real tensors stay real here.
        with _compat.no_torch_function():
            if found is not None:
                value, basis = torch.as_tensor(found[1]), f"given by values[{found[0]!r}]"
            else:
                (value,), _ = materialize((t,), {}, limit=self.limit, value_of=known.value_of)
                basis = _basis([t], name)
            shown = _show(value.tolist()) if value.numel() <= 8 else _type(t)
        # A read is no call: the assumption is noted on the call that made
        # ``t`` (on none for an argument), and counts from the next call.
        made_by = self.mode._recorder.producer_of(t)
        if made_by is not None:
            self.read_notes.setdefault(made_by, []).append(f"{name} assumed {shown}: {basis}")
        self.assumptions.append(Assumption(len(self.mode.trace.calls), name, module, source, shown, basis))
        return value

    def _keep_index_values(self, metas, out) -> None:
        for m, r in zip(flat(metas), flat(out)):
            if isinstance(m, MetaTensor) and isinstance(r, torch.Tensor) and is_index(r):
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


def _values_matter(kind: str, made_up: list) -> bool:
    """Whether made-up inputs may shape the result: a data-dependent op, or
    index-like data (floats fed to a kernel that refused their metadata do not)."""
    return bool(made_up) and (kind == "data-dependent" or any(is_index(t) for t in made_up))


def _is_scalar(out) -> bool:
    return isinstance(out, (bool, int, float, complex))


# Outputs a kernel puts on the CPU whatever its inputs' device.
_CPU_OUTPUTS = {"aten._pack_padded_sequence.default": (1,)}  # batch_sizes


def _on_devices(name: str, out, device):
    """The real kernel's outputs as MetaTensors on the logical ``device``,
    except those the kernel always puts on the CPU (``_CPU_OUTPUTS``)."""
    cpu = _CPU_OUTPUTS.get(name)
    if not cpu or type(out) not in (list, tuple):
        return to_meta_outputs(out, device)
    return type(out)(to_meta_outputs(o, CPU if i in cpu else device) for i, o in enumerate(out))


def _tensors(args, kwargs) -> list:
    return [x for x in flat(list(args) + list(kwargs.values())) if isinstance(x, MetaTensor)]


def _basis(made_up: list, name: str) -> str:
    parts = []
    # Sizes follow from index-like data (integers, masks) where there is any.
    for t in [t for t in made_up if is_index(t)] or made_up:
        b = bounds_of(t)
        what = f"{_type(t)}: "
        if b is not None:
            parts.append(what + str(b))
        elif t.dtype == torch.bool:
            parts.append(what + ("(read as False)" if name == SCALAR_READ else "(all True)"))
        elif is_index(t):
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


# Note [A report keeps no frames]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The exception that stopped a checked run carries its traceback, whose
# frames hold every local of the user's step and model -- the real
# parameters among them -- for as long as the report lives.  Once the stop
# has read where it happened (the user's line, the op), the exception keeps
# its type and text, and nothing else: its traceback, and those of the
# exceptions it was raised from or during, are dropped, and arguments that
# are not plain values (a tensor as a KeyError's key) become their text.
def without_frames(error: BaseException) -> None:
    """Drop ``error``'s frames and non-plain arguments, and those of its cause and context."""
    todo: list[BaseException | None] = [error]
    seen: set = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        if any(not isinstance(a, _PLAIN) for a in e.args):
            try:
                e.args = tuple(a if isinstance(a, _PLAIN) else repr(a) for a in e.args)
            except Exception:  # an exception class whose args cannot be set
                pass
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]  # an ExceptionGroup's too


_PLAIN = (str, int, float, bool, type(None), bytes)


def _stop(error, mode, assumptions: list) -> Stop:
    op, where = raised_in(error)
    source = traceback_frame(error.__traceback__) or where
    invented = [a for a in assumptions if made_up(a)]
    return Stop(error, op, mode.stopped_in or "", source, invented[-1] if invented else None)
