"""Matching what a replayed call returned against its record: the check behind ``Replay.ok``.

Each output of each call is compared with its :class:`TensorMeta` --
shape, dtype, strides, storage offset, device (:func:`matcher`, the hot
check the generated program calls) -- and each number it returned with the
one recorded (Note [Values fixed into a trace]); a difference is a
:class:`Mismatch`, reported at the call that introduced it.
"""

from __future__ import annotations

import torch

from ..binding.devices import target
from ..ir.trace import TensorMeta
from .result import Mismatch

__all__ = ["check_call", "matcher", "compare"]


def check_call(call, results, device, mismatches: list, wrong: set, same_meta=None, keep_cpu: bool = False) -> None:
    """Record mismatches of ``call``'s outputs.

    A call whose inputs already had wrong metadata inherits the error; only
    the call that introduced it is reported, as the place to look.
    ``same_meta`` is :func:`matcher` of ``device``, when the caller has it.
    """
    same_meta = same_meta or matcher(device, keep_cpu)
    _check_values(call, results, mismatches)
    for k, (m, r) in enumerate(_pairs(call.outputs, results)):
        if not isinstance(r, torch.Tensor):
            diff = _undefined(m, r)
        elif same_meta(m, r):
            continue
        else:
            diff = compare(m, r, target(m.device, device, keep_cpu))
        if diff is None:
            continue
        inherited = any(i.id in wrong for i in call.inputs)
        wrong.add(m.id)
        if not inherited:
            mismatches.append(Mismatch(call.index, call.op, call.module, call.rule, k, *diff))


_NUMBERS = (bool, int, float, complex)


def _check_values(call, results, mismatches: list) -> None:
    """Note [Values fixed into a trace]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A call that returns a number (``.item()``, ``bool(t)``) hands the traced
    program a Python value, and every later call that used it holds it as
    a constant: BatchNorm's ``momentum=None`` divides by
    ``num_batches_tracked.item()`` and passes the quotient to the kernel.
    The value was read when traced -- from a known value (a counter buffer,
    a small constant) or, under ``md.check``, the real run -- so replay
    given another counter, or other data, would run the traced constant and
    say ``ok`` while eager computes something else.  So each number a call
    returns in replay is compared with the one recorded; a difference is a
    mismatch of the call's ``value``, and replay is not ``ok``.
    """
    for k, (o, r) in enumerate(zip(call.outputs, results)):
        if type(o) in _NUMBERS and type(r) in _NUMBERS and not (o == r or (o != o and r != r)):
            mismatches.append(
                Mismatch(
                    call.index,
                    call.op,
                    call.module,
                    call.rule,
                    k,
                    ("value",),
                    {"value": o},
                    {"value": r},
                    (
                        f"value {o!r} when traced, {r!r} now: later calls hold the traced value "
                        "as a constant, so this replay is not the eager run of what it was given",
                    ),
                )
            )


def _undefined(m: TensorMeta, r) -> tuple | None:
    """Note [Undefined outputs]: a real kernel returned ``r`` (None, a number) for tensor ``m``.

    Note [Undefined outputs]
    ~~~~~~~~~~~~~~~~~~~~~~~~
    Some kernels return an undefined tensor -- None in Python -- where their
    meta function returns an empty one: ``_native_multi_head_attention``'s
    weights with ``need_weights=False``.  An empty tensor and an undefined
    one hold the same (no) values, so that is a match; a recorded tensor
    with elements that comes back undefined, or as a number, is a mismatch.
    """
    if r is None and m.numel == 0:
        return None
    return ("defined",), {"defined": f"tensor {m.type_str()}"}, {"defined": type(r).__name__}


def _pairs(outputs, results):
    """(TensorMeta, real tensor) for each tensor output, lists flattened."""
    for o, r in zip(outputs, results):
        if type(o) is TensorMeta:
            yield o, r
        elif type(o) is tuple:  # a list return
            yield from ((x, y) for x, y in zip(o, r) if type(x) is TensorMeta)


def matcher(device, keep_cpu: bool = False):
    """``same(m, t)``: real ``t`` has exactly ``m``'s metadata on ``device``.

    Note [The hot check]
    ~~~~~~~~~~~~~~~~~~~~
    This runs for every output of every call, so what is known before the
    run is decided before it: ``device.type`` is a property that builds a
    string (about 1 us, as much as the rest of the check), so it is read
    once here, not per tensor.  On CPU, ``t.is_cpu`` rather than ``t.device``,
    which builds a torch.device.
    """
    if device.type == "cpu":
        return lambda m, t: (
            t.stride() == m.stride
            and t.shape == m.shape
            and t.dtype is m.dtype
            and t.storage_offset() == m.storage_offset
            and t.is_cpu
        )
    if keep_cpu:  # Note [Devices in replay]
        return lambda m, t: (
            t.stride() == m.stride
            and t.shape == m.shape
            and t.dtype is m.dtype
            and t.storage_offset() == m.storage_offset
            and (t.is_cpu if m.device.type == "cpu" else t.device == device)
        )
    return lambda m, t: (
        t.stride() == m.stride
        and t.shape == m.shape
        and t.dtype is m.dtype
        and t.storage_offset() == m.storage_offset
        and t.device == device
    )


def compare(m: TensorMeta, t: torch.Tensor, device) -> tuple | None:
    """(fields, expected, actual) where real ``t`` differs from ``m``, else None."""
    expected = {
        "shape": m.shape,
        "dtype": m.dtype,
        "stride": m.stride,
        "storage_offset": m.storage_offset,
        "device": device,
    }
    actual = {
        "shape": tuple(t.shape),
        "dtype": t.dtype,
        "stride": t.stride(),
        "storage_offset": t.storage_offset(),
        "device": t.device,
    }
    fields = tuple(f for f in expected if expected[f] != actual[f])
    if "stride" in fields and "shape" not in fields and _same_significant_strides(m.shape, m.stride, actual["stride"]):
        fields = tuple(f for f in fields if f != "stride")
    if not fields:
        return None
    return fields, {f: expected[f] for f in fields}, {f: actual[f] for f in fields}


def _same_significant_strides(shape, a, b) -> bool:
    """Note [Significant strides] in ir/compare.py."""
    if 0 in shape:
        return True
    return all(x == y for s, x, y in zip(shape, a, b) if s > 1)
