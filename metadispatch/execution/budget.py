"""Replay's budgets: the bytes and FLOPs a trace will cost, known before it runs.

A trace is a program, and a small file can describe a large one: a 373-byte
trace can fill 4 GiB, a few kilobytes can multiply 16k x 16k matrices.  So
replay works out what a trace will cost before it runs anything and refuses
one over its :class:`Budget`, naming the first call that crosses it
(:class:`~metadispatch.errors.BudgetExceededError`).

Note [Budgets]
~~~~~~~~~~~~~~
*Bytes* are the peak of what replay holds: every fresh output of a call
(schema returns that alias no argument; an in-place call that grows its
tensor, ``resize_``, counts the growth), held until the generated program
frees it (``free_points`` in program.py) and as long as any view of it
lives, plus the leaves replay makes up or copies.  *FLOPs* are torch's
formulas (``torch.utils.flop_counter``) where it has one, ``2 * output
elements * inner size`` for other products, ``n**3`` per matrix for
decompositions and solves, and one per output element for everything else --
an estimate of time, good to a small factor.

The sizes come from the trace's records for a trace recorded in this
process.  A loaded trace (``trace.untrusted``) may lie about them -- claim a
one-element result for ``aten.full([65536, 65536])`` -- so its calls are
first run on the ``meta`` device, where kernels compute output sizes from
the arguments without allocating, and the budget counts those.  A call whose
meta kernel fails (no meta kernel, data-dependent output) is counted at its
recorded size; its real kernel then runs on inputs whose sizes are known.

Limits: the FLOP estimate can be low by more than a small factor for an op
whose cost grows faster than its output (a contraction ``einsum`` named
directly); allocations inside a kernel (workspaces) are not counted.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from typing import NamedTuple
from weakref import WeakKeyDictionary

import torch
from torch.utils.flop_counter import flop_registry

from ..core.schema import arg_value, facts
from ..errors import BudgetExceededError, ReplayError
from ..ir.records import TensorMeta, tensor_metas
from ..ir.rng import is_generator
from ..ir.trace import Trace
from .program import free_points

__all__ = ["Budget", "default_budget", "check_budget", "costs"]

_META = torch.device("meta")


class Budget(NamedTuple):
    """What one replay may spend: peak bytes held and FLOPs run (None: no limit).

    >>> Budget(bytes=1 << 30, flops=10**12).bytes
    1073741824
    """

    bytes: int | None
    flops: int | None


def default_budget(device: torch.device) -> Budget:
    """Half the memory free on ``device`` now; 10**12 FLOPs on a CPU, 10**16 on a GPU."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return Budget(free // 2, 10**16)
    return Budget(_host_available() // 2, 10**12)


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


class Costs(NamedTuple):
    peak: list  # peak bytes held up to and including call i
    flops: list  # FLOPs run up to and including call i


_COSTS: WeakKeyDictionary = WeakKeyDictionary()  # trace -> {(number of calls, keep_all): Costs}


def costs(trace: Trace, keep_all: bool = False) -> Costs:
    """The running peak bytes and FLOPs of each call of ``trace`` (Note [Budgets])."""
    per_trace = _COSTS.setdefault(trace, {})
    key = (len(trace.calls), keep_all)
    if key not in per_trace:
        per_trace[key] = _Account(trace, keep_all).run()
    return per_trace[key]


def check_budget(trace: Trace, budget: Budget, leaf_bytes: int = 0, keep_all: bool = False) -> None:
    """Raise BudgetExceededError naming the first call that crosses ``budget``."""
    c = costs(trace, keep_all)
    for what, limit, running, extra in (
        ("bytes", budget.bytes, c.peak, leaf_bytes),
        ("flops", budget.flops, c.flops, 0),
    ):
        if limit is None:
            continue
        if extra > limit:
            raise BudgetExceededError(
                f"replay refused: its leaves need {_fmt(extra)} bytes, over the budget of "
                f"{_fmt(limit)} (md.replay(..., budget=Budget(bytes=N, flops=M)) sets it)",
                call=-1,
                what=what,
                need=extra,
                limit=limit,
            )
        n = bisect.bisect_right(running, limit - extra)
        if n < len(running):
            call = trace.calls[n]
            need = running[n] + extra
            raise BudgetExceededError(
                f"replay refused: call #{call.index} {call.op} brings the trace to {_fmt(need)} "
                f"{what}, over the budget of {_fmt(limit)} (md.replay(..., budget=Budget("
                "bytes=N, flops=M)) sets it; None means no limit)",
                call=call.index,
                what=what,
                need=need,
                limit=limit,
            )


def _fmt(n: int) -> str:
    return f"{n:.3g}" if n >= 10**6 else str(n)


class _Account:
    """One walk over the calls, counting allocations and FLOPs."""

    def __init__(self, trace: Trace, keep_all: bool) -> None:
        self.trace = trace
        self.free = {} if keep_all else free_points(trace)
        self.meta_env: dict | None = {} if trace.untrusted else None  # id -> meta tensor
        self.allocs: dict = {}  # id -> allocation numbers it may share memory with
        self.users: list = []  # allocation -> number of live ids on it
        self.sizes: list = []  # allocation -> bytes
        self.live = 0

    def run(self) -> Costs:
        peak, flops, running_peak, running_flops = [], [], 0, 0
        if self.meta_env is not None:
            for tid, leaf in self.trace.leaves.items():
                self.meta_env[tid] = _meta_like(leaf.meta, None)
        for n, call in enumerate(self.trace.calls):
            outs = self.outputs(call)
            running_flops += self.call(call, outs)
            for tid in self.free.get(n, ()):
                self.drop(tid)
            running_peak = max(running_peak, self.live)
            peak.append(running_peak)
            flops.append(running_flops)
        return Costs(peak, flops)

    def outputs(self, call) -> list:
        """(recorded TensorMeta, its size as real kernels see it) for each tensor output."""
        metas = [m for o in call.outputs for m in tensor_metas(o)]
        if self.meta_env is None:
            return [(m, m) for m in metas]
        env = self.meta_env
        try:
            args = [_on_meta(a, env) for a in call.args]
            kwargs = {k: _on_meta(v, env) for k, v in call.kwargs.items()}
            if not call.inputs:  # a factory: it must not run on the default device
                device = facts(call.func).device_arg
                if device is None:
                    raise ValueError("a factory without a device argument")
                if device[0] < len(args):
                    args[device[0]] = _META
                else:
                    kwargs[device[1]] = _META
            result = call.func(*args, **kwargs)
            real = [t for t in _flat(result) if isinstance(t, torch.Tensor)]
            if len(real) != len(metas):
                raise ValueError("outputs do not match the record")
        except Exception:  # no meta kernel, data-dependent: the recorded size
            real = [_meta_like(m, call) for m in metas]
        for m, t in zip(metas, real):
            env[m.id] = t
        return list(zip(metas, real))

    def call(self, call, outs: list) -> int:
        f = facts(call.func)
        k = 0
        for r, o in enumerate(call.outputs):
            shared = f.aliases[r] if r < len(f.aliases) else ()
            for m in tensor_metas(o):
                real = outs[k][1]
                k += 1
                before = self.allocs.get(m.id, ())
                if shared:
                    ids = {
                        a
                        for arg in shared
                        for x in tensor_metas(arg_value(call, arg))
                        for a in self.allocs.get(x.id, ())
                    }
                    grow = (
                        _nbytes(real) - sum(self.sizes[a] for a in before)
                        if m.id in {x.id for arg in f.writes for x in tensor_metas(arg_value(call, arg))}
                        else 0
                    )
                    if grow > 0:
                        ids.add(self.new(grow))
                else:
                    ids = {self.new(_nbytes(real))}
                self.bind(m.id, ids, before)
        return _flops(call, [r for _, r in outs], self.meta_env)

    def new(self, size: int) -> int:
        self.sizes.append(size)
        self.users.append(0)
        self.live += size
        return len(self.sizes) - 1

    def bind(self, tid: int, ids, before) -> None:
        for a in ids:
            self.users[a] += 1
        self.allocs[tid] = tuple(ids)
        for a in before:
            self.release(a)

    def drop(self, tid: int) -> None:
        for a in self.allocs.pop(tid, ()):
            self.release(a)

    def release(self, a: int) -> None:
        self.users[a] -= 1
        if self.users[a] == 0:
            self.live -= self.sizes[a]


def _nbytes(t) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


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


_PRODUCTS = re.compile(
    r"_*(?:matmul|einsum|linear|bilinear|tensordot|addmv|mv|dot|vdot|addr|outer"
    r"|ger|kron|cdist|addbmm|chain_matmul|trilinear)(?:_|$)"
)
_CUBIC = re.compile(
    r"_*(?:linalg|cholesky|lu|qr|svd|eig|symeig|solve|inverse|triangular|geqrf"
    r"|ormqr|householder|slogdet|logdet|det|lstsq|matrix_exp|pinverse)(?:_|$)"
)


def _flops(call, real_outs: list, env) -> int:
    """Note [Budgets]: an estimate of the work ``call`` does."""
    out_elems = sum(math.prod(t.shape) for t in real_outs)
    formula = flop_registry.get(call.func.overloadpacket)
    name = call.func.name().partition("::")[2].partition(".")[0]
    cubic = _CUBIC.match(name) is not None
    if formula is None and not cubic and _PRODUCTS.match(name) is None:
        return out_elems
    inputs = [_as_meta(m, env) for m in call.inputs]
    if formula is not None:
        try:
            return int(
                formula(
                    *[_on_meta(a, env) for a in call.args],
                    **{k: _on_meta(v, env) for k, v in call.kwargs.items()},
                    out_val=_out_val(call, real_outs),
                )
            )
        except Exception:  # a formula that cannot read these arguments
            pass
    biggest = max((t for t in inputs if t.dim()), key=lambda t: t.numel(), default=None)
    if biggest is None:
        return out_elems
    if cubic:
        n = max(biggest.shape[-2:])
        return math.prod(biggest.shape[:-2]) * n**3 + out_elems
    return 2 * max(out_elems, 1) * biggest.shape[-1]


def _as_meta(m: TensorMeta, env) -> torch.Tensor:
    if env is not None and m.id in env:
        return env[m.id]
    return _meta_like(m, None)


def _on_meta(a, env):
    """A recorded argument with meta tensors in place of tensor records."""
    t = type(a)
    if t is TensorMeta:
        return _as_meta(a, env)
    if t is tuple:
        return [_on_meta(x, env) for x in a]
    if isinstance(a, torch.device):
        return _META
    if is_generator(a):
        return None
    return a


def _out_val(call, real_outs: list):
    if len(real_outs) == 1 and len(call.outputs) == 1:
        return real_outs[0]
    return tuple(real_outs)
