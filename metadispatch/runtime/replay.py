"""Replay: run a trace for real and check every recorded result.

``md.replay(trace, ...)`` walks the recorded calls in order, micrograd-style:
bind ids to real tensors, call the op, compare what the real kernel returned
with what the trace said it would.  Forward and backward calls are all in the
trace, so replay needs no autograd: gradients are simply the tensors the
recorded backward calls compute.  The walk itself is written out as straight
Python once per trace (``program.py``); this module runs it and checks.

Every logical device in the trace maps to the one replay device, so a trace
recorded "on cuda" on a laptop replays on CPU.

Note [Replay never writes its inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Tensors handed to replay -- arguments, a module's parameters and buffers, the
constants stored in the trace -- must come out unchanged, yet the trace may
update them in place (batch-norm running statistics, ``x.add_(1)``).  Before
running, we find every leaf that some call may write, following the trace's
variables through each op's schema (writes.py) -- never the trace's storage
numbers, which a file can forge -- and bind those leaves, and every leaf
whose real tensor shares their storage, to copies.  Copies are made per
storage, not per tensor, so two leaves that alias keep aliasing.  While
running, a call about to write a tensor whose storage is the caller's is
refused (:class:`~metadispatch.errors.ReplayError`) before it runs.

Note [In-place ops and views in replay]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The trace gives an in-place result the id of the tensor it mutated, and a view
a fresh id on its base's storage.  Replaying the real ops reproduces both for
free: the real in-place op mutates the very tensor bound to that id (and so
every real view of it), and the real view op returns a real view.  We only
rebind the id to the returned object, which is the same tensor.

Note [Significant strides]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The stride of a dimension of size 1, or of any dimension of an empty tensor,
never decides where an element lives, and meta kernels and real kernels
legitimately disagree on it.  Like torch's own cross-reference tests, we
compare only the strides that matter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils import _pytree as pytree

from .. import _compat
from ..core.tensor import normalize_device
from ..errors import ReplayError
from ..ir.text import printable
from ..ir.trace import TensorMeta, Trace
from .budget import Budget, check_budget, default_budget
from .leaves import bind_leaves, caller_tensors, leaf_bytes
from .program import program
from .writes import write_guard

__all__ = ["replay", "Replay", "Mismatch", "execute", "compare", "Budget"]


class Mismatch(NamedTuple):
    """A call whose real result differs from its recorded metadata."""

    index: int  # position of the call in the trace
    op: str
    module: str
    rule: str  # router stage that produced the metadata: "user", "meta", ...
    output: int  # which tensor output of the call, in order
    fields: tuple  # names of the fields that differ
    expected: dict  # field -> recorded value
    actual: dict  # field -> real value

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        diffs = "; ".join(f"{f} expected {self.expected[f]}, got {self.actual[f]}"
                          for f in self.fields)
        return f"#{self.index} {self.op}{where} [{self.rule}] output {self.output}: {diffs}"


class Replay:
    """The result of :func:`replay`: real outputs, gradients and mismatches."""

    def __init__(self, output, grads: dict, buffers: dict, mismatches: list) -> None:
        self.output = output  # what fn returned, with real tensors
        self.grads = grads  # parameter name -> real gradient
        self.buffers = buffers  # buffer name -> its real value after the trace
        self.mismatches = mismatches

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def __repr__(self) -> str:
        return f"<Replay: {'ok' if self.ok else f'{len(self.mismatches)} mismatches'}>"

    def __str__(self) -> str:
        """One line if every call matched, else one line per mismatch."""
        if self.ok:
            return "replay ok: every recorded result matched the real kernel"
        lines = [f"replay found {len(self.mismatches)} mismatch(es) between recorded and real metadata:"]
        lines += [f"  {m}" for m in self.mismatches]
        return "\n".join(lines)


def replay(trace: Trace, args=(), kwargs=None, *, module=None, device="cpu", seed: int = 0,
           check: bool = True, budget: Budget | None = None) -> Replay:
    """Run ``trace`` for real on ``device`` and check each call's metadata.

    ``budget`` (:class:`~metadispatch.runtime.budget.Budget`) caps the peak bytes
    replay allocates and the FLOPs it runs, checked before anything runs
    (Note [Budgets] in budget.py); the default is half the memory free on
    ``device`` and 10**12 FLOPs on a CPU.  Replay never changes the tensors
    it is given (Note [Replay never writes its inputs]); a call of a kernel
    that fails raises :class:`~metadispatch.errors.ReplayError` naming it.

    >>> import torch, metadispatch as md
    >>> lin = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3)
    >>> t = md.trace(lambda x: lin(x).relu(), x)
    >>> r = md.replay(t, (x,), module=lin)
    >>> r.ok, torch.equal(r.output, lin(x).relu())
    (True, True)
    """
    device = normalize_device(device)
    env, mismatches = execute(trace, lambda: bind_leaves(trace, args, kwargs, module, device, seed),
                              device, check, seed=seed,
                              protect=caller_tensors(trace, args, kwargs, module),
                              budget=budget or default_budget(device),
                              leaf_bytes=leaf_bytes(trace, args, kwargs, module))
    out = pytree.tree_map(lambda m: env[m.id] if isinstance(m, TensorMeta) else m,
                          trace.output_meta, is_leaf=lambda x: isinstance(x, TensorMeta))
    grads = {name: env[m.id] for name, m in trace.grads.items()}
    buffers = {leaf.name: env[tid] for tid, leaf in trace.leaves.items() if leaf.kind == "buffer"}
    return Replay(out, grads, buffers, mismatches)


def execute(trace: Trace, bind, device, check: bool, *, seed: int = 0, rng_state=None,
            keep_all: bool = False, protect=(), budget: Budget | None = None, leaf_bytes: int = 0):
    """Run every call; return (id -> real tensor, mismatches).

    ``bind()`` gives the leaves.  The returned map holds outputs, gradients
    and buffers, or every tensor with ``keep_all``.  The default generators start from ``seed``
    (or from ``rng_state``), and the caller's generator state is restored
    afterwards.  No call may write the tensors in ``protect``; with a
    ``budget``, the trace's costs (plus ``leaf_bytes`` for binding) are
    checked before anything, binding included, runs.
    """
    if _compat.dispatch_mode_stack():
        raise RuntimeError("md.replay runs real kernels and cannot run while a dispatch "
                           "mode (such as MetaMode) is active; leave the mode first")
    if budget is not None:
        check_budget(trace, budget, leaf_bytes, keep_all)
    prog = program(trace, device, keep_all)
    guard = write_guard(protect, prog.calls)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        env = bind()
        # Seed only the generators this replay uses: torch.manual_seed also
        # queues seeds for every lazy backend, at a stack capture each.
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        else:
            torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        mismatches = _run(prog, env, gen, device, check, guard)
    return env, mismatches


def _run(prog, env: dict, gen, device, check: bool, guard) -> list:
    mismatches: list = []
    wrong: set = set()  # ids whose recorded metadata proved wrong
    calls, singles = prog.calls, prog.singles

    def chk(n, results):
        _check(calls[n], results, device, mismatches, wrong)

    def same(n, t):  # most calls return one tensor
        if not _same(singles[n], t, device):
            _check(calls[n], (t,), device, mismatches, wrong)

    try:
        prog.run(env, gen, check, chk, same, guard)
    except ReplayError:
        raise
    except Exception as e:
        n = prog.call_index(e.__traceback__)
        if n is None:
            raise
        call = calls[n]
        raise ReplayError(f"replay: call #{call.index} {printable(call.format())} failed: "
                          f"{type(e).__name__}: {printable(str(e), keep=chr(10))}",
                          call=call.index) from e
    return mismatches


def _check(call, results, device, mismatches: list, wrong: set) -> None:
    """Record mismatches of ``call``'s outputs.

    A call whose inputs already had wrong metadata inherits the error; only
    the call that introduced it is reported, as the place to look.
    """
    for k, (m, r) in enumerate(_pairs(call.outputs, results)):
        if _same(m, r, device):
            continue
        diff = compare(m, r, device)
        if diff is None:
            continue
        inherited = any(i.id in wrong for i in call.inputs)
        wrong.add(m.id)
        if not inherited:
            mismatches.append(Mismatch(call.index, call.op, call.module, call.rule, k, *diff))


def _pairs(outputs, results):
    """(TensorMeta, real tensor) for each tensor output, lists flattened."""
    for o, r in zip(outputs, results):
        if type(o) is TensorMeta:
            yield o, r
        elif type(o) is tuple:  # a list return
            yield from ((x, y) for x, y in zip(o, r) if type(x) is TensorMeta)


def _same(m: TensorMeta, t: torch.Tensor, device) -> bool:
    # The common case, kept cheap: this runs for every output of every call.
    # On CPU, t.is_cpu rather than t.device, which builds a torch.device.
    return (t.stride() == m.stride and t.shape == m.shape and t.dtype is m.dtype
            and t.storage_offset() == m.storage_offset
            and (t.is_cpu if device.type == "cpu" else t.device == device))


def compare(m: TensorMeta, t: torch.Tensor, device) -> tuple | None:
    """(fields, expected, actual) where real ``t`` differs from ``m``, else None."""
    expected = {"shape": m.shape, "dtype": m.dtype, "stride": m.stride,
                "storage_offset": m.storage_offset, "device": device}
    actual = {"shape": tuple(t.shape), "dtype": t.dtype, "stride": t.stride(),
              "storage_offset": t.storage_offset(), "device": t.device}
    fields = tuple(f for f in expected if expected[f] != actual[f])
    if "stride" in fields and "shape" not in fields and _same_significant_strides(
            m.shape, m.stride, actual["stride"]):
        fields = tuple(f for f in fields if f != "stride")
    if not fields:
        return None
    return fields, {f: expected[f] for f in fields}, {f: actual[f] for f in fields}


def _same_significant_strides(shape, a, b) -> bool:
    """Note [Significant strides]."""
    if 0 in shape:
        return True
    return all(x == y for s, x, y in zip(shape, a, b) if s > 1)
