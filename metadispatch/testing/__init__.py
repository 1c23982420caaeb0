"""Assertions for test suites: same ops as another function, or as a golden string.

Both compare canonical forms (:func:`metadispatch.debug.diff.canonical`), so they
do not depend on memory addresses, checkout paths, id numbering or the
keyword defaults that torch's bindings pass in one version and not the next.

>>> import torch, metadispatch as md
>>> md.testing.assert_same_ops(lambda x: x * 2, lambda x: 2 * x, torch.ones(3))
>>> md.testing.assert_same_ops(lambda x: x * 2, lambda x: x + x, torch.ones(3))
Traceback (most recent call last):
  ...
AssertionError: the two functions run different ops:
--- a
+++ b
@@ -1,2 +1,2 @@
 $0: f32[3] = arg
-$1: f32[3] = aten.mul.Tensor($0, 2)
+$1: f32[3] = aten.add.Tensor($0, $0)

``collectives`` logs the collectives of a real distributed run, as
``md.comms`` lists a trace's.

Golden traces use expecttest: ``expected`` must be a string literal at the
call site, which ``EXPECTTEST_ACCEPT=1 pytest`` rewrites in place::

    md.testing.assert_trace(mode.trace, \"\"\"\\
    $0: f32[3] = arg args[0]
    \"\"\")
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _compat
from .._compat import pytree
from ..debug.diff import canonical, diff
from ..ir.trace import Trace
from ..mode.mode import MetaMode
from ..spec.schema import facts
from ..tensor.tensor import MetaTensor
from ..tracing.reach import walk
from ..tracing.tracer import tracer
from .collectives import CollectiveLog

__all__ = [
    "this_gpu_profile",
    "assert_same_ops",
    "assert_trace",
    "expected_form",
    "Call",
    "eager_calls",
    "trace_calls",
    "assert_matches_eager",
    "snapshot",
    "Snapshot",
    "CollectiveLog",
]


class Call(NamedTuple):
    """One dispatched op and its outputs' metadata, comparable between a
    real run and a trace: ``(shape, dtype, stride, storage offset, device)``.
    Strides are the significant ones: a dimension of size 1 has none (its
    stride never addresses memory; kernels leave arbitrary values there), as
    in ``torch._prims_common.check_significant_strides``."""

    op: str
    outputs: tuple


_PRIM_DEVICE = torch.ops.prim.device.default


def _meta(shape, dtype, stride, offset, device) -> tuple:
    significant = tuple(st if n > 1 else None for n, st in zip(shape, stride))
    return shape, dtype, significant, offset, device


class _EagerLog(_compat.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not _PRIM_DEVICE and facts(func).implicit_composite:
            # Reached only without the autograd keys (inference mode): the
            # backend runs the composite's body, so its calls are what is
            # dispatched, as FlopCounterMode counts them (Note [Composites
            # that reach the mode] in core/dispatch.py).
            with self, _compat.as_at_the_backend():
                return func.decompose(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func is _PRIM_DEVICE:  # a functorch wrapper asking for its device: not an op
            return out
        metas = tuple(
            _meta(tuple(t.shape), t.dtype, t.stride(), t.storage_offset(), t.device)
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor)
        )
        self.calls.append(Call(str(func), metas))
        return out


def eager_calls(fn: Callable, *args, **kwargs) -> list[Call]:
    """The ops a real run of ``fn`` dispatches, logged by a ``TorchDispatchMode``."""
    with _EagerLog() as log:
        fn(*args, **kwargs)
    return log.calls


def this_gpu_profile():
    """The built-in GPU profile of this host's CUDA device 0 (same compute
    capability and SM count, nearest memory), with its total memory and the
    installed torch's CUDA and cuDNN versions, which SDPA's choice reads: what
    a trace must be recorded for to be compared with this GPU's real run
    (``tools/gpu_conformance.py``, ``tests/test_real_gpu.py``).  Not
    registered: it travels with the trace (mode/mode.py)."""
    import dataclasses

    from ..errors import MetaDispatchError
    from ..spec.profiles import gpu_profiles

    if not torch.cuda.is_available():
        raise MetaDispatchError("this_gpu_profile(): this host has no CUDA device")
    props = torch.cuda.get_device_properties(0)
    cap = (props.major, props.minor)
    same = [
        p
        for p in gpu_profiles().values()
        if tuple(p.compute_capability) == cap and p.sm_count == props.multi_processor_count
    ]
    if not same:
        raise MetaDispatchError(f"no GPU profile has sm{cap[0]}{cap[1]} with {props.multi_processor_count} SMs")
    base = min(same, key=lambda p: abs(p.memory - props.total_memory))
    major, minor = (int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    return dataclasses.replace(
        base,
        name=f"{base.name}-here",
        title=props.name,
        memory=props.total_memory,
        cuda_version=major * 1000 + minor * 10,
        cudnn_version=torch.backends.cudnn.version() or 0,
    )


def trace_calls(trace: Trace) -> list[Call]:
    """A trace's calls in the form :func:`eager_calls` gives."""
    return [
        Call(c.op, tuple(_meta(tuple(m.shape), m.dtype, m.stride, m.storage_offset, m.device) for m in c.output_metas))
        for c in trace.calls
    ]


def _first_difference(real: list[Call], traced: list[Call]) -> str | None:
    for i, (a, b) in enumerate(zip(real, traced)):
        if a != b:
            return f"call #{i}: real {a}\n{' ' * (len(str(i)) + 8)}traced {b}"
    if len(real) != len(traced):
        return f"real run has {len(real)} calls, the trace {len(traced)}"
    return None


def assert_matches_eager(fn: Callable, *args, **kwargs) -> Trace:
    """Trace ``fn`` on a logical CPU, run it for real, and fail unless the
    trace dispatches the same ops, in order, with the same output metadata.

    The trace runs first: it leaves the user's modules untouched, while the
    real run writes their ``.grad``.

    >>> import torch, metadispatch as md
    >>> conv = torch.nn.Conv2d(3, 8, 3)
    >>> x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    >>> t = md.testing.assert_matches_eager(lambda x: conv(x).sum().backward(), x)
    >>> t[0].outputs[0].stride   # channels-last, as oneDNN gives it
    (288, 1, 48, 8)
    """
    trace = tracer()(fn, *args, **kwargs)
    problem = _first_difference(eager_calls(fn, *args, **kwargs), trace_calls(trace))
    if problem:
        raise AssertionError("the trace differs from the real run:\n" + problem)
    return trace


def assert_same_ops(
    fn_a: Callable, fn_b: Callable, *args, device=None, modules: bool = False, names: bool = False, **kwargs
) -> None:
    """Fail, showing :func:`metadispatch.diff`, unless both run the same ops.

    Each function is traced with ``md.trace`` on the same arguments (on
    logical ``device`` if given); their traces must be equivalent.
    """
    run = tracer(device=device)
    a = run(fn_a, *args, **kwargs)
    b = run(fn_b, *args, **kwargs)
    d = diff(a, b, modules=modules, names=names)
    if d:
        raise AssertionError("the two functions run different ops:\n" + d)


def expected_form(trace: Trace | MetaMode | str) -> str:
    """The text a golden trace is compared with: canonical, with modules and names."""
    if isinstance(trace, MetaMode):
        trace = trace.trace
    return "\n".join(canonical(trace)) + "\n"


def assert_trace(trace: Trace | MetaMode | str, expected: str, *, skip: int = 0) -> None:
    """Compare a trace with the golden string literal ``expected`` (expecttest).

    With ``EXPECTTEST_ACCEPT=1`` a mismatch rewrites the literal in the
    caller's source instead of failing.  ``skip`` is the number of helper
    frames between the literal and this call.
    """
    try:
        import expecttest  # a test dependency only
    except ImportError:
        raise ModuleNotFoundError(
            "golden traces (metadispatch.testing.assert_trace, the expect_trace fixture) need expecttest, "
            "which a plain install of metadispatch lacks: pip install expecttest "
            "(or the test extra: pip install 'metadispatch[test]')",
            name="expecttest",
        ) from None
    expecttest.assert_expected_inline(expected_form(trace), expected, skip=1 + skip)


class Snapshot:
    """Everything reachable from some roots, by path: identities, values, versions.

    Compare two with ``==``; :meth:`diff` says what changed, one path a
    line.  A snapshot keeps what it saw alive, so identities stay
    meaningful.  ``metas`` lists the paths that hold a MetaTensor.
    """

    def __init__(self, entries: dict, metas: list, alive: list) -> None:
        self.entries = entries
        self.metas = metas
        self._alive = alive

    def __eq__(self, other) -> bool:
        return isinstance(other, Snapshot) and self.entries == other.entries

    def __repr__(self) -> str:
        return f"<Snapshot of {len(self.entries)} paths, {len(self.metas)} MetaTensors>"

    def assert_unchanged(self, after: Snapshot) -> None:
        """Fail, naming each path, if ``after`` reaches a MetaTensor or differs from ``self``.

        >>> import torch, metadispatch as md
        >>> model = torch.nn.Linear(2, 2)
        >>> before = md.testing.snapshot(model)
        >>> _ = md.trace(lambda x: model(x).sum().backward(), torch.ones(1, 2))
        >>> before.assert_unchanged(md.testing.snapshot(model))
        """
        problems = [f"{path}: a MetaTensor" for path in after.metas]
        changed = self.diff(after)
        if problems or changed:
            raise AssertionError("\n".join(["the state changed:", *problems, *filter(None, [changed])]))

    def diff(self, other: Snapshot) -> str:
        """What differs from ``self`` (before) to ``other`` (after), a path a line; empty when equal."""
        lines = []
        for path in list(self.entries) + [p for p in other.entries if p not in self.entries]:
            a, b = self.entries.get(path, "(absent)"), other.entries.get(path, "(absent)")
            if a != b:
                lines.append(f"{path}: {_show(a)} -> {_show(b)}")
        return "\n".join(lines)


def snapshot(*roots: Any, rng: bool = True, **named: Any) -> Snapshot:
    """Snapshot what ``roots`` reach (see ``metadispatch/tracing/reach.py``), and the RNG states.

    Roots are modules, optimizers, schedulers, tensors, containers,
    generators, functions (their closures and the globals they name).  Take
    it outside any MetaMode.

    >>> import torch, metadispatch as md
    >>> model = torch.nn.Linear(2, 2)
    >>> before = md.testing.snapshot(model)
    >>> with torch.no_grad():
    ...     _ = model.weight.mul_(2)
    >>> print(before.diff(md.testing.snapshot(model)))  # doctest: +ELLIPSIS
    root0._parameters['weight']: Parameter id=0x... v1 sha1:... -> Parameter id=0x... v2 sha1:...
    """
    start = {f"root{i}": r for i, r in enumerate(roots)}
    start.update(named)
    entries, metas, alive = {}, [], []
    with _compat.no_torch_function():
        for path, obj, first in walk(start):
            alive.append(obj)
            if first is not None:
                entries[path] = ("same object as", first)
                continue
            entries[path] = _describe(obj)
            if isinstance(obj, MetaTensor):
                metas.append(path)
        if rng:
            cpu, cuda = _compat.rng_states()
            entries["<torch CPU generator>"] = ("state", _digest(cpu))
            for i, state in enumerate(cuda or ()):
                entries[f"<torch cuda:{i} generator>"] = ("state", _digest(state))
    return Snapshot(entries, metas, alive)


def _describe(obj) -> tuple:
    if isinstance(obj, torch.nn.parameter.UninitializedTensorMixin):
        return (type(obj).__name__, id(obj), "uninitialized")
    if isinstance(obj, torch.Tensor):
        kind = type(obj).__name__
        data = "no data" if isinstance(obj, MetaTensor) or obj.is_meta else _digest(obj)
        return (
            kind,
            id(obj),
            str(obj.dtype),
            tuple(obj.shape),
            obj.stride(),
            obj.storage_offset(),
            str(obj.device),
            obj.requires_grad,
            f"v{obj._version}",
            data,
        )
    if isinstance(obj, torch.Generator):
        return ("Generator", id(obj), _digest(obj.get_state()))
    if isinstance(obj, (int, float, complex, bool, str, bytes, type(None))):
        return (type(obj).__name__, repr(obj))
    if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
        return (type(obj).__name__, str(obj))
    return (type(obj).__name__, id(obj))


def _digest(t: torch.Tensor) -> str:
    t = t.detach()
    if t.layout != torch.strided:  # sparse: the values it stands for
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj().resolve_neg())
    raw = t.cpu().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    return "sha1:" + hashlib.sha1(raw.numpy().tobytes()).hexdigest()[:12]


def _show(entry) -> str:
    if isinstance(entry, str):
        return entry
    if entry and entry[0] == "same object as":
        return f"same object as {entry[1]}"
    parts = []
    for x in entry:
        parts.append(f"id={x:#x}" if isinstance(x, int) and x > 1 << 20 else str(x))
    return " ".join(parts)
