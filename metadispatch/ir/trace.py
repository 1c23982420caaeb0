"""The recorded trace: small immutable records and their printed form.

A :class:`Trace` is a list of :class:`OpCall`, one per aten call, forward and
backward, in the order they ran.  Tensors are referred to by short ids
(``$N``) through :class:`TensorMeta` records that hold everything a real
tensor would report: shape, dtype, strides, storage offset, logical device and
``requires_grad``.  Tensors that entered from outside (arguments, parameters,
buffers, constants) are :class:`Leaf` entries with a name.

The printed form, one call a line, is deterministic so that golden tests can
compare it with ``assertExpectedInline``::

    $2: f32[2, 4] = aten.mm.default($0, $1)  # fc1

Records are immutable; what replay needs (the op, arguments with tensor
placeholders, constants, the intended device) is all here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator, NamedTuple

import torch

__all__ = ["TensorMeta", "OpCall", "Leaf", "Trace", "dtype_abbr"]

_DTYPE_ABBR = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
    torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32",
    torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
    torch.complex64: "c64", torch.complex128: "c128", torch.complex32: "c32",
    torch.uint16: "u16", torch.uint32: "u32", torch.uint64: "u64",
    torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2",
}


def dtype_abbr(dtype: torch.dtype) -> str:
    return _DTYPE_ABBR.get(dtype) or str(dtype).replace("torch.", "")


def _contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


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
        s = f"{dtype_abbr(self.dtype)}[{', '.join(map(str, self.shape))}]"
        if self.shape and self.stride != _contiguous_strides(self.shape):
            s += "{" + ", ".join(map(str, self.stride)) + "}"
        if self.storage_offset:
            s += f"+{self.storage_offset}"
        if self.device.type != "cpu":
            s += f"@{self.device}"
        return s

    def __str__(self) -> str:
        return f"${self.id}"


class Leaf(NamedTuple):
    """A tensor that came from outside the trace."""

    meta: TensorMeta
    kind: str  # "arg", "param", "buffer", "const" or "input"
    name: str
    value: Any = None  # a small real tensor for constants, else None

    def describe(self) -> str:
        """``param fc1.weight``, ``arg args[0]``, ``const [1.0, 2.0]``."""
        text = f"{self.kind} {self.name}".rstrip()
        if self.value is not None and self.value.numel() <= 8:
            text += f" {self.value.tolist()}"
        return text


_NO_KWARGS: dict = {}


class OpCall:
    """One recorded aten call.  Immutable by convention; ``__slots__`` keep it small."""

    __slots__ = ("index", "func", "op", "args", "kwargs", "outputs", "module",
                 "phase", "rule", "source", "note")

    def __init__(self, index, func, op, args, kwargs, outputs, module, phase, rule,
                 source=None, note=None):
        self.index = index
        self.func = func  # the OpOverload
        self.op = op  # its name, "aten.mm.default"
        self.args = args  # tensors appear as TensorMeta
        self.kwargs = kwargs or _NO_KWARGS
        self.outputs = outputs  # tuple of TensorMeta / plain values, one per return
        self.module = module
        self.phase = phase  # "forward", "backward" or "optimizer" (in optimizer.step)
        self.rule = rule  # "user", "builtin", "meta", "decomp" (router stage)
        self.source = source  # "file.py:12 in fn" when MetaMode(stack=True)
        self.note = note  # set by later stages (keep-going, known values)

    @property
    def inputs(self) -> tuple:
        return tuple(_tensor_metas((self.args, tuple(self.kwargs.values()))))

    @property
    def output_metas(self) -> tuple:
        return tuple(_tensor_metas(self.outputs))

    def __repr__(self) -> str:
        return f"<OpCall #{self.index} {self.format()}>"

    def repro(self, device="cpu") -> str:
        """A standalone Python snippet that runs this call for real and checks it."""
        from .repro import repro

        return repro(self, device)

    def format(self) -> str:
        outs = ", ".join(_fmt_out(o) for o in self.outputs) or "_"
        parts = [_fmt_arg(a) for a in self.args]
        parts += [f"{k}={_fmt_arg(v)}" for k, v in self.kwargs.items()]
        line = f"{outs} = {self.op}({', '.join(parts)})"
        comment = []
        if self.module:
            comment.append(self.module)
        if self.phase != "forward":
            comment.append("(bw)" if self.phase == "backward" else "(opt)")
        if self.rule not in ("meta", "builtin"):
            comment.append(f"[{self.rule}]")
        if self.note:
            comment.append(f"<{self.note}>")
        if comment:
            line += "  # " + " ".join(comment)
        return line


def _tensor_metas(x) -> Iterator[TensorMeta]:
    if isinstance(x, TensorMeta):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensor_metas(y)


def _fmt_out(o) -> str:
    if isinstance(o, TensorMeta):
        return f"${o.id}: {o.type_str()}"
    if isinstance(o, (tuple, list)):
        return "[" + ", ".join(_fmt_out(x) for x in o) + "]"
    return repr(o)


def _fmt_arg(a) -> str:
    if isinstance(a, TensorMeta):
        return f"${a.id}"
    if isinstance(a, (tuple, list)):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return dtype_abbr(a)
    if isinstance(a, torch.device):
        return f"'{a}'"
    if isinstance(a, float):
        return repr(a)
    return str(a) if isinstance(a, (torch.layout, torch.memory_format)) else repr(a)


class Trace:
    """A sequence of :class:`OpCall` in call order, with leaves and results.

    >>> import torch, metadispatch as md
    >>> t = md.trace(lambda x: (x @ x.T).relu(), torch.ones(2, 3))
    >>> print(t)
    $0: f32[2, 3] = arg args[0]
    $1: f32[3, 2]{1, 3} = aten.permute.default($0, [1, 0])
    $2: f32[2, 2] = aten.mm.default($0, $1)
    $3: f32[2, 2] = aten.relu.default($2)
    """

    def __init__(self) -> None:
        self.calls: list[OpCall] = []
        self.leaves: dict[int, Leaf] = {}
        self.output: Any = None  # what fn returned, MetaTensors in place of tensors
        self.output_meta: Any = None  # the same structure with TensorMeta
        self.grads: dict[str, TensorMeta] = {}
        self.modules: dict[str, str] = {}  # qualified name -> class name
        # storage number -> index of the first call after it was freed;
        # None where unknown (see Note [Storage numbers and deaths]).
        self.deaths: dict[int, int] | None = None
        # The CPU generator's state when the recording mode was first entered,
        # so that md.materialize can replay construction with eager's numbers.
        self.rng_state: torch.Tensor | None = None

    # -- sequence protocol
    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[OpCall]:
        return iter(self.calls)

    def __getitem__(self, i):
        return self.calls[i]

    # -- files (see docs/trace-format.md)
    def save(self, path) -> None:
        """Write this trace to ``path`` as versioned JSON (gzipped if it ends in ``.gz``)."""
        from .serialize import save

        save(self, path)

    @classmethod
    def load(cls, path) -> "Trace":
        """Read a trace saved by :meth:`save`; raises :class:`TraceFormatError` on a bad file."""
        from .serialize import load

        return load(path)

    # -- printed forms
    def lines(self, *, leaf_text=Leaf.describe, call_text=OpCall.format) -> list[str]:
        """One line a call, each leaf on a line of its own before its first use.

        ``leaf_text``/``call_text`` format a leaf and a call (``md.diff`` uses
        plainer forms).
        """
        out, shown = [], set()
        for call in self.calls:
            for m in call.inputs:
                if m.id not in shown:
                    shown.add(m.id)
                    leaf = self.leaves.get(m.id)
                    if leaf is not None:
                        out.append(f"${m.id}: {m.type_str()} = {leaf_text(leaf)}")
            shown.update(m.id for m in call.output_metas)
            out.append(call_text(call))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        return f"<Trace: {len(self.calls)} calls, {len(self.leaves)} leaves>"

    def summary(self, top: int = 15) -> str:
        """A table of calls per op, per module, and per phase."""
        by_op = Counter(c.op for c in self.calls)
        by_mod = Counter(c.module or "<top>" for c in self.calls)
        by_phase = Counter(c.phase for c in self.calls)
        by_rule = Counter(c.rule for c in self.calls)
        lines = [f"{len(self.calls)} calls: " + ", ".join(
            f"{by_phase[p]} {p}" for p in ("forward", "backward")) + "; answered by " +
            ", ".join(f"{k} {v}" for k, v in sorted(by_rule.items()))]
        lines += _table("op", by_op, top) + _table("module", by_mod, top)
        return "\n".join(lines)


def _table(title: str, counts: Counter, top: int) -> list[str]:
    from ..analysis.tables import render  # tables imports this module

    rows = [(k, v) for k, v in counts.most_common(top)]
    if len(counts) > top:
        rows.append((f"({len(counts) - top} more)", sum(counts.values()) - sum(v for _, v in rows)))
    return render((title, "calls"), rows)
