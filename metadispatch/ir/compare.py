"""Recorded metadata against a real tensor: the one comparison and the one ``Mismatch``.

What was recorded (a :class:`~metadispatch.ir.records.TensorMeta`, or a live
MetaTensor, which reports the same attributes) is compared with what a real
kernel returned: shape, dtype, device, significant strides and storage
offset.  ``md.check``'s CPU re-check (``debug/recheck.py``) and
``md.verify_rule`` (``debug/verify.py``) use it; replay is to switch to it
(its ``compare`` in ``execution/matching.py`` still compares storage offsets of
empty tensors, which this does not).

Note [Significant strides]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A dimension of size 1 has no meaningful stride (it never addresses memory,
and kernels leave arbitrary values there), and an empty tensor addresses no
memory at all: strides are compared on dimensions of size > 1 only, and
neither strides nor storage offset for empty tensors, as
``torch._prims_common.check_significant_strides`` does.

>>> import torch
>>> real = torch.empty(4, 3).t()
>>> recorded = TensorMeta(0, (3, 4), torch.float32, (4, 1), 0, torch.device("cpu"), False, 0)
>>> differences(recorded, real)
(('stride', (4, 1), (1, 3)),)
>>> describe(*differences(recorded, real)[0])
'strides (4, 1) != (1, 3)'
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .records import TensorMeta  # noqa: F401  (what ``recorded`` usually is; the example uses it)

__all__ = ["Mismatch", "differences", "describe", "explain"]


class Mismatch(NamedTuple):
    """A recorded call whose real result differs from its recorded metadata."""

    index: int  # position of the call in the trace
    op: str
    module: str
    rule: str  # router stage that produced the metadata: "user", "meta", ...
    output: int | None  # which tensor output of the call, in order; None: the call as a whole
    fields: tuple  # names of the fields that differ
    expected: dict  # field -> recorded value
    actual: dict  # field -> real value
    problems: tuple = ()  # the differences in words, "strides (1, 4) != (4, 1)": recorded != real

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        output = "" if self.output is None else f" output {self.output}"
        diffs = "; ".join(self.problems) or "; ".join(
            f"{f} expected {self.expected[f]}, got {self.actual[f]}" for f in self.fields
        )
        return f"#{self.index} {self.op}{where} [{self.rule}]{output}: {diffs}"


def _attr(x, name: str):
    value = getattr(x, name)
    return value() if callable(value) else value  # a tensor's method or a record's field


def differences(recorded, real: torch.Tensor, device: torch.device | None = None) -> tuple:
    """``(field, recorded value, real value)`` for each field where ``real`` differs.

    ``recorded`` is a TensorMeta or a MetaTensor.  Its device is compared
    with ``device`` when one is given (the device the real run stands for),
    never with ``real.device``.  A different shape is the only difference
    reported: nothing else is comparable then.  Note [Significant strides].
    """
    shape, real_shape = tuple(recorded.shape), tuple(real.shape)
    if shape != real_shape:
        return (("shape", shape, real_shape),)
    out: list[tuple] = []
    if recorded.dtype != real.dtype:
        out.append(("dtype", recorded.dtype, real.dtype))
    recorded_device = (
        getattr(getattr(recorded, "_md", None), "device", None) or recorded.device
    )  # a MetaTensor's logical device
    if device is not None and recorded_device != device:
        out.append(("device", recorded_device, device))
    if real.numel() > 0:
        stride, real_stride = tuple(_attr(recorded, "stride")), real.stride()
        if any(n > 1 and a != b for n, a, b in zip(shape, stride, real_stride)):
            out.append(("stride", stride, real_stride))
        offset = _attr(recorded, "storage_offset")
        if offset != real.storage_offset():
            out.append(("storage_offset", offset, real.storage_offset()))
    return tuple(out)


def _t(x) -> str:
    return "(" + ", ".join(map(str, x)) + ")" if isinstance(x, tuple) else str(x)


_WORDS = {"stride": "strides", "storage_offset": "storage offset"}


def describe(field: str, recorded, real) -> str:
    """One difference in words: ``"strides (1, 4) != (4, 1)"``, recorded first."""
    return f"{_WORDS.get(field, field)} {_t(recorded)} != {_t(real)}"


def explain(recorded, real: torch.Tensor, device: torch.device | None = None) -> list[str]:
    """:func:`differences` in words."""
    return [describe(*d) for d in differences(recorded, real, device)]
