"""A trace compiled for replay: one line of straight Python per recorded call.

Replay is micrograd's loop -- bind ids to real tensors, call the op, check the
result -- but a loop that interprets each call (copy the argument list, fill
tensor slots from a dict, unpack a record) costs a few microseconds per call,
as much as a small kernel.  So :func:`program` writes the loop out once per
trace, the way ``torch.fx`` writes a graph's ``forward``::

    t7 = mm(t5, t6)
    ck and same(12, t7)
    del t5

and a call that writes an argument is preceded by ``wr(13, t7)``, the guard
of binding/writes.py.  A trace loaded from a file also gets its fences (Note
[Fences] in trust/fences.py): ``fit(12, t7, 0)`` after each call, ``pre(12, ...)``
before one whose output size is read from its inputs' values or whose
kernel follows them unchecked (trust/index_checks.py).

Tensor ids become local variables and constants are bound once; an op is
called through torch's Python binding where that is proven to dispatch the
recorded overload (Note [Calling ops through their Python bindings] in
bindings.py), else as the overload.  Checking stays with ``replay.py``,
which passes it in.  (Checks written inline, as one expression per call,
saved ~0.3 us per call and tripled the time ``compile`` takes -- already
~35 us per call, paid once per trace.)  ``Program.source``
shows the generated code, and :meth:`Program.call_index` maps a failing line
back to the recorded call.

Note [Freeing early]
~~~~~~~~~~~~~~~~~~~~
Eager execution frees an activation as soon as backward has used it; replay
would otherwise hold every intermediate until the end, and on a model of any
size the extra allocations (fresh pages, not reused blocks) cost more time
than the kernels.  So the program drops the ids no later call reads, except
those the result needs: outputs, gradients and buffers -- and, when the trace
recorded storage deaths, no earlier than the traced run freed them.

Note [Grad mode in replay]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Replay needs no autograd (backward's calls are in the trace) and runs under
``no_grad``, but a few kernels answer differently by grad mode: oneDNN's
LSTM layer returns its workspace only with grad enabled, and its backward
fails without it.  Eager ran forward with grad enabled and backward and
optimizer steps without, so the program switches grad mode where the phase
changes (``grad(True)``).  No replayed tensor requires grad, so autograd
records nothing.  Limit: a forward traced under ``torch.no_grad()`` replays
with grad enabled (grad mode is not recorded per call).

Note [Generated code from untrusted traces]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A trace may come from a file anyone wrote, so nothing from it is pasted into
the source as text: locals are ``t`` plus an integer id, op and constant
names are made here (``k3``, ``mm_default``, a dtype's own name, or the
``__name__`` of one of torch's own Python bindings: bindings.py), and the
only literals are ``repr`` of None, bools and ints.  A keyword argument's
name is written as ``name=`` only when it is a parameter of the op's schema
(the reader refuses others at load; this checks again for traces built in
memory).
"""

from __future__ import annotations

import bisect
import keyword
import re
from typing import Any, NamedTuple
from weakref import WeakKeyDictionary

import torch

from .. import _compat
from ..binding.devices import CPU, keeps_cpu
from ..binding.streams import stream_of
from ..binding.writes import written_args
from ..errors import ReplayError
from ..ir.decode import is_marker
from ..ir.liveness import free_points
from ..ir.records import TensorMeta
from ..ir.rng import GeneratorRef, is_generator
from ..ir.trace import Trace
from ..spec.schema import facts, schema_of
from ..trust.index_checks import needs_pre
from ..trust.sizes import value_sized
from .bindings import binding
from .collectives import collective_callable, is_collective

__all__ = ["Program", "program"]

_FILENAME = "<metadispatch replay>"
_LOCALS = frozenset({"env", "gens", "ck", "chk", "same", "wr", "rng", "fit", "pre", "r"})  # run's own names


class Program(NamedTuple):
    """``run(env, gens, ck, chk, same, wr, rng, fit, pre)`` executes every call of the trace.

    ``env`` maps ids to real tensors: it holds the leaves on entry and the
    tensors that outlive the program on exit; ``gens`` maps a recorded
    generator's index to the generator replay gives it (-1: one an older
    version recorded without an index); ``rng(i)`` performs the trace's
    ``i``-th RNG state event (binding/streams.py).  When ``ck`` is true, ``same(n, t)`` checks the one tensor that
    call ``n`` returned and ``chk(n, results)`` the results of any other call.
    ``wr(n, *tensors)`` sees the tensors call ``n`` will write, before it runs;
    ``fit`` and ``pre`` are the fences of an untrusted trace (trust/fences.py).
    """

    run: Any
    source: str
    calls: list  # the trace's OpCalls, by position
    singles: list  # each call's TensorMeta where it returns one tensor, else None
    starts: list  # first source line of each call
    generator_uses: dict  # generator index -> first call passing it
    default_draws: dict  # default generator stream ("cpu", "cuda:0") -> first call drawing from it

    def call_index(self, tb) -> int | None:
        """The position of the call that raised, from a traceback."""
        while tb is not None:
            if tb.tb_frame.f_code is self.run.__code__:
                return max(bisect.bisect_right(self.starts, tb.tb_lineno) - 1, 0)
            tb = tb.tb_next
        return None


_PROGRAMS: WeakKeyDictionary = WeakKeyDictionary()  # trace -> {(device, number of calls, keep_all): Program}


def program(trace: Trace, device: torch.device, keep_all: bool = False, fenced: frozenset | None = None) -> Program:
    """``trace`` compiled for replay on ``device``, cached per trace.

    With ``keep_all`` every tensor stays in ``env``; otherwise each is freed
    after its last use (Note [Freeing early]).  With ``fenced`` (a trace
    loaded from a file: the calls the budget sized from their record), the
    calls get their fences (Note [Fences] in trust/fences.py).
    """
    per_trace = _PROGRAMS.setdefault(trace, {})
    keep_cpu = keeps_cpu(trace, device)  # Note [Devices in replay]
    key = (device, len(trace.calls), keep_all, fenced)
    if key not in per_trace:
        _check_kernels(trace.calls, device)
        free = {} if keep_all else free_points(trace)
        per_trace[key] = _Writer(device, fenced, trace.groups, keep_cpu).write(trace.calls, free, trace.rng_events)
    return per_trace[key]


def _check_kernels(calls: list, device: torch.device) -> None:
    """Refuse, before anything runs, a trace holding an op with no kernel on ``device``.

    A trace for a logical CUDA device holds the kernels torch would pick
    there (``_scaled_dot_product_efficient_attention``); the CPU has none of
    them, and a kernel that computes the same function (the math attention)
    does not compute the same bits, so replay does not substitute one.
    """
    seen: set = set()
    for call in calls:
        if call.func in seen:
            continue
        seen.add(call.func)
        if not is_marker(call.func) and not _compat.runs_on(call.func, device.type):
            # the device the trace was made for: its tensors' other than this one
            # (a CPU scalar or index sits beside a GPU kernel's inputs)
            there = sorted({m.device.type for m in call.inputs + call.output_metas} - {device.type})
            made_for = " or ".join(there) or "another device"
            raise ReplayError(
                f"replay: call #{call.index} {call.op} has no {device.type} kernel: the trace was recorded "
                f"for {made_for}, where torch picks this kernel. Replay it on {made_for}, or trace the step "
                f"for {device.type}. Nothing was run",
                call=call.index,
            )


class _Writer:
    """Writes one program; holds the names it has bound so far."""

    def __init__(
        self, device: torch.device, fenced: frozenset | None = None, groups: dict | None = None, keep_cpu: bool = False
    ) -> None:
        self.device = device
        self.keep_cpu = keep_cpu
        self.groups = groups or {}  # a distributed trace's process groups, by name
        self.fenced = fenced
        self.names: dict = {"dev": device, "cpu": CPU, "grad": torch.set_grad_enabled}  # the program's globals
        self.grad = False  # grad mode at this point of the program: replay starts under no_grad
        self.ops: dict = {}  # op -> global name
        self.fast: dict = {}  # Python binding -> global name (Note [Calling ops through their Python bindings])
        self.bound: set = set()  # ids that are local variables by now
        self.lines: list = ["def run(env, gens, ck, chk, same, wr, rng, fit, pre):"]
        self.generator_uses: dict = {}
        self.call_number = 0
        self.default_draws: dict = {}

    def write(self, calls: list, free: dict, events=()) -> Program:
        starts, singles, freed = [], [], set()
        at: dict = {}  # call position -> indexes of the RNG events just before it
        for i, e in enumerate(events):
            at.setdefault(min(e.at, len(calls)), []).append(i)
        for n, call in enumerate(calls):
            starts.append(len(self.lines) + 1)
            if (call.phase == "forward") != self.grad:  # Note [Grad mode in replay]
                self.grad = not self.grad
                self.lines.append(f"    grad({self.grad})")
            self.lines += [f"    rng({i})" for i in at.get(n, ())]
            self._note_draw(n, call)
            self.call_number = n
            outs = call.outputs
            singles.append(outs[0] if len(outs) == 1 and type(outs[0]) is TensorMeta else None)
            self._call(n, call, singles[-1])
            for tid in free.get(n, ()):
                self.lines.append(f"    del t{tid}")
                freed.add(tid)
        # Whatever was not freed outlives the program: outputs, gradients,
        # buffers, or everything with keep_all.
        self.lines += [f"    rng({i})" for i in at.get(len(calls), ())]
        self.lines += [f"    env[{tid}] = t{tid}" for tid in sorted(self.bound - freed)]
        self.lines.append("    return")
        source = "\n".join(self.lines) + "\n"
        exec(compile(source, _FILENAME, "exec"), self.names)  # noqa: S102 -- our own code
        return Program(self.names["run"], source, list(calls), singles, starts, self.generator_uses, self.default_draws)

    def _note_draw(self, n: int, call) -> None:
        """Note the first call drawing from each default generator (binding/streams.py)."""
        if not facts(call.func).random or any(is_generator(a) for a in (*call.args, *call.kwargs.values())):
            return
        outs = call.output_metas or call.inputs
        if outs:
            self.default_draws.setdefault(stream_of(outs[0].device), n)

    def _call(self, n: int, call, single: TensorMeta | None) -> None:
        if is_marker(call.func):  # a record_function range: nothing to run
            self.lines.append("    pass")
            return
        args = ", ".join(
            [self._arg(a) for a in call.args] + [f"{_keyword(call, k)}={self._arg(v)}" for k, v in call.kwargs.items()]
        )
        op = self._callable(call)
        written = written_args(call)
        if written:
            self.lines.append(f"    wr({n}, {', '.join(self._use(m.id) for m in written)})")
        fit = self._fit(n, call)
        if self.fenced is not None and (value_sized(call.func) is not None or needs_pre(call.func)):
            self.lines.append(f"    pre({n}{', ' if args else ''}{args})")
        if single is not None:
            t = self._define(single.id)
            self.lines.append(f"    {t} = {op}({args})")
            if fit:
                self.lines.append(f"    fit({n}, {t}, {fit})")
            self.lines.append(f"    ck and same({n}, {t})")
            return
        self.lines.append(f"    r = {op}({args})")
        if fit:
            self.lines.append(f"    fit({n}, r, {fit})")
        outs = call.outputs
        if not outs:  # ops returning nothing (``_foreach_add_``) only mutate
            return
        result = "r" if len(outs) > 1 else "(r,)"
        for k, o in enumerate(outs):
            if type(o) is TensorMeta:
                self.lines.append(f"    {self._define(o.id)} = {result}[{k}]")
            elif type(o) is tuple:  # a list return
                self.lines += [
                    f"    {self._define(x.id)} = {result}[{k}][{j}]" for j, x in enumerate(o) if type(x) is TensorMeta
                ]
        self.lines.append(f"    if ck: chk({n}, {result})")

    def _fit(self, n: int, call) -> str:
        """The fence after call ``n``: ``1`` where an output may alias an argument
        (a view to bounds-check), ``0`` where the budget sized the call from its
        record, ``""`` for none -- a fresh output of a call the budget ran on
        meta is allocated to fit, in the layout meta showed."""
        if self.fenced is None:
            return ""
        if any(facts(call.func).aliases):
            return "1"
        return "0" if n in self.fenced else ""

    def _arg(self, a) -> str:
        if isinstance(a, TensorMeta):
            return self._use(a.id)
        if type(a) is tuple and any(isinstance(x, TensorMeta) for x in a):
            return "[" + ", ".join(self._arg(x) for x in a) + "]"
        if isinstance(a, torch.device):  # Note [Devices in replay]
            return "cpu" if self.keep_cpu and a.type == "cpu" else "dev"
        if is_generator(a):
            k = int(a.index) if type(a) is GeneratorRef else -1
            self.generator_uses.setdefault(k, self.call_number)
            return f"gens[{k}]"
        return self._const(a)

    def _use(self, tid: int) -> str:
        """The local for ``tid``, read from ``env`` at its first use (a leaf)."""
        if tid not in self.bound:
            self.bound.add(tid)
            self.lines.append(f"    t{tid} = env.pop({tid})")
        return f"t{tid}"

    def _define(self, tid: int) -> str:
        self.bound.add(tid)
        return f"t{tid}"

    def _const(self, v) -> str:
        if v is None or type(v) in (bool, int):
            return repr(v)
        name = f"k{len(self.names)}"
        if isinstance(v, torch.dtype):  # ``dtype=float32`` reads best
            named = str(v).removeprefix("torch.")
            if named.isidentifier() and self.names.get(named, v) is v:
                name = named
        self.names[name] = v
        return name

    def _callable(self, call) -> str:
        """The global that runs ``call``: its op's Python binding where that is
        proven to dispatch the same overload (bindings.py), else the op."""
        if is_collective(call.func):
            return self._op(call.func)
        fast = binding(call.func, call.args, call.kwargs)
        if fast is None:
            return self._op(call.func)
        if fast not in self.fast:
            name = fast.__name__
            if not name.isidentifier() or keyword.iskeyword(name) or name in self.names or name in _LOCALS:
                name = f"{self._op(call.func)}_py"
            self.fast[fast] = name
            self.names[name] = fast
        return self.fast[fast]

    def _op(self, func) -> str:
        """``mm_default`` for aten.mm.default; a number added if that is taken."""
        if func not in self.ops:
            base = name = re.sub(r"\W", "_", "_".join(str(func).split(".")[-2:]), flags=re.ASCII)
            if not base.isidentifier() or keyword.iskeyword(base):
                base = name = "op"
            while name in self.names:
                name = f"{base}{len(self.names)}"
            self.ops[func] = name
            # Note [Collectives replay on live groups] in collectives.py
            self.names[name] = (
                collective_callable(func, self.groups) if is_collective(func) else _compat.op_callable(func)
            )
        return self.ops[func]


def _keyword(call, name) -> str:
    """``name`` if it is a parameter of the op's schema (Note [Generated code from untrusted traces])."""
    if not (
        isinstance(name, str)
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and any(a.name == name for a in schema_of(call.func).arguments)
    ):
        raise ReplayError(
            f"call #{call.index} {call.op}: {name!r} is not a parameter of its schema; replay does not pass it",
            call=call.index,
        )
    return name
