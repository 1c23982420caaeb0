"""Replay: run a trace for real and check every recorded result.

``md.replay(trace, ...)`` walks the recorded calls in order, micrograd-style:
bind ids to real tensors, call the op, compare what the real kernel returned
with what the trace said it would.  Forward and backward calls are all in the
trace, so replay needs no autograd: gradients are simply the tensors the
recorded backward calls compute.  The walk itself is written out as straight
Python once per trace (``program.py``); this module runs it and checks.

Every logical device in the trace maps to the one replay device, so a trace
recorded "on cuda" on a laptop replays on CPU (but a GPU trace's CPU tensors
stay on the CPU when it replays on a GPU: Note [Devices in replay] in binding/devices.py).

Note [Replay never writes its inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Tensors handed to replay -- arguments, a module's parameters and buffers, the
constants stored in the trace -- must come out unchanged, yet the trace may
update them in place (batch-norm running statistics, ``x.add_(1)``).  Before
running, we find every leaf that some call may write, following the trace's
variables through each op's schema (binding/writes.py) -- never the trace's storage
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

Note [Threads in replay]
~~~~~~~~~~~~~~~~~~~~~~~~
A CPU reduction splits its input among the threads it has and adds the
partial sums in order, so ``x.sum()`` of four million float32 differs in its
last bits between one thread and two; every call's metadata still matches.
Likewise ``aten.convolution`` picks its CPU kernel (oneDNN, NNPACK, or
torch's own) by global switches, and the kernels round differently.  The
trace records ``torch.get_num_threads()`` and the convolution switches when
tracing began (``trace.threads``, ``trace.conv_switches``), and a CPU replay
runs with them, then gives back the caller's -- as it gives back the
generators.  A file without them (written before they were kept) replays
with the caller's.  Limit: a switch flipped inside the traced step
(``torch.backends.mkldnn.flags``) is not recorded.

Strides are compared where they decide where an element lives (Note
[Significant strides] in ir/compare.py), as torch's own cross-reference
tests compare them.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .. import _compat
from .._compat import pytree
from ..binding.devices import keeps_cpu
from ..binding.inputs import check_device, check_inputs
from ..binding.leaves import bind_leaves, caller_tensors, leaf_bytes
from ..binding.streams import MadeUp, Streams
from ..binding.writes import write_guard
from ..errors import ReplayError, ReplayInputError
from ..ir.text import printable
from ..ir.trace import TensorMeta, Trace
from ..trust.budget import Budget, check_budget, default_budget
from ..trust.costs import costs
from ..trust.fences import fences, no_fence
from ..trust.index_checks import screen
from .collectives import check_world
from .matching import check_call, matcher
from .program import program
from .reference import reference_run
from .result import Mismatch, Replay, Tolerance
from .timing import Clock
from .uninit import uninitialised_reads

__all__ = ["replay", "Replay", "Mismatch", "MadeUp", "Tolerance", "execute", "Budget"]


def replay(
    trace,
    args=(),
    kwargs=None,
    *,
    module=None,
    device="cpu",
    seed: int = 0,
    check: bool = True,
    budget: Budget | None = None,
    allow_made_up: bool = False,
    timing: bool = False,
) -> Replay:
    """Run ``trace`` for real on ``device`` and check each call's metadata.

    ``trace`` is a :class:`Trace` or the path of a saved one.  Inputs are
    bound to the trace's leaves by name; an input that cannot be bound is
    refused with :class:`~metadispatch.errors.ReplayInputError` (binding/inputs.py).
    Leaves not given at all, and random streams the trace holds no state
    for, are made up from ``seed`` and listed in ``Replay.made_up``; they make
    the result not ``ok`` unless ``allow_made_up``.  Random ops draw exactly
    what eager drew, from the states the trace recorded (binding/streams.py).

    ``budget`` (:class:`~metadispatch.trust.budget.Budget`) caps the peak bytes
    replay allocates and the FLOPs it runs, checked before anything runs
    (Note [Budgets] in trust/budget.py); the default is half the memory free on
    ``device`` and 10**12 FLOPs on a CPU.  Replay never changes the tensors
    it is given (Note [Replay never writes its inputs]) nor the caller's
    generators; a call of a kernel that fails raises
    :class:`~metadispatch.errors.ReplayError` naming it.

    ``timing=True`` measures each call (Note [Timing replayed calls] in
    timing.py): ``Replay.times[i]`` is call ``i``'s seconds, which
    ``md.calibrate`` turns into ``md.runtime``'s efficiency table.

    >>> import torch, metadispatch as md
    >>> lin = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3)
    >>> t = md.trace(lambda x: torch.nn.functional.dropout(lin(x)), x)
    >>> r = md.replay(t, (x,), module=lin)
    >>> r.ok, r.made_up
    (True, [])
    >>> md.replay(t, module=lin)  # no x: made up
    <Replay: not ok: 1 made up>
    """
    trace = _as_trace(trace)
    device = check_device(device)
    given = check_inputs(trace, args, kwargs, module)
    made_up: list = []
    clock = Clock(device, len(trace.calls)) if timing else None
    env, mismatches, streams = execute(
        trace,
        lambda: bind_leaves(trace, args, kwargs, module, device, seed, made_up, given),
        device,
        check,
        seed=seed,
        protect=caller_tensors(trace, args, kwargs, module, given),
        budget=budget or default_budget(device),
        leaf_bytes=leaf_bytes(trace, args, kwargs, module, given),
        clock=clock,
    )
    out = pytree.tree_map(
        lambda m: env[m.id] if isinstance(m, TensorMeta) else m,
        trace.output_meta,
        is_leaf=lambda x: isinstance(x, TensorMeta),
    )
    grads = {name: env[m.id] for name, m in trace.grads.items()}
    buffers = {leaf.name: env[tid] for tid, leaf in trace.leaves.items() if leaf.kind == "buffer"}
    return Replay(
        out,
        grads,
        buffers,
        mismatches,
        made_up + streams.made_up + uninitialised_reads(trace),
        allow_made_up,
        _tolerance(device),
        checked=check,
        times=clock.times if clock else None,
    )


def _as_trace(trace) -> Trace:
    if isinstance(trace, Trace):
        return trace
    if isinstance(trace, (str, os.PathLike)):
        return Trace.load(trace)
    raise ReplayInputError(f"replay: expected a Trace or the path of a saved one, got {type(trace).__name__}")


def _tolerance(device) -> Tolerance | None:
    if device.type == "cpu" or torch.are_deterministic_algorithms_enabled():
        return None
    return Tolerance(
        1e-5,
        1e-5,
        f"{device.type} kernels that accumulate with atomics (index_add, "
        "scatter_add, embedding backward) sum in no fixed order; "
        "torch.use_deterministic_algorithms(True) makes them exact",
    )


def execute(
    trace: Trace,
    bind,
    device,
    check: bool,
    *,
    seed: int = 0,
    keep_all: bool = False,
    protect=(),
    budget: Budget | None = None,
    leaf_bytes: int = 0,
    clock: Clock | None = None,
    interpreted: bool = False,
):
    """Run every call; return (id -> real tensor, mismatches, :class:`Streams`).

    ``bind()`` gives the leaves.  The returned map holds outputs, gradients
    and buffers, or every tensor with ``keep_all``.  The generators start
    from the states the trace recorded (``seed`` for those it did not), and
    the caller's generator state is restored afterwards.  No call may write
    the tensors in ``protect``; with a ``budget``, the trace's costs (plus
    ``leaf_bytes`` for binding) are checked before anything, binding
    included, runs.  A ``clock`` times each call.  ``interpreted`` runs the
    reference loop instead of the generated program (Note [The reference loop]
    in reference.py).
    """
    if _compat.dispatch_mode_stack():
        raise RuntimeError(
            "md.replay runs real kernels and cannot run while a dispatch "
            "mode (such as MetaMode) is active; leave the mode first"
        )
    check_world(trace)
    if trace.untrusted:
        screen(trace.calls)  # Note [Values that become positions]: ops a loaded trace may not run
    if budget is not None:
        check_budget(trace, budget, leaf_bytes, keep_all)
    unchecked = costs(trace, keep_all).unchecked if trace.untrusted else None
    prog = program(trace, device, keep_all, unchecked)
    if interpreted:
        prog = prog._replace(
            run=reference_run(prog.calls, device, keeps_cpu(trace, device), trace.groups, trace.rng_events)
        )
    guard = write_guard(protect, prog.calls)
    fit, pre = fences(prog.calls, unchecked) if unchecked is not None else (no_fence, no_fence)
    cuda = [device.index or 0] if device.type == "cuda" else []
    cpu = device.type == "cpu"
    with (
        torch.random.fork_rng(devices=cuda),
        torch.no_grad(),
        _cpu_settings(trace.threads if cpu else None, trace.conv_switches if cpu else None),
    ):
        env = bind()
        streams = Streams(trace, prog, device, seed)
        streams.start()
        mismatches = _run(prog, env, streams, device, check, guard, fit, pre, clock, keeps_cpu(trace, device))
    return env, mismatches, streams


@contextlib.contextmanager
def _cpu_settings(threads: int | None, switches: tuple | None):
    """Note [Threads in replay]: run with ``threads`` and the convolution ``switches``, then as before."""
    before = (torch.get_num_threads(), _compat.cpu_conv_switches())
    if (threads is None or threads == before[0]) and (switches is None or switches == before[1]):
        yield
        return
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if switches is not None:
            _compat.set_cpu_conv_switches(switches)
        yield
    finally:
        torch.set_num_threads(before[0])
        _compat.set_cpu_conv_switches(before[1])


def _run(prog, env: dict, streams: Streams, device, check: bool, guard, fit, pre, clock=None, keep_cpu=False) -> list:
    mismatches: list = []
    wrong: set = set()  # ids whose recorded metadata proved wrong
    calls, singles = prog.calls, prog.singles
    same_meta = matcher(device, keep_cpu)

    def chk(n, results):
        check_call(calls[n], results, device, mismatches, wrong, same_meta, keep_cpu)

    if device.type == "cpu":

        def same(
            n, t
        ):  # most calls return one tensor: same_meta written out, a frame fewer (Note [The hot check] in matching.py)
            m = singles[n]
            if t is None or not (
                t.stride() == m.stride
                and t.shape == m.shape
                and t.dtype is m.dtype
                and t.storage_offset() == m.storage_offset
                and t.is_cpu
            ):
                check_call(calls[n], (t,), device, mismatches, wrong, same_meta, keep_cpu)

    else:

        def same(n, t):
            if t is None or not same_meta(singles[n], t):
                check_call(calls[n], (t,), device, mismatches, wrong, same_meta, keep_cpu)

    if clock is not None:  # Note [Timing replayed calls]: the check callbacks read the clock
        index = lambda n: calls[n].index  # noqa: E731
        chk, same = clock.wrap(chk if check else None, index), clock.wrap(same if check else None, index)
        clock.start()
    try:
        prog.run(env, streams.gens, check or clock is not None, chk, same, guard, streams.event, fit, pre)
    except ReplayError:
        raise
    except Exception as e:
        n = prog.call_index(e.__traceback__)
        if n is None:
            raise
        call = calls[n]
        raise ReplayError(
            f"replay: call #{call.index} {printable(call.format())} failed: "
            f"{type(e).__name__}: {printable(str(e), keep=chr(10))}",
            call=call.index,
        ) from e
    return mismatches
