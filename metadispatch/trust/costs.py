"""What replaying a trace will cost, worked out before anything runs (Note [Budgets] in budget.py).

One walk over the calls, linear in the trace: each output is bound to the
storage it lives in, a storage counts from the first output on it until the
last id on it is freed (``free_points``, as the generated program frees
them), and a storage that grows (``resize_``, ``set_`` with a size) counts
its growth.  For a trace recorded in this process the storages are the
records' storage numbers.  A loaded trace (``trace.untrusted``) may lie
about sizes and storages -- claim a one-element result for
``aten.full([65536, 65536])`` -- so its calls run on the ``meta`` device,
where kernels compute sizes and allocate (meta) storages without memory,
and the walk counts those.

A call the meta device cannot run is sized from its record and listed in
``Costs.unchecked``: replay checks after it runs that it returned what was
recorded (fences.py), and refuses the trace before running anything when the
call's sizes could not be bounded at all (``Costs.unknown``: no meta kernel).
Data-dependent calls are bounded as Note [Sizes known before running] in
sizes.py says.
"""

from __future__ import annotations

import math
from typing import NamedTuple
from weakref import WeakKeyDictionary

import torch

from .. import _compat
from ..errors import ReplayError
from ..ir.decode import is_marker
from ..ir.liveness import free_points
from ..ir.records import TensorMeta, tensor_metas
from ..ir.rng import is_generator
from ..ir.text import clip, printable
from ..ir.trace import Trace
from ..rules.grouped_mm import grouped_mm_output
from ..spec.schema import facts, schema_of
from .sizes import list_count, read_bound, value_sized
from .work import extent_bytes, scratch, work

__all__ = ["Costs", "costs", "fixed_costs", "c10d_returns", "CALL_WORK", "CALL_BYTES", "OUTPUT_BYTES"]

_META = torch.device("meta")
# What replay spends besides kernels, whatever the call: compiling and
# running its lines of the program takes ~100 us (10**6 FLOPs at ~10
# GFLOP/s, the speed the CPU default of 10**12 assumes), holding them ~2 KiB,
# and each output a tensor object (measured on the chained-set_ and
# many-calls files of tests/hostile_memory.py).
CALL_WORK = 10**6
CALL_BYTES = 2048
OUTPUT_BYTES = 256


# Ops whose meta function on a CPU build is not what their kernels check and
# allocate (the built-in rule's note says how): sized by the rule's port instead.
_SIZED_HERE = {torch.ops.aten._grouped_mm.default: grouped_mm_output}


class Costs(NamedTuple):
    peak: list  # peak bytes held up to and including call i (outputs and scratch)
    flops: list  # work run up to and including call i, replay's own per call included
    unchecked: frozenset  # calls sized from their record: checked after they run
    unknown: tuple  # (call, why) for calls nothing could size before running (no meta kernel)


_COSTS: WeakKeyDictionary = WeakKeyDictionary()  # trace -> {(number of calls, keep_all): Costs}
_FIXED: WeakKeyDictionary = WeakKeyDictionary()  # trace -> (number of calls, fixed_costs)


def fixed_costs(trace: Trace) -> tuple:
    """(bytes, FLOPs) replay spends on the trace's size alone: its program and
    the tensor objects of its outputs, and its own work per call.  Known
    without the walk, so that a trace of a million empty calls is refused
    before anything is done for each of them."""
    n, cached = _FIXED.get(trace, (None, None))
    if n != len(trace.calls):
        outputs = sum(len(c.output_metas) for c in trace.calls)
        cached = (len(trace.calls) * CALL_BYTES + outputs * OUTPUT_BYTES, len(trace.calls) * CALL_WORK)
        _FIXED[trace] = (len(trace.calls), cached)
    return cached


def costs(trace: Trace, keep_all: bool = False) -> Costs:
    """The running peak bytes and work of each call of ``trace``, cached per trace."""
    per_trace = _COSTS.setdefault(trace, {})
    key = (len(trace.calls), keep_all)
    if key not in per_trace:
        per_trace[key] = _Walk(trace, keep_all).run()
    return per_trace[key]


class _Walk:
    """The walk of the module docstring; ``env`` maps ids to meta tensors or records."""

    def __init__(self, trace: Trace, keep_all: bool) -> None:
        self.trace = trace
        self.meta = trace.untrusted
        self.free = {} if keep_all else free_points(trace)
        self.env: dict = {}
        self.key: dict = {}  # id -> its storage
        self.users: dict = {}  # storage -> ids on it now
        self.sizes: dict = {}  # storage -> bytes counted
        self.live = 0
        self.unchecked: set = set()
        self.unknown: list = []
        self.transient = 0  # bytes the current call allocates that no recorded output holds

    def run(self) -> Costs:
        peak, flops, running_peak, running_flops = [], [], 0, 0
        for tid, leaf in self.trace.leaves.items():
            self.pin(tid, _meta_like(leaf.meta, None) if self.meta else leaf.meta)
        for n, call in enumerate(self.trace.calls):
            inputs = [self.env[m.id] for m in call.inputs] if self.meta else list(call.inputs)
            self.transient = 0
            outs = self.outputs(n, call)
            for target, source in facts(call.func).joins:  # set_data: target now lives in source's storage
                for m, s in zip(tensor_metas(_arg(call, target)), tensor_metas(_arg(call, source))):
                    self.bind(m.id, self.env[m.id] if self.meta else s, None)
            for tid, t, nbytes in outs:
                self.bind(tid, t, nbytes)
            running_flops += work(call, inputs, [t for _, t, _ in outs], self.on_meta) + CALL_WORK
            running_peak = max(running_peak, self.live + self.transient + scratch(call, inputs))
            for tid in self.free.get(n, ()):
                self.drop(tid)
            peak.append(running_peak)
            flops.append(running_flops)
        return Costs(peak, flops, frozenset(self.unchecked), tuple(self.unknown))

    # -- sizes

    def outputs(self, n: int, call) -> list:
        """(id, tensor as the real kernel will make it, bytes or None for its extent) per output."""
        metas = [m for o in call.outputs for m in tensor_metas(o)]
        if not self.meta or is_marker(call.func):  # a marker has no tensors and never runs
            return [(m.id, m, None) for m in metas]
        args = [self.on_meta(a) for a in call.args]
        kwargs = {k: self.on_meta(v) for k, v in call.kwargs.items()}
        if not call.inputs:  # a factory: it must not run on the default device
            device = facts(call.func).device_arg
            if device is not None and device[0] < len(args):
                args[device[0]] = _META
            elif device is not None:
                kwargs[device[1]] = _META
        self.check_count(n, call, args, kwargs)
        try:
            returned = c10d_returns(
                call.func, args
            )  # Note [Collectives replay on live groups] in execution/collectives.py
            if returned is None:
                returned = _SIZED_HERE.get(call.func, call.func)(*args, **kwargs)
            result = returned
            real = [t for t in _flat(result) if isinstance(t, torch.Tensor)]
        except ReplayError:
            raise
        except Exception as e:  # no meta kernel, sizes read from data, arguments the kernel refuses
            return self.from_record(n, call, metas, e)
        for t in real:
            _refuse_layout(n, call, t)
        if len(real) != len(
            metas
        ):  # undefined outputs (Note [Undefined outputs] in execution/matching.py) or a lying record
            self.unchecked.add(n)
            self.transient = sum(math.prod(t.shape) * t.dtype.itemsize for t in real)
            return [(m.id, _meta_like(m, call), None) for m in metas]
        return [(m.id, t, None) for m, t in zip(metas, real)]

    def from_record(self, n: int, call, metas: list, error: Exception) -> list:
        """Outputs sized from the record, bounded where the op's kind allows (sizes.py)."""
        self.unchecked.add(n)
        f = facts(call.func)
        if value_sized(call.func) is not None:  # replay checks the size from values first
            bounds = [None] * len(metas)
        elif f.data_dependent:
            bounds = read_bound([self.env[m.id] for m in call.inputs], metas)
        else:
            first = (str(error).strip().splitlines() or [""])[0]
            said = f"{type(error).__name__}: {clip(printable(first), 200)}"
            if isinstance(error, NotImplementedError):
                self.unknown.append((n, f"it has no meta kernel ({said})"))
            else:  # most often arguments the real kernel refuses too
                self.unknown.append((n, f"it fails on the meta device with these arguments ({said})"))
            bounds = [None] * len(metas)
        return [
            (m.id, _meta_like(m, call), max(extent_bytes(m), b) if b is not None else None)
            for m, b in zip(metas, bounds)
        ]

    def check_count(self, n: int, call, args, kwargs) -> None:
        """Refuse a list return longer than the record, before anything builds it (sizes.py)."""
        try:
            count = list_count(call.func, args, kwargs)
        except LookupError:
            raise ReplayError(
                f"replay refused: call #{call.index} {call.op} returns a list of tensors whose length "
                "replay cannot work out before running it",
                call=call.index,
            ) from None
        except (ValueError, TypeError, IndexError, KeyError):  # read from data, or bad arguments
            return
        recorded = sum(len(o) for o in call.outputs if type(o) is tuple)
        if count is not None and count > recorded:
            raise ReplayError(
                f"replay refused: call #{call.index} {call.op} would return {count} tensors; "
                f"the trace records {recorded}",
                call=call.index,
            )

    # -- storages

    def storage(self, t):
        return t.storage if type(t) is TensorMeta else _compat.storage_key(t)

    def pin(self, tid: int, t) -> None:
        """A leaf: its storage is counted by replay's ``leaf_bytes`` and held to the end."""
        key = self.storage(t)
        if self.users.get(key, 0) == 0:
            self.users[key] = 1
        self.sizes[key] = max(self.sizes.get(key, 0), extent_bytes(t))
        self.users[key] += 1
        self.key[tid] = key
        self.env[tid] = t

    def bind(self, tid: int, t, nbytes: int | None) -> None:
        key = self.storage(t)
        need = extent_bytes(t) if nbytes is None else nbytes
        if self.users.get(key, 0) > 0:
            if need > self.sizes[key]:  # grown in place (resize_, set_ with a size)
                self.live += need - self.sizes[key]
                self.sizes[key] = need
        else:
            self.users[key] = 0
            self.sizes[key] = need
            self.live += need
        self.users[key] += 1
        old = self.key.get(tid)
        self.key[tid] = key
        self.env[tid] = t
        if old is not None:
            self.release(old)

    def drop(self, tid: int) -> None:
        key = self.key.pop(tid, None)
        self.env.pop(tid, None)
        if key is not None:
            self.release(key)

    def release(self, key) -> None:
        self.users[key] -= 1
        if self.users[key] == 0:
            self.live -= self.sizes[key]

    def on_meta(self, a):
        """A recorded argument with meta tensors in place of tensor records."""
        t = type(a)
        if t is TensorMeta:
            return self.env[a.id] if self.meta else _meta_like(a, None)
        if t is tuple:
            return [self.on_meta(x) for x in a]
        if isinstance(a, torch.device):
            return _META
        if is_generator(a):
            return None
        return a


def _arg(call, arg: tuple):
    pos, name = arg
    return call.args[pos] if pos < len(call.args) else call.kwargs.get(name)


def _refuse_layout(n: int, call, t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.is_nested or t.is_quantized:
        raise ReplayError(
            f"replay refused: call #{call.index} {call.op} returns a {str(t.layout).removeprefix('torch.')}"
            f"{' nested' if t.is_nested else ''}{' quantized' if t.is_quantized else ''} tensor; "
            "replay runs a file's calls on dense strided tensors only (the only kind a trace records)",
            call=call.index,
        )


def _meta_like(m: TensorMeta, call) -> torch.Tensor:
    try:
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=_META).as_strided(
            m.shape, m.stride, m.storage_offset
        )
    except (RuntimeError, ValueError, OverflowError) as e:
        where = f"call #{call.index} {call.op}" if call is not None else f"leaf ${m.id}"
        raise ReplayError(
            f"replay refused: {where} records an impossible tensor {m.dtype}{list(m.shape)} ({e})",
            call=None if call is None else call.index,
        ) from None


def _flat(r):
    if isinstance(r, (tuple, list)):
        for x in r:
            yield from _flat(x)
    else:
        yield r


def c10d_returns(func, args: list) -> list | None:
    """The tensors c10d op ``func`` returns, given its arguments (None: not a c10d op).

    A c10d op writes the tensors it is given and returns its first argument
    with its Work (or the Work alone): it allocates nothing, so replay's
    budget sizes it without running it."""
    if getattr(func, "namespace", None) != "c10d":
        return None
    if len(schema_of(func).returns) != 2:
        return []
    first = args[0]
    return [
        t
        for x in (first if isinstance(first, (list, tuple)) else [first])
        for t in (x if isinstance(x, (list, tuple)) else [x])
    ]
