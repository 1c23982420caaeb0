"""Declared values: a policy that answers the value reads of a generation loop.

Note [Generating under declared assumptions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``model.generate()`` reads values a MetaTensor does not hold: the stopping
criteria (``bool(unfinished_sequences.max() == 0)``) read the tokens the
loop chose, which come from the model's logits.  Every tool refuses it as
data-dependent.  A serving plan does not need the tokens, only a loop that
does not stop early; so ``md.tracer(assume=md.GenerateAssumptions(token_id=0))``
declares them, and the trace lists each declaration:

* every ``argmax``/``multinomial`` result -- the next token, greedy or
  sampled -- is the declared ``token_id``: a known value (Note [Known
  values] in known.py) from that call on, noted on the call
  (``<assumed tokens = 0: ...>``) and one ``Assumption`` in
  ``trace.assumptions``.  Everything generate computes from the tokens
  and the prompt -- the EOS check, ``unfinished_sequences``, the stop read
  -- is then computed from known values, as eager computes it: a token
  that is not an EOS id stops no sequence, so the loop runs until
  ``max_new_tokens`` (``MaxLengthCriteria``, a shape check), as a real run
  whose sampler returns that id does;
* the integer and boolean arguments of the traced function (the prompt's
  ids, an attention mask) keep their values, as under ``md.check``: the
  attention mask's all-ones check and the pad-token check read them, and
  the trace is the run of that prompt -- one assumption per argument;
* any other read is answered only where ``values=`` names its site (a user
  line or an op, as ``md.checker(values=...)``), listed too; a read the
  policy does not answer stops with the usual ``DataDependentError``.

Each token call ends a step: ``trace.marks["prefill"]`` is the first call
of the model's forward, ``trace.marks["decode k"]`` the first after the
k-th token was chosen (none after the last token: no forward follows), so ``md.memory(trace,
since="decode 1")`` and ``md.generation_steps`` read the prefill and the
decode steps apart.  An ``argmax`` the model itself calls (not generate) is
assumed too; its line in the trace says so.
"""

from __future__ import annotations

import torch

from .. import _compat
from .._compat import pytree
from ..ir.assumptions import Assumption, after_warmup
from ..ir.records import arg_name
from ..source import user_frame
from ..tensor.tensor import MetaTensor
from . import known
from .realrun import to_meta_outputs

__all__ = [
    "GenerateAssumptions",
    "TOKEN_OPS",
    "FINITE_CHECK",
    "finite_gradients",
    "site_values",
    "given",
    "checked_given",
    "know_index_inputs",
]

# The ops that choose the next token: greedy (argmax) and sampled (multinomial).
TOKEN_OPS = frozenset({"aten.argmax.default", "aten.multinomial.default"})
SCALAR_READ = "aten._local_scalar_dense.default"


class GenerateAssumptions:
    """What ``md.tracer(assume=...)`` declares about a generation loop (Note [Generating under declared assumptions]).

    ``token_id``: the value of every next token (``argmax``, ``multinomial``);
    ``values``: answers for other reads, by site, as ``md.checker(values=...)``.

    >>> import torch, metadispatch as md
    >>> def pick(logits):
    ...     token = logits.argmax(-1)
    ...     return token if bool(token == 3) else None
    >>> t = md.tracer(assume=md.GenerateAssumptions(token_id=3))(pick, torch.ones(1, 8))
    >>> [a.value for a in t.assumptions], t.output is not None
    (['tokens = 3', 'True'], True)
    """

    def __init__(self, token_id: int = 0, *, values: dict | None = None) -> None:
        if type(token_id) is not int or token_id < 0:
            raise TypeError(f"GenerateAssumptions(token_id={token_id!r}): a token id, an int >= 0")
        self.token_id = token_id
        self.values = site_values(values, "GenerateAssumptions")

    def __repr__(self) -> str:
        extra = f", values={self.values!r}" if self.values else ""
        return f"GenerateAssumptions(token_id={self.token_id}{extra})"

    def start(self, mode) -> Assuming:
        """The policy's state for one recording ``mode``: it writes into ``mode.trace``."""
        return Assuming(self, mode)


class Assuming:
    """One trace's answers under a :class:`GenerateAssumptions` (the mode's ``assume``)."""

    ops = TOKEN_OPS

    def __init__(self, policy: GenerateAssumptions, mode) -> None:
        self.policy, self.mode = policy, mode
        self.used: set = set()  # keys of ``values`` that named a site
        self.steps = 0
        self.tokens_at: list[int] = []  # the token calls, in order

    def tokens(self, name: str, result, args: tuple = ()) -> str:
        """Give a token call's output the declared id; the call's note."""
        trace = self.mode.trace
        index = len(trace.calls)  # the call being recorded
        outs = [o for o in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(o, MetaTensor)]
        with _compat.no_python_dispatch():
            for o in outs:
                known.declare(o, torch.full(tuple(o.shape), self.policy.token_id, dtype=o.dtype), self.mode)
        value = f"tokens = {self.policy.token_id}"
        basis = repr(self.policy)
        trace.assumptions.append(Assumption(index, name, _module(self.mode), user_frame(), value, basis))
        self.steps += 1
        self.tokens_at.append(index)
        return f"assumed {value}: {basis}"

    def finish(self, trace, cut: int = 0) -> None:
        """Mark each step where the model's forward starts: the first call in a module
        after the previous token (``"prefill"`` before the first), if there is one.

        ``cut``: ``trace`` is the calls from ``cut`` on (``warmup=``; its
        assumptions were cut with it, after :meth:`forget_warmup`)."""
        calls, start = trace.calls, 0
        for k, end in enumerate([*(i - cut for i in self.tokens_at if i >= cut), len(calls)]):
            first = next((i for i in range(start, end) if calls[i].module), None)
            if first is not None:
                trace.marks.setdefault("prefill" if k == 0 else f"decode {k}", first)
            start = end + 1

    def forget_warmup(self, trace, cut: int) -> None:
        """Before ``trace`` is cut at ``cut`` (``warmup=``): what the warm-up
        runs assumed goes; the arguments' assumptions (call 0) hold for every
        run and stay.  (``step_from`` then renumbers the rest.)

        Note [Warm-up assumptions: declared ones go, made-up ones stay]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        The two rules differ on purpose.  Under ``assume=`` every value is
        the policy's, declared by the user for every run: a warm-up's
        ``tokens = 0`` is the same declaration as the step's, so listing it
        again says nothing new, and a serving plan reads the step's own
        list (one entry a token).  A guessing mode (``md.check``,
        ``guessing_mode``; no ``assume``) makes values up that nobody
        declared -- Adafactor's ``param.norm().item()`` -- and what the
        warm-up made up shaped the state the step starts from (a branch
        taken, a size chosen), so ``step_from`` keeps them at call 0,
        marked ``before the cut, at call #N`` (Note [What the calls before
        a cut leave alive] in ir/cut.py).  Tested side by side in
        tests/tracing/test_steady_state.py."""
        trace.assumptions = after_warmup(trace.assumptions, cut)

    def follows(self, name: str, out) -> str:
        """A read answered from values computed from the declared tokens (the stop
        check): listed as what the tokens imply; the call's note."""
        shown = str(out) if not isinstance(out, (torch.Tensor, tuple)) else "its outputs"
        basis = f"computed from {self.policy!r}'s tokens"
        trace = self.mode.trace
        trace.assumptions.append(Assumption(len(trace.calls), name, _module(self.mode), user_frame(), shown, basis))
        return f"assumed {shown}: {basis}"

    def read(self, name: str, device, args: tuple = (), kwargs: dict | None = None):
        """The outputs ``values=`` gives a data-dependent call at this site, and its note; None if it gives none."""
        source = user_frame()
        found = given(self.policy.values, self.used, name, source)
        if found is None:
            return None
        key, value = found
        out = checked_given(name, key, value)
        shown = str(out) if not isinstance(out, (torch.Tensor, tuple)) else "its outputs"
        basis = f"given by values[{key!r}]"
        trace = self.mode.trace
        trace.assumptions.append(Assumption(len(trace.calls), name, _module(self.mode), source, shown, basis))
        if not isinstance(out, (torch.Tensor, tuple)):
            return out, f"assumed {shown}: {basis}"
        return to_meta_outputs(out, device), f"assumed {shown}: {basis}"

    def inputs(self, args, kwargs) -> None:
        """The traced function's integer and boolean arguments keep their values, each an assumption."""
        for path, t in pytree.tree_flatten_with_path((args, kwargs))[0]:
            if know_index_input(self.mode, t):
                self.mode.trace.assumptions.append(
                    Assumption(0, f"arg {arg_name(path)}", "", None, "its values", f"{self.policy!r}: the prompt's")
                )


# Note [GradScaler's found_inf]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``GradScaler.step`` asks ``found_inf.item()`` whether the unscaled
# gradients had an inf or a NaN, and skips ``optimizer.step`` when they did.
# A MetaTensor holds no gradients to check.  A mode that makes up what it
# cannot compute (``md.check``, a ``guessing_mode`` -- FitCheck's) declares
# the common step's answer instead, where the flag is written:
# after ``_amp_foreach_non_finite_check_and_unscale_`` the flag is the known
# value 0 -- no inf/nan found, the step is taken -- so the ``.item()`` read
# and ``_amp_update_scale_`` compute from it as eager does for a finite step,
# and the call lists one :class:`Assumption` in ``trace.assumptions`` (the
# op, the user's line) and is noted so.  Before, the flag only got the bounds
# [0, 0] and a guessing mode made its read up from them, listed nowhere a
# traced step shows (FitCheck's trace had no assumption); made up from a
# standard normal it said "found" and dropped the optimizer step, its state
# and the peak.  A plain ``md.trace`` (and one with ``assume=``, whose
# policy is about generation) still stops at the read with a
# DataDependentError: it assumes nothing it was not told to.  Limit: the
# read is answered from the known flag before ``values=`` is asked, so
# ``md.checker(values=...)`` cannot make this step skip its optimizer step.
FINITE_CHECK = "aten._amp_foreach_non_finite_check_and_unscale_.default"
_NO_INF = "no inf/nan found in the unscaled gradients: GradScaler takes the optimizer step"


def finite_gradients(mode, args: tuple, kwargs: dict) -> str | None:
    """Declare the flag a :data:`FINITE_CHECK` call wrote 0 and list it (Note [GradScaler's found_inf]); the call's note."""
    found_inf = args[1] if len(args) > 1 else kwargs.get("found_inf")
    if not isinstance(found_inf, MetaTensor):
        return None
    with _compat.no_python_dispatch():
        known.declare(found_inf, torch.zeros(tuple(found_inf.shape), dtype=found_inf.dtype), mode)
    value = "found_inf = 0"
    trace = mode.trace
    trace.assumptions.append(Assumption(len(trace.calls), FINITE_CHECK, _module(mode), user_frame(), value, _NO_INF))
    return f"assumed {value}: {_NO_INF}"


def site_values(values, who: str) -> dict:
    """``values=`` as a dict keyed by site: a user line or an op name."""
    values = dict(values or {})
    for key in values:
        if not isinstance(key, str):
            raise TypeError(
                f"{who}(values=...): a key names a site, 'model.py:12' or 'aten.nonzero.default'; got {key!r}"
            )
    return values


def given(values: dict, used: set, name: str, source: str | None):
    """(key, value) from a value policy for this site -- its user line, with or
    without ``in fn``, or its op -- or None; the key goes into ``used``."""
    keys = [source, source.split(" in ")[0]] if source else []
    for key in keys + [name]:
        if key in values:
            used.add(key)
            return key, values[key]
    return None


def checked_given(name: str, key: str, value):
    """The value given for a call, if it can stand for what the op returns."""
    if name == SCALAR_READ:
        if isinstance(value, (bool, int, float, complex)):
            return value
        raise TypeError(f"values[{key!r}]: {name} reads a number; give a number, got {type(value).__name__}")
    if isinstance(value, torch.Tensor) or (
        isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return tuple(value) if isinstance(value, list) else value
    raise TypeError(
        f"values[{key!r}]: {name} returns tensors; give a tensor or a tuple of them, got {type(value).__name__}"
    )


def know_index_inputs(mode, args, kwargs) -> None:
    """The user's integer and boolean example inputs keep their values (a copy).

    Lengths, ids, labels and masks are how the user's data shapes the run:
    ``pack_padded_sequence(x, lengths)`` packs to the batch sizes of the
    real ``lengths``, not of made-up ones.  Floating inputs stay data.
    """
    for t in pytree.tree_leaves((args, kwargs)):  # what md.trace converts: not a module's buffers
        know_index_input(mode, t)


def know_index_input(mode, t) -> bool:
    """Give one argument's stand-in its value if it is an integer or boolean tensor; whether it did."""
    if type(t) is torch.Tensor and is_index(t) and not t.requires_grad and t.device.type != "meta":
        known.know(mode.from_tensor(t), t, mode)
        return True
    return False


def is_index(t) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex)


def _module(mode) -> str:
    modules = mode._recorder.modules
    return modules.current() if modules is not None else ""
