"""Tensor records: what a tensor reported at one point of a trace, and leaves.

:class:`TensorMeta` is the one description of a tensor's metadata in the
package, and :func:`type_str` its one printed form (``f32[2, 4]{1, 2}+3@cuda:0``),
used for records, live MetaTensors and error messages alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from .._compat import pytree
from .text import clip

__all__ = [
    "attribute_tensors",
    "PLAIN_TYPES",
    "TensorMeta",
    "Leaf",
    "Group",
    "dtype_abbr",
    "type_str",
    "tensor_metas",
    "tensor_bytes",
    "contiguous_strides",
    "arg_name",
    "describe_constant",
]

_DTYPE_ABBR = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.complex32: "c32",
    torch.uint16: "u16",
    torch.uint32: "u32",
    torch.uint64: "u64",
    torch.float8_e4m3fn: "f8e4m3",
    torch.float8_e5m2: "f8e5m2",
}


def dtype_abbr(dtype: torch.dtype) -> str:
    return _DTYPE_ABBR.get(dtype) or str(dtype).replace("torch.", "")


def contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def type_str(
    dtype: torch.dtype, shape, stride=None, storage_offset: int = 0, device=None, show_cpu: bool = False
) -> str:
    """``f32[2, 4]``; strides in braces when given and not contiguous, ``+offset``,
    ``@device`` when not CPU (or always, with ``show_cpu``: error messages about devices).

    >>> type_str(torch.float32, (2, 3), (1, 2), 0, torch.device("cuda", 1))
    'f32[2, 3]{1, 2}@cuda:1'
    """
    shape = tuple(shape)
    s = f"{dtype_abbr(dtype)}[{', '.join(map(str, shape))}]"
    if stride is not None and shape and tuple(stride) != contiguous_strides(shape):
        s += "{" + ", ".join(map(str, stride)) + "}"
    if storage_offset:
        s += f"+{storage_offset}"
    if device is not None and (show_cpu or torch.device(device).type != "cpu"):
        s += f"@{device}"
    return clip(s, _SHOWN_CHARS)


# A record is stored once and printed at every use; an 8-dimensional tensor
# with large strides prints in about 100 characters (see ``clip``).
_SHOWN_CHARS = 200


# Argument values that are their own record: kept as they are in a call's
# arguments, and in cache keys as ``(type, value)``.
PLAIN_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class TensorMeta(NamedTuple):
    """What a real tensor would report, at one point of the trace."""

    id: int
    shape: tuple
    dtype: torch.dtype
    stride: tuple
    storage_offset: int
    device: torch.device
    requires_grad: bool
    storage: int  # equal for tensors that share a storage (views, in-place)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def type_str(self) -> str:
        """``f32[2, 4]``, plus strides when not contiguous, offset and device."""
        return type_str(self.dtype, self.shape, self.stride, self.storage_offset, self.device)

    def __str__(self) -> str:
        return f"${self.id}"


class Leaf(NamedTuple):
    """A tensor that came from outside the trace."""

    meta: TensorMeta
    kind: str  # "arg", "param", "buffer", "grad", "const", "input", or "view"
    name: str  # for a view: its base, "param fc1.weight"
    value: Any = None  # a small real tensor for constants, else None

    def describe(self) -> str:
        """``param fc1.weight``, ``arg args[0]``, ``const [1.0, 2.0]``, ``view of param w``."""
        if self.kind == "view":
            return f"view of {clip(self.name, _SHOWN_CHARS)}"
        text = f"{self.kind} {clip(self.name, _SHOWN_CHARS)}".rstrip()
        if self.value is not None and self.value.numel() <= 8:
            text += f" {self.value.tolist()}"
        return text


class Group(NamedTuple):
    """A process group a collective ran on, as the traced rank saw it.

    ``name`` is torch's group name, ``size`` its number of ranks, ``rank``
    the traced rank's place in it and ``ranks`` its members' global ranks.
    """

    name: str
    size: int
    rank: int
    ranks: tuple

    def __repr__(self) -> str:
        return f"group({self.name!r}, rank {self.rank} of {self.size})"


def tensor_bytes(m: TensorMeta) -> int:
    """Bytes of storage a tensor reaches: up to its last element."""
    if any(s == 0 for s in m.shape):
        return 0
    last = m.storage_offset + sum((s - 1) * st for s, st in zip(m.shape, m.stride))
    return (last + 1) * m.dtype.itemsize


def tensor_metas(x) -> Iterator[TensorMeta]:
    if isinstance(x, TensorMeta):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from tensor_metas(y)


_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


def describe_constant(v) -> str:
    """How a non-tensor argument is recorded: ``2``, ``'mean'``, ``<module>``, ``<Config>``.

    Note [Non-tensor arguments are constants]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A number, string or flag the traced call was given decided what the
    trace recorded (``x * n`` baked ``n`` into the call), so replay must be
    given the same one: a trace is not a function of it.  Plain values are
    recorded by ``repr``; modules (bound by their tensors) and other objects
    by their kind only, which is all replay can compare.
    """
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, torch.nn.Module):
        return "<module>"
    return f"<{type(v).__qualname__}>"


def arg_name(path) -> str:
    """The leaf name of an argument at a pytree key path: ``args[0]``, ``args[1]['mask']``, ``x``."""
    head, rest = path[0].idx, path[1:]
    if head == 0:
        return f"args[{rest[0].idx}]" + pytree.keystr(rest[1:])
    return f"{rest[0].key}" + pytree.keystr(rest[1:])


def attribute_tensors(module) -> list:
    """(name, tensor) of each plain tensor a module tree holds on an attribute
    (``self.scale = torch.tensor(2.0)``: neither parameter nor buffer), named
    as parameters are: ``blocks.0.scale``.

    A constant leaf that was such a tensor is named so (Note [Values fixed
    into a trace] in execution/matching.py): replay given the module compares
    the value it holds now with the one the trace fixed."""
    out = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for key, v in vars(sub).items():
            if type(v) is torch.Tensor:
                out.append((f"{prefix}.{key}" if prefix else key, v))
    return out
