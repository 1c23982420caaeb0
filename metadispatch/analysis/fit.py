"""Will a traced step fit on a GPU: the caching allocator's reserved peak against its memory.

Requirements: answer before launch, and when the answer is no, say where and
why -- the first call that runs out, what it was doing, and what was live --
in one paragraph a person reads.  The figure is reserved memory as
``reserved.py`` simulates it; kernel workspaces and the CUDA context are not
in it (the profile's memory is what the device reports, before the context).
"""

from __future__ import annotations

from collections import Counter

from ..ir.cut import step_from
from ..ir.records import type_str
from ..ir.text import fmt_bytes
from ..ir.trace import TensorMeta, Trace
from ..spec.profiles import GPUProfile, gpu_profile
from ..tracing.marks import mark_index
from .allocconfig import AllocatorConfig
from .memory import Memory, step_text
from .reserved import CudaMemory
from .workspace import unsized_lines

__all__ = ["Fit", "OOMCall", "fits"]


def _gib(n: float) -> str:
    """``fmt_bytes`` with a space before the unit: ``33.1 GiB``."""
    text = fmt_bytes(n)
    number = text.rstrip("KMGTiB")
    return f"{number} {text[len(number) :]}"


class OOMCall:
    """The first call that found no room: where it is, and what was live then."""

    def __init__(self, memory: Memory, index: int) -> None:
        self.index = index
        call = memory.trace.calls[index] if index >= 0 else None
        self.op = call.op if call else "parameters and inputs"
        self.module = call.module if call else ""
        self.phase = call.phase if call else ""
        self.source = call.source if call else None
        if index < 0:  # the leaves, before any call
            live = [s for s in memory.storages.values() if s.nbytes and s.born < 0]
        else:
            live = [
                s
                for s in memory.storages.values()
                if s.nbytes and max(s.born, 0) <= index and (s.died is None or s.died > index)
            ]
        self.live_by_category: Counter = Counter()
        for s in live:
            self.live_by_category[s.category] += s.allocated
        metas = _metas(memory.trace)
        self.largest = [
            (s.allocated, s.category, s.module, metas.get(s.number))
            for s in sorted(live, key=lambda s: -s.allocated)[:3]
        ]

    def __str__(self) -> str:
        where = "before the first call" if self.index < 0 else f"at call #{self.index} {self.op}"
        ctx = ", ".join(x for x in (self.phase, self.module, self.source) if x)
        cats = ", ".join(f"{c} {_gib(b)}" for c, b in self.live_by_category.most_common() if b)
        big = ", ".join(f"{_gib(b)} {_shape(m)} ({c}{', ' + mod if mod else ''})" for b, c, mod, m in self.largest)
        return f"it runs out {where}" + (f" ({ctx})" if ctx else "") + f"; live then: {cats}; largest: {big}"


def _metas(trace: Trace) -> dict:
    out: dict = {}
    for call in trace.calls:
        for m in (*call.inputs, *call.output_metas):
            out.setdefault(m.storage, m)
    return out


def _shape(m: TensorMeta | None) -> str:
    if m is None:
        return "tensor"
    return type_str(m.dtype, m.shape)


class Fit:
    """Whether a trace fits on a GPU; ``str`` says it in one paragraph.

    ``headroom`` is capacity minus the reserved peak (negative: short by that
    much); ``first_oom_call`` is an :class:`OOMCall` or ``None``.
    """

    def __init__(self, cuda: CudaMemory) -> None:
        self.memory = cuda
        self.gpu: GPUProfile = cuda.gpu
        self.capacity = cuda.capacity
        self.reserved_peak = cuda.reserved_peak
        self.fits = cuda.fits
        self.headroom = self.capacity - self.reserved_peak
        self.step = step_text(cuda.memory.trace)  # which step of the traced code (md.tracer(warmup=N))
        oom = cuda.first_oom_call
        self.first_oom_call = None if oom is None else OOMCall(cuda.memory, oom)

    def line(self) -> str:
        """``fits on H100 80 GB: yes, peak reserved 33.1 GiB``."""
        return f"fits on {self.gpu.title}: {'yes' if self.fits else 'no'}, peak reserved {_gib(self.reserved_peak)}"

    def __bool__(self) -> bool:
        return self.fits

    def __repr__(self) -> str:
        return f"<Fit {self.line()}>"

    def __str__(self) -> str:
        head = f"{self.line()} of {_gib(self.capacity)}, peak allocated {_gib(self.memory.peak)}"
        if self.fits:
            text = f"{head}; {_gib(self.headroom)} to spare."
        else:
            text = f"{head}; short by {_gib(-self.headroom)}: {self.first_oom_call}."
        return " ".join([text, *unsized_lines(self.memory.memory.unsized), f"{self.step}.", self.includes()])

    def includes(self) -> str:
        """Note [What a fit figure includes]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        The reserved peak is every storage of the step -- parameters,
        gradients, optimizer state (live from the start in a warmed trace),
        activations, backward's temporaries, the optimizer's scratch --
        plus kernel workspaces (cuBLAS's, per handle, and transient ones),
        through the simulated caching allocator, so its rounding and
        fragmentation (reserved minus allocated) too.  Not in it: NCCL's
        own buffers (a communicator takes its memory outside the caching
        allocator, some hundreds of MiB per communicator depending on
        ``NCCL_BUFFSIZE`` and the ranks), and the CUDA context (a few
        hundred MiB the driver takes before torch allocates anything: the
        profile's memory is the device's total, so a real device has that
        much less free than ``capacity``).
        """
        parts = [f"{c} {_gib(b)}" for c, b in self.memory.memory.by_category.items() if b]
        frag = self.reserved_peak - self.memory.allocated_at_reserved_peak
        return (
            f"Included at the allocated peak: {', '.join(parts)}; at the reserved peak, allocator rounding "
            f"and fragmentation {_gib(frag)}. Not included: NCCL buffers, the CUDA context."
        )


def fits(
    trace: Trace,
    gpu: str | GPUProfile | None = None,
    capacity: int | None = None,
    since: str | int | None = None,
    **conf,
) -> Fit:
    """Whether a traced step fits on ``gpu`` (default: the trace's, else ``h100``), or in ``capacity`` bytes.

    ``conf`` are ``PYTORCH_CUDA_ALLOC_CONF`` options, and ``since`` a mark
    (``md.mark``) the figure starts at, as for ``md.memory``.  The answer
    is for the step the trace is: trace with ``md.tracer(warmup=1)`` for
    the steady state (``Fit.step`` says which; Note [What a fit figure
    includes]).

    >>> import torch, metadispatch as md
    >>> t = md.tracer(device="cuda")(lambda x: (x * 2).sum(), torch.ones(2 ** 22))
    >>> print(md.fits(t, gpu="l4"))
    fits on L4 24 GB: yes, peak reserved 34 MiB of 22.5 GiB, peak allocated 32 MiB; 22.5 GiB to spare.
    Step 1, no warmup: md.tracer(warmup=1) for the steady state. Included at the allocated peak:
    activations 16 MiB, other 16 MiB; at the reserved peak, allocator rounding and fragmentation 2 MiB.
    Not included: NCCL buffers, the CUDA context.
    >>> f = md.fits(t, capacity=20 * 2 ** 20)
    >>> f.fits, f.first_oom_call.index, f.first_oom_call.op
    (False, 0, 'aten.mul.Tensor')
    """
    if since is not None:
        trace = step_from(trace, mark_index(trace, since))
    profile = gpu_profile(gpu or trace.gpu)
    return Fit(CudaMemory(Memory(trace, profile), profile, AllocatorConfig(**conf), capacity))
