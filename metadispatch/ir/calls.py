"""One recorded aten call, :class:`OpCall`, and its printed line."""

from __future__ import annotations

import torch

from .records import Group, TensorMeta, dtype_abbr, tensor_metas
from .repro import repro
from .text import clip

__all__ = ["OpCall"]

_NO_KWARGS: dict = {}
# A module name or note is stored once and printed on every call that names
# it; clipped, a printed line stays a few hundred characters plus its
# arguments however long the file's strings are (HF module paths are < 100).
SHOWN_CHARS = 160


class OpCall:
    """One recorded aten call.  Immutable: nothing changes a call once it is in a trace.

    A later stage that learns more about a call -- autograd's
    ``requires_grad`` on its outputs, a note of ``md.check`` -- puts a new
    call in the trace's place (:meth:`replace`), so a call handed out before
    stays what it was.  Not enforced by ``__setattr__``: a call is made for
    every aten call traced, and ``__slots__`` with plain assignment keeps
    that cheap.
    """

    __slots__ = ("index", "func", "op", "args", "kwargs", "outputs", "module", "phase", "rule", "source", "note")

    def __init__(self, index, func, op, args, kwargs, outputs, module, phase, rule, source=None, note=None):
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

    def replace(self, **changes) -> OpCall:
        """A copy of this call with the named fields changed (``call.replace(note="...")``)."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        unknown = set(changes) - fields.keys()
        if unknown:
            raise TypeError(f"OpCall has no field {', '.join(sorted(unknown))}")
        fields.update(changes)
        return OpCall(**fields)

    def with_outputs(self, outputs) -> OpCall:
        """``replace(outputs=outputs)`` without its field checks: the recorder
        corrects the outputs of about a third of a training step's calls
        (autograd's ``requires_grad``, core/record.py)."""
        return OpCall(
            self.index,
            self.func,
            self.op,
            self.args,
            self.kwargs,
            outputs,
            self.module,
            self.phase,
            self.rule,
            self.source,
            self.note,
        )

    @property
    def inputs(self) -> tuple:
        return tuple(tensor_metas((self.args, tuple(self.kwargs.values()))))

    @property
    def output_metas(self) -> tuple:
        return tuple(tensor_metas(self.outputs))

    def __repr__(self) -> str:
        return f"<OpCall #{self.index} {self.format()}>"

    def repro(self, device="cpu") -> str:
        """A standalone Python snippet that runs this call for real and checks it."""
        return repro(self, device)

    def format(self) -> str:
        outs = ", ".join(_fmt_out(o) for o in self.outputs) or "_"
        parts = [_fmt_arg(a) for a in self.args]
        parts += [f"{k}={_fmt_arg(v)}" for k, v in self.kwargs.items()]
        line = f"{outs} = {self.op}({', '.join(parts)})"
        comment = []
        if self.module:
            comment.append(clip(self.module, SHOWN_CHARS))
        if self.phase != "forward":
            comment.append("(bw)" if self.phase == "backward" else "(opt)")
        if self.rule not in ("meta", "builtin"):
            comment.append(f"[{self.rule}]")
        if self.note:
            comment.append(f"<{clip(self.note, SHOWN_CHARS)}>")
        if comment:
            line += "  # " + " ".join(comment)
        return line


def _fmt_out(o) -> str:
    if isinstance(o, TensorMeta):
        return f"${o.id}: {o.type_str()}"
    if isinstance(o, Group):
        return repr(o)
    if isinstance(o, (tuple, list)):
        return "[" + ", ".join(_fmt_out(x) for x in o) + "]"
    return repr(o)


def _fmt_arg(a) -> str:
    if isinstance(a, TensorMeta):
        return f"${a.id}"
    if isinstance(a, Group):
        return repr(a)
    if isinstance(a, (tuple, list)):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return dtype_abbr(a)
    if isinstance(a, torch.device):
        return f"'{a}'"
    if isinstance(a, float):
        return repr(a)
    return str(a) if isinstance(a, (torch.layout, torch.memory_format)) else repr(a)
