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
from collections.abc import Iterator
from typing import Any

import torch

from .calls import OpCall
from .records import Group, Leaf, TensorMeta, dtype_abbr
from .rng import RngEvent
from .serialize import load, save
from .text import render

__all__ = ["TensorMeta", "OpCall", "Leaf", "Trace", "dtype_abbr"]


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
        # Traced in a logical world (MetaMode(world_size=...)): its world
        # size and rank, and every process group by name.
        self.world: tuple[int, int] | None = None
        self.groups: dict[str, Group] = {}
        # storage number -> index of the first call after it was freed;
        # None where unknown (see Note [Storage numbers and deaths]).
        self.deaths: dict[int, int] | None = None
        # storage number -> its bytes, where a storage is larger than the
        # tensor it was first seen through reaches (Note [Storages larger
        # than their tensors] in core/record.py).
        self.storage_bytes: dict[int, int] = {}
        # The CPU generator's state when the recording mode was first entered,
        # so that md.materialize can replay construction with eager's numbers.
        self.rng_state: torch.Tensor | None = None
        # torch.get_num_threads() at the same moment: CPU kernels split
        # reductions by it (Note [Threads in replay] in execution/replay.py).
        self.threads: int | None = None
        # (oneDNN enabled, NNPACK enabled), likewise: a CPU convolution's
        # kernel, and so its bits, follows them (the same Note).
        self.conv_switches: tuple[bool, bool] | None = None
        # The rest of the random streams (ir/rng.py): CUDA generators' states
        # ("cuda:0" -> state, where a real CUDA was there to ask), explicit
        # generators' (device, state at first use), and state reads and writes.
        self.rng_cuda: dict[str, torch.Tensor] = {}
        self.generators: list[tuple[str, torch.Tensor | None]] = []
        self.rng_events: list[RngEvent] = []
        # The name of every tensor argument md.trace was given, used or not,
        # so that replay can refuse arguments the trace never saw; None: unknown.
        self.arg_names: list[str] | None = None
        # Every other argument, name -> describe_constant(value) (Note
        # [Non-tensor arguments are constants] in records.py); None: unknown.
        self.arg_constants: dict[str, str] | None = None
        # A second name of a tensor the traced code was given under another
        # ("param head.weight" -> "param emb.weight": tied weights; the same
        # tensor passed twice), so replay can refuse inputs tied otherwise.
        self.aliases: dict[str, str] = {}
        # Loaded from a file: replay re-derives what the file claims about
        # sizes before trusting it (Note [Budgets] in trust/budget.py).
        self.untrusted = False
        # The GPU profile that answered hardware-dependent choices (SDPA's
        # backend) on a logical CUDA device: its name, or the profile itself
        # when it is not registered (mode/mode.py); None: no profile was asked.
        self.gpu: Any = None  # str | core.profiles.GPUProfile | None
        # Which step of the traced code this trace is: the number of steps
        # run before it under ``md.tracer(warmup=N)``, their state carried in
        # (Note [What the calls before a cut leave alive] in ir/cut.py);
        # 0: the first step.  ``marks``: name -> index of the first call
        # after ``md.mark(name)``.  ``start_bytes``: storage number -> its
        # bytes at the first call, where an FSDP2 resize before it set them.
        self.warmup = 0
        self.marks: dict[str, int] = {}
        self.start_bytes: dict[int, int] = {}
        # tensor id -> [(call index, value)]: the known values (values/known.py)
        # calls wrote, while recording; what a cut needs of the state it carries
        # (Note [Known state across a cut] in ir/cut.py).  Not saved.
        self.known_writes: dict[int, list] = {}
        # Every value the trace assumed instead of computing (ir/assumptions.py):
        # declared by ``md.tracer(assume=...)`` (values/assume.py).
        self.assumptions: list = []

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
        save(self, path)

    @classmethod
    def load(cls, path, **options) -> Trace:
        """Read a trace saved by :meth:`save`; raises :class:`TraceFormatError` on a bad file.

        ``options``: ``max_size``, ``max_values`` and ``allow_ops`` of :func:`metadispatch.ir.serialize.load`.
        """
        return load(path, cls, **options)

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
        lines = [
            f"{len(self.calls)} calls: "
            + ", ".join(f"{by_phase[p]} {p}" for p in ("forward", "backward"))
            + "; answered by "
            + ", ".join(f"{k} {v}" for k, v in sorted(by_rule.items()))
        ]
        lines += _table("op", by_op, top) + _table("module", by_mod, top)
        return "\n".join(lines)


def _table(title: str, counts: Counter, top: int) -> list[str]:
    rows = [(k, v) for k, v in counts.most_common(top)]
    if len(counts) > top:
        rows.append((f"({len(counts) - top} more)", sum(counts.values()) - sum(v for _, v in rows)))
    return render((title, "calls"), rows)
