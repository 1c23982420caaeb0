"""Memory of a trace: live bytes over the calls, by category and module.

Requirements: count each storage once (views, in-place results and tied
weights share one), free it when the last tensor using it dies, and say what
the bytes are.  A storage is live from the call that first produced it until
the call before its death, as recorded while tracing (Note [Storage numbers
and deaths] in ``record.py``); a trace without recorded deaths (loaded from
elsewhere) falls back to "dies after its last use", which can only free
earlier than a real run does.  Leaves -- parameters, buffers, inputs -- are
live from the start.  Bytes are the extent the tensors reach in the storage;
on CUDA they are rounded up to the caching allocator's 512-byte blocks, as
``MemTracker`` does.

Categories: ``params`` (parameter leaves), ``grads`` (the ``.grad`` tensors
the trace ends with), ``activations`` (made in forward), ``temporaries``
(made in backward and not a ``.grad``), ``optimizer`` (made inside
``optimizer.step``: its state and scratch) and ``other`` (inputs, buffers,
constants).

Limits: an op's internal workspace, allocator fragmentation and the
allocator's caching are not modelled; the figure is what
``torch.cuda.max_memory_allocated`` calls allocated, not what
``nvidia-smi`` shows.

:class:`LiveStorages` does the same accounting on a real run, so the model
can be checked against reality (see ``tests/test_memory.py``).
"""

from __future__ import annotations

import weakref
from collections import Counter
from functools import partial

import torch
from torch.utils._pytree import tree_leaves

from .. import _compat
from ..ir.text import fmt_bytes, render
from ..core.profiles import GPUProfile, gpu_profile
from ..core import fsdp_storage
from ..core.fsdp_storage import RESIZE_OP
from ..core.tensor import is_wrapper_subclass
from ..ir.trace import TensorMeta, Trace
from .allocconfig import AllocatorConfig
from .reserved import CudaMemory

__all__ = ["Memory", "memory", "LiveStorages", "CATEGORIES", "fmt_bytes", "tensor_bytes"]

CATEGORIES = ("params", "grads", "activations", "temporaries", "optimizer", "other")
_BY_PHASE = {"forward": "activations", "backward": "temporaries", "optimizer": "optimizer"}
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this


def tensor_bytes(m: TensorMeta) -> int:
    """Bytes of storage a tensor reaches: up to its last element."""
    if any(s == 0 for s in m.shape):
        return 0
    last = m.storage_offset + sum((s - 1) * st for s, st in zip(m.shape, m.stride))
    return (last + 1) * m.dtype.itemsize


def _allocated(nbytes: int, device: torch.device) -> int:
    if device.type == "cuda":
        return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
    return nbytes


class StorageInfo:
    __slots__ = ("number", "nbytes", "device", "born", "died", "category", "module", "last_use")

    def __init__(self, number, device, born, category, module):
        self.number, self.device, self.born = number, device, born
        self.category, self.module = category, module
        self.nbytes, self.died, self.last_use = 0, None, born

    @property
    def allocated(self) -> int:
        return _allocated(self.nbytes, self.device)


def _storages(trace: Trace) -> dict:
    """Storage number -> StorageInfo, for every storage the trace touches."""
    out: dict = {}
    resizes: dict = {}  # storage number -> [(call index, new bytes)]
    for i, call in enumerate(trace.calls):
        if call.op == RESIZE_OP:
            resizes.setdefault(call.args[0].storage, []).append((i, call.args[1]))
        for m in call.inputs:
            info = out.get(m.storage)
            if info is None:
                info = out[m.storage] = _leaf_info(trace, m)
            info.nbytes = max(info.nbytes, tensor_bytes(m))
            info.last_use = i
        for m in call.output_metas:
            info = out.get(m.storage)
            if info is None:
                info = out[m.storage] = StorageInfo(m.storage, m.device, i,
                                                    _BY_PHASE.get(call.phase, "other"), call.module)
            info.nbytes = max(info.nbytes, tensor_bytes(m))
            info.last_use = i
    for g in trace.grads.values():
        if g.storage in out:
            out[g.storage].category = "grads"
    _deaths(trace, out)
    for number, events in resizes.items():
        _split(out, number, events)
    return out


def _split(infos: dict, number: int, events: list) -> None:
    """A storage resized while it lived (Note [FSDP frees by resizing storage]
    in core/fsdp_storage.py) as one StorageInfo per stretch of constant size:
    the one resized to 0 bytes after call ``i`` is not live at ``i``, the one
    resized back at ``j`` is, as a storage born at ``j``.  Later stretches
    are keyed ``(number, k)``."""
    info = infos[number]
    stretches, start, size = [], info.born, info.nbytes
    for i, nbytes in events:
        if i < start or info.died is not None and i >= info.died or nbytes == size:
            continue
        stretches.append((start, size, i))
        start, size = i, nbytes
    stretches.append((start, size, info.died))
    for k, (born, nbytes, died) in enumerate(stretches):
        piece = StorageInfo(number, info.device, born, info.category, info.module)
        piece.nbytes, piece.died, piece.last_use = nbytes, died, info.last_use
        infos[number if k == 0 else (number, k)] = piece


def _leaf_info(trace: Trace, m: TensorMeta) -> StorageInfo:
    leaf = trace.leaves.get(m.id)
    if leaf is not None and leaf.kind == "param":
        return StorageInfo(m.storage, m.device, -1, "params", leaf.name.rpartition(".")[0])
    return StorageInfo(m.storage, m.device, -1, "other", "")


def _deaths(trace: Trace, infos: dict) -> None:
    if trace.deaths is not None:
        for s, info in infos.items():
            info.died = trace.deaths.get(s)
        return
    kept = {m.storage for m in tree_leaves(trace.output_meta) if isinstance(m, TensorMeta)}
    kept |= {g.storage for g in trace.grads.values()}
    for s, info in infos.items():
        if info.born >= 0 and s not in kept:
            info.died = info.last_use + 1


class Memory:
    """Live bytes over a trace; print it for a table.

    ``timeline[i]`` is the bytes live just after call ``i``; ``by_category``
    and ``by_module`` (the module whose call made the bytes, or owns the
    parameter) are taken at the peak.
    """

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.storages = _storages(trace)
        n = len(trace.calls)
        deltas = {c: [0] * (n + 1) for c in CATEGORIES}
        for info in self.storages.values():
            end = n if info.died is None else min(info.died, n)
            start = max(info.born, 0)
            if end > start:
                deltas[info.category][start] += info.allocated
                deltas[info.category][end] -= info.allocated
        self.by_category_timeline = {c: _running(d)[:n] for c, d in deltas.items()}
        self.timeline = [sum(v) for v in zip(*self.by_category_timeline.values())] if n else []
        self.peak = max(self.timeline, default=0)
        self.peak_call = self.timeline.index(self.peak) if n else None
        self.live_at_peak = [s for s in self.storages.values() if self._live(s, self.peak_call)]
        self.by_category = Counter({c: 0 for c in CATEGORIES})
        self.by_module: Counter = Counter()
        for s in self.live_at_peak:
            self.by_category[s.category] += s.allocated
            self.by_module[s.module] += s.allocated

    @staticmethod
    def _live(s: StorageInfo, i) -> bool:
        return i is not None and max(s.born, 0) <= i and (s.died is None or s.died > i)

    def __repr__(self) -> str:
        return f"<Memory peak={fmt_bytes(self.peak)} at call {self.peak_call}>"

    def __str__(self) -> str:
        lines = [f"peak {fmt_bytes(self.peak)}" + self._where()]
        rows = [(c, fmt_bytes(b), _pct(b, self.peak)) for c, b in self.by_category.items() if b]
        lines += render(("category", "at peak", "share"), rows, align="<>>")
        rows = [(m or "<top>", fmt_bytes(b), _pct(b, self.peak)) for m, b in self.by_module.most_common(10)]
        lines += render(("module", "at peak", "share"), rows, align="<>>")
        return "\n".join(lines)

    def _where(self) -> str:
        if self.peak_call is None:
            return ""
        call = self.trace.calls[self.peak_call]
        return f" after call #{self.peak_call} {call.op} ({call.phase}" + (
            f", {call.module})" if call.module else ")")


def _running(deltas: list) -> list:
    out, acc = [], 0
    for d in deltas:
        acc += d
        out.append(acc)
    return out


def memory(trace: Trace, allocator: str | None = None, gpu: str | GPUProfile | None = None,
           capacity: int | None = None, **conf) -> Memory | CudaMemory:
    """The memory timeline of a trace; with ``allocator="cuda"``, as the caching allocator holds it.

    >>> import torch, metadispatch as md
    >>> t = md.trace(lambda x: (x * 2).view(-1).sum(), torch.ones(256))
    >>> m = md.memory(t)  # x, then x * 2 and its view (once), then the sum
    >>> m.peak, m.timeline, m.by_category["other"], m.by_category["activations"]
    (2052, [2048, 2048, 2052], 1024, 1028)
    >>> r = md.memory(t, allocator="cuda", gpu="h100")  # three blocks in one 2 MiB segment
    >>> r.peak == m.peak, r.reserved_peak, r.segments
    (True, 2097152, 1)

    ``gpu`` names a profile (default ``h100``) whose memory is the capacity
    unless ``capacity`` (bytes) is given; ``conf`` are the
    ``PYTORCH_CUDA_ALLOC_CONF`` options (``expandable_segments=True``,
    ``max_split_size_mb=128``, ``roundup_power2_divisions=4``,
    ``garbage_collection_threshold=0.8``); see ``analysis/allocator.py``.
    """
    if allocator is None and not conf and gpu is None and capacity is None:
        return Memory(trace)
    if allocator not in (None, "cuda"):
        raise ValueError(f"allocator={allocator!r}: only 'cuda' is simulated")
    return CudaMemory(Memory(trace), gpu_profile(gpu), AllocatorConfig(**conf), capacity)


def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"


class LiveStorages(_compat.TorchDispatchMode):
    """The same accounting on a real run: each storage once, first sight to death.

    ``track`` what exists before the run (modules, tensors), then run under
    the mode; ``peak`` and ``timeline`` (after each op) compare with
    :func:`memory` of a trace of the same code.  Untracked tensors count from
    first sight, unless ``count_untracked=False`` (distributed runs: Note
    [Storages made out of sight]).

    >>> import torch, metadispatch as md
    >>> x = torch.ones(256)
    >>> with md.LiveStorages(x) as live:
    ...     y = (x * 2).view(-1).sum()
    >>> live.peak, live.timeline
    (2052, [2048, 2048, 2052])
    """

    def __init__(self, *tracked, count_untracked: bool = True) -> None:
        super().__init__()
        self.count_untracked = count_untracked
        self._ignored: set = set()  # storage keys never counted (count_untracked=False)
        self.live = 0
        self.peak = 0
        self.timeline: list = []
        self._refs: dict = {}  # storage key -> weakref with a callback
        self._sizes: dict = {}  # storage key -> bytes counted for it now
        self._undo: list = []
        self.track(*tracked)

    def track(self, *objs) -> None:
        """Count these tensors (or modules' parameters and buffers) as live now."""
        for o in objs:
            if isinstance(o, torch.nn.Module):
                self.track(*o.parameters(), *o.buffers())
            elif is_wrapper_subclass(o):  # a DTensor: its local tensor holds the storage
                self.track(*(getattr(o, name) for name in o.__tensor_flatten__()[0]))
            elif isinstance(o, torch.Tensor):
                self._see(o)
        self.peak = max(self.peak, self.live)

    def _ignore_if_new(self, t: torch.Tensor) -> None:
        """Note [Storages made out of sight]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        With ``count_untracked=False`` a storage first met as an op's input
        -- neither tracked nor made by an op seen before -- was made out of
        sight and is never counted.  On a distributed run that is a
        collective backend's scratch: gloo's reduce-scatter copies its whole
        input and splits the copy on the caller's thread after the op
        returns, memory a trace does not model and NCCL does not take from
        the caching allocator.  Constants ``torch.tensor`` makes (seen first
        by ``lift_fresh``) are the program's and still count.
        """
        if _compat.is_fake(t) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._refs and key not in self._ignored:
            self._ignored.add(key)
            weakref.finalize(st, self._ignored.discard, key)

    def _see(self, t: torch.Tensor) -> None:
        if _compat.is_fake(t):  # DTensor's sharding propagation: no memory
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._refs or key in self._ignored:
            return
        n = self._sizes[key] = _allocated(st.nbytes(), t.device)
        self._refs[key] = weakref.ref(st, partial(self._freed, key))
        self.live += n

    def _freed(self, key, _ref) -> None:
        self._refs.pop(key, None)
        self.live -= self._sizes.pop(key, 0)

    def _resized(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        if key in self._refs:
            n = _allocated(t.untyped_storage().nbytes(), t.device)
            self.live += n - self._sizes[key]
            self._sizes[key] = n

    def __enter__(self):
        try:
            fsdp_storage.install(self._undo)  # Note [FSDP frees by resizing storage]
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        while self._undo:
            self._undo[-1](); self._undo.pop()  # noqa: E702 (Note [Interrupts in mode entry and exit])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(is_wrapper_subclass(t) for t in inputs):
            # The subclass's own dispatch runs next, with this mode still
            # active, and its calls on local tensors come back here (Note
            # [Wrapper subclasses dispatch first] in core/dispatch.py).
            return NotImplemented
        if not self.count_untracked and func is not _LIFT_FRESH:
            for t in inputs:
                self._ignore_if_new(t)
        out = func(*args, **(kwargs or {}))
        for t in inputs + [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]:
            self._see(t)
        if func is _compat.resize_storage_bytes:
            self._resized(args[0])
        self.peak = max(self.peak, self.live)
        self.timeline.append(self.live)
        return out
