"""Reserved memory of a trace: its storages run through the simulated caching allocator.

Requirements: the allocated figure stays ``md.memory``'s, exactly; beside it
stands what the allocator reserves from the device (``reserved_peak``, what
``torch.cuda.max_memory_reserved`` reports and what an out-of-memory error is
decided by), the call that first runs out of a capacity, and a snapshot in
the format of ``torch.cuda.memory._snapshot()`` that PyTorch's memory
visualizer (https://pytorch.org/memory_viz, ``torch.cuda._memory_viz``) opens.

Storages are born and die as in :class:`~.memory.Memory` (Note [Storage
numbers and deaths]); within a call the storages that died are freed before
the call's outputs are allocated.  Every storage of the trace is placed on
the one simulated device, whatever device it was traced on.  Limits: those of
``allocator.py``, plus kernel workspaces (not in the trace) are not placed.
"""

from __future__ import annotations

from ..ir.text import fmt_bytes
from ..spec.profiles import GPUProfile
from .allocator import Block, CachingAllocator
from .allocconfig import AllocatorConfig
from .workspace import unsized_lines

__all__ = ["CudaMemory"]


class CudaMemory:
    """A trace's memory as the CUDA caching allocator would hold it on ``gpu``.

    ``peak`` is ``md.memory(trace).peak``; ``allocated_peak`` counts whole
    blocks as ``torch.cuda.max_memory_allocated`` does (a block not worth
    splitting is allocated whole); ``reserved_peak`` is the segments'.
    ``timeline[i]`` and ``reserved_timeline[i]`` are after call ``i``.
    ``first_oom_call`` is the first call whose allocation found no room in
    ``capacity`` even after the allocator freed its cache (``-1``: the
    parameters and inputs already do not fit; ``None``: it fits); the run goes
    on past it as if the device were larger.
    """

    def __init__(self, memory, gpu: GPUProfile, config: AllocatorConfig, capacity: int | None) -> None:
        self.memory, self.gpu, self.config = memory, gpu, config
        self.capacity = gpu.memory if capacity is None else capacity
        self.allocator = a = CachingAllocator(self.capacity, config)
        n = len(memory.trace.calls)
        births: list = [[] for _ in range(n + 1)]
        deaths: list = [[] for _ in range(n + 1)]
        for info in memory.storages.values():
            start, end = max(info.born, 0), n if info.died is None else min(info.died, n)
            if end > start and info.nbytes:
                births[start].append(info)
                deaths[end].append(info)
        self.timeline: list = []
        self.reserved_timeline: list = []
        self.first_oom_call: int | None = None
        self.event_calls: list = []  # the call each allocator event happened in
        self.blocks: dict = {}  # storage number -> Block, live at the end
        live = self.peak = self.allocated_peak = self.reserved_peak = 0
        self.reserved_peak_call = self.allocated_at_reserved_peak = 0
        for i in range(n):
            for info in deaths[i]:
                a.free(self.blocks.pop(info.number))
                live -= info.allocated
            for info in births[i]:
                self.blocks[info.number] = self._malloc(info.nbytes, i if info.born >= 0 else -1)
                live += info.allocated
            self.event_calls += [i] * (len(a.events) - len(self.event_calls))
            self.timeline.append(live)
            self.reserved_timeline.append(a.reserved)
            self.peak = max(self.peak, live)
            self.allocated_peak = max(self.allocated_peak, a.allocated)
            if a.reserved > self.reserved_peak:
                self.reserved_peak, self.reserved_peak_call = a.reserved, i
                self.allocated_at_reserved_peak = a.allocated
        self.retries = a.retries
        self.segments = len(a.segments)
        self.segments_peak = sum(1 for e in a.events if e[0] == "segment_alloc")

    def _malloc(self, nbytes: int, call: int) -> Block:
        b = self.allocator.malloc(nbytes)
        if b is None:
            if self.first_oom_call is None:
                self.first_oom_call = call
            b = self.allocator.malloc(nbytes, force=True)
        assert b is not None
        return b

    @property
    def fragmentation(self) -> float:
        """Share of the reserved peak not allocated at that moment (0: none wasted)."""
        return 1 - self.allocated_at_reserved_peak / self.reserved_peak if self.reserved_peak else 0.0

    @property
    def fits(self) -> bool:
        return self.first_oom_call is None

    def __repr__(self) -> str:
        return (
            f"<CudaMemory on {self.gpu.title}: peak {fmt_bytes(self.peak)} allocated, "
            f"{fmt_bytes(self.reserved_peak)} reserved>"
        )

    def __str__(self) -> str:
        return "\n".join(
            [
                f"{self.gpu.title}, caching allocator ({self._conf()})",
                f"peak allocated {fmt_bytes(self.peak)} (whole blocks {fmt_bytes(self.allocated_peak)})",
                f"peak reserved  {fmt_bytes(self.reserved_peak)} after call #{self.reserved_peak_call}, "
                f"{100 * self.fragmentation:.1f}% of it unallocated then",
                f"segments {self.segments} at the end ({self.segments_peak} cudaMalloc calls), "
                f"{self.retries} free-and-retry",
                f"capacity {fmt_bytes(self.capacity)}: "
                + ("fits" if self.fits else f"out of memory at call #{self.first_oom_call}"),
                *unsized_lines(self.memory.unsized),
            ]
        )

    def _conf(self) -> str:
        c = self.config
        opts = [f"{k}:{v}" for k, v in vars(c).items() if v not in (None, False, 0, 0.0)]
        return ",".join(opts) or "default"

    def snapshot(self) -> dict:
        """The allocator's state at the end and every event, as ``torch.cuda.memory._snapshot()``.

        Save it with ``pickle.dump`` and open it at https://pytorch.org/memory_viz.
        """
        calls = self.memory.trace.calls
        trace = [
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": k,
                "frames": _frames(calls[i]) if 0 <= i < len(calls) else [],
            }
            for k, ((action, addr, size), i) in enumerate(zip(self.allocator.events, self.event_calls))
        ]
        return {"segments": [_segment(s) for s in self.allocator.segments.values()], "device_traces": [trace]}


def _frames(call) -> list:
    where, _, line = (call.source or "").partition(":")
    return [{"filename": where or call.module or "<top>", "line": int(line.split()[0]) if line else 0, "name": call.op}]


def _segment(seg) -> dict:
    blocks, b = [], seg.last
    while b is not None:
        blocks.append(
            {
                "address": b.address,
                "size": b.size,
                "requested_size": b.requested if b.allocated else 0,
                "state": "active_allocated" if b.allocated else "inactive",
                "frames": [],
            }
        )
        b = b.prev
    blocks.reverse()
    allocated = sum(x["size"] for x in blocks if x["state"] == "active_allocated")
    return {
        "device": 0,
        "address": seg.address,
        "total_size": seg.size,
        "stream": 0,
        "segment_type": "small" if seg.small else "large",
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(x["requested_size"] for x in blocks),
        "blocks": blocks,
    }
