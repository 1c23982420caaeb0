"""``torch.cuda``'s memory counters for a logical GPU, from the trace as it is recorded.

Note [Memory counters from the trace so far]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A training script prints ``torch.cuda.max_memory_allocated()`` after a
step; under a MetaMode on a logical GPU (gpu/cuda_answers.py) it prints
the prediction.  Every figure is :func:`~.memory.memory`'s for the trace
recorded so far -- the calls made and the storage deaths seen up to the
question -- so a figure asked mid-step is ``md.memory`` of that prefix:

- ``memory_allocated``: the bytes of the logical GPU's storages alive now
  (made by a call and not freed since, leaves, the persistent cuBLAS
  workspace), each rounded to the allocator's 512-byte blocks as
  ``md.memory`` rounds them -- ``md.memory(trace, device="cuda")``: as the
  CUDA allocator counts only its device's blocks, the host's storages (CPU
  offload's optimizer state and shards, a batch not yet moved) are not in
  any figure here, where they had been;
- ``max_memory_allocated``: the peak of ``md.memory``'s timeline since the
  last reset, and at least what was allocated at the reset and now (torch
  resets the peak to the current figure);
- ``memory_reserved`` and ``max_memory_reserved``: the segments of
  ``md.memory(trace, allocator="cuda")``'s simulated caching allocator
  (analysis/allocator.py, default ``PYTORCH_CUDA_ALLOC_CONF``, the mode's
  profile), now and their peak since the reset;
- ``memory_stats``: those four under torch's keys (``allocated_bytes.all.
  current`` ...), ``active_bytes`` as allocated, and the simulation's
  ``num_alloc_retries`` and ``num_ooms``.

The figures are computed on demand, once per state of the trace (a
question after new calls recomputes; several questions in a row do not):
``md.memory`` over the trace so far is linear in its length, and scripts ask
once a step.  Limits: a leaf (a parameter, an input) counts from the first
call that reads it, as in ``md.memory`` of the prefix: asked mid-forward,
parameters of layers not yet run are missing; ``empty_cache()`` releases
nothing from the simulation.
"""

from __future__ import annotations

from ..gpu import cuda_answers
from ..spec.profiles import GPUProfile
from .allocconfig import AllocatorConfig
from .memory import Memory
from .reserved import CudaMemory

__all__ = ["Counters"]


class Counters:
    """The memory counters of one MetaMode's logical GPU (Note above).

    >>> import torch, metadispatch as md
    >>> with md.MetaMode(device="cuda", gpu="h100") as mode:
    ...     x = torch.ones(1024, device="cuda")
    ...     host = x.cpu()  # offloaded: the host's, not the GPU allocator's
    ...     y = x * 2
    ...     del x
    ...     now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    >>> now, peak, peak == md.memory(mode.trace, device="cuda").peak, md.memory(mode.trace).peak
    (4096, 8192, True, 12288)
    """

    def __init__(self, trace, profile: GPUProfile) -> None:
        self.trace, self.profile = trace, profile
        self._state: tuple | None = None  # what the trace held when the figures below were made
        self._memory: Memory | None = None
        self._reserved: CudaMemory | None = None  # made only when a reserved figure is asked
        self._allocated = 0
        self._reset = (0, 0, 0)  # calls, allocated, reserved at the last reset

    def _now(self) -> Memory:
        t = self.trace
        state = (len(t.calls), len(t.deaths or ()), len(t.leaves))
        if self._memory is None or state != self._state:
            m = Memory(t, self.profile, categories=False, device="cuda")  # the GPU's storages alone
            self._memory, self._reserved, self._state = m, None, state
            self._allocated = sum(s.allocated for s in self._memory.storages.values() if s.died is None)
        return self._memory

    def _simulated(self) -> CudaMemory:
        m = self._now()
        if self._reserved is None:  # md.memory(trace, allocator="cuda", gpu=profile)
            self._reserved = CudaMemory(m, self.profile, AllocatorConfig(), None)
        return self._reserved

    def allocated(self) -> int:
        self._now()
        return self._allocated

    def max_allocated(self) -> int:
        start, allocated, _ = self._reset
        return max(allocated, self.allocated(), *self._now().timeline[start:])

    def reserved(self) -> int:
        timeline = self._simulated().reserved_timeline
        return timeline[-1] if timeline else 0

    def max_reserved(self) -> int:
        start, _, reserved = self._reset
        return max(reserved, self.reserved(), *self._simulated().reserved_timeline[start:])

    def stats(self) -> dict:
        """What ``torch.cuda.memory_stats()`` reports, for the keys its callers read."""
        m = self._simulated()
        now, peak = self.allocated(), self.max_allocated()
        stats = {
            "allocated_bytes.all.current": now,
            "allocated_bytes.all.peak": peak,
            "active_bytes.all.current": now,
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.current": self.reserved(),
            "reserved_bytes.all.peak": self.max_reserved(),
            "num_alloc_retries": m.retries,
            "num_ooms": 0 if m.fits else 1,
        }
        return dict(sorted(stats.items()))

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: peaks count from now, from what is held now."""
        self._reset = (len(self.trace.calls), self.allocated(), self.reserved())


cuda_answers.WIRING.counters = Counters  # Note [Wiring] in tensor/tensor.py
