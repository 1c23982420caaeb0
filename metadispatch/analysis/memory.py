"""Memory of a trace: live bytes over the calls, by category and module.

Requirements: count each storage once (views, in-place results and tied
weights share one), free it when the last tensor using it dies, and say what
the bytes are.  A storage is live from the call that first produced it until
the call before its death, as recorded while tracing (Note [Storage numbers
and deaths] in ``record.py``); a trace without recorded deaths (loaded from
elsewhere) falls back to "dies after its last use", which can only free
earlier than a real run does.  Leaves -- parameters, buffers, inputs -- are
live from the start, also those no call reads (Note [State the step never
reads] in ``tracing/tracer.py``).  Bytes are the storage's size: the furthest
the tensors reach in it, or more where the storage is larger (Note [Storages
larger than their tensors] in ``core/record.py``); on CUDA they are rounded up to the caching allocator's 512-byte blocks, as
``MemTracker`` does.

Categories: ``params`` (parameter leaves, and what the step shows to be
parameters: what the optimizer updates, FSDP's sharded parameters),
``unsharded params``, ``all-gather buffers`` and ``reduce-scatter
buffers`` (FSDP2's), ``grads`` (the ``.grad`` tensors the trace ends with,
and what the optimizer reads), ``optimizer state``, ``activations`` (made
in forward), ``temporaries`` (made in backward and none of the above),
``optimizer`` (made inside ``optimizer.step``: its scratch),
``workspaces`` (what kernels allocate inside themselves, ``workspace.py``:
no tensor of the trace holds it) and ``other`` (inputs, buffers,
constants).  Which calls show what: Note [Roles from the step's calls] in
``roles.py``.

Limits: the allocator's fragmentation and caching are not in this figure
(``md.memory(trace, allocator="cuda")`` simulates them); it is what
``torch.cuda.max_memory_allocated`` calls allocated, not what ``nvidia-smi``
shows.

:class:`LiveStorages` (``live.py``) does the same accounting on a real run, so the model
can be checked against reality (see ``tests/analysis/test_memory.py``).
"""

from __future__ import annotations

from collections import Counter

import torch

from .._compat import pytree
from ..ir.cut import STATE, state_phase, step_from
from ..ir.records import tensor_bytes
from ..ir.text import fmt_bytes, render
from ..ir.trace import TensorMeta, Trace
from ..spec.profiles import GPUProfile, gpu_profile
from ..tracing.marks import mark_index
from ..world.fsdp_storage import RESIZE_OP
from .allocconfig import AllocatorConfig
from .reserved import CudaMemory
from .roles import ROLES, roles
from .workspace import cpu_block, cublas_workspace, transient_workspace, unsized, unsized_lines, uses_cublas

__all__ = ["Memory", "memory", "CATEGORIES", "fmt_bytes", "tensor_bytes", "allocated_bytes", "step_text"]

CATEGORIES = (*ROLES, "activations", "temporaries", "optimizer", "workspaces", "other")
_BY_PHASE = {"forward": "activations", "backward": "temporaries", "optimizer": "optimizer"}
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this


def allocated_bytes(nbytes: int, device: torch.device) -> int:
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
        return allocated_bytes(self.nbytes, self.device)


def _on_meta(m) -> bool:
    """A tensor on the meta device: shape inference's (torch.distributed.pipelining's, a stage's
    shapes found in pipeline/families.py), holding no memory in a real process."""
    return str(m.device).startswith("meta")


def _storages(trace: Trace, categories: bool = True) -> dict:
    """Storage number -> StorageInfo, for every storage the trace touches."""
    out: dict = {}
    resizes: dict = {}  # storage number -> [(call index, new bytes)]
    for i, call in enumerate(trace.calls):
        if call.op == RESIZE_OP:
            resizes.setdefault(call.args[0].storage, []).append((i, call.args[1]))
        for m in call.inputs:
            info = out.get(m.storage)
            if info is None:
                if _on_meta(m):
                    continue
                info = out[m.storage] = _leaf_info(trace, m)
            info.nbytes = max(info.nbytes, tensor_bytes(m))
            info.last_use = i
        for m in call.output_metas:
            info = out.get(m.storage)
            if info is None:
                if _on_meta(m):
                    continue
                info = out[m.storage] = StorageInfo(
                    m.storage, m.device, i, _BY_PHASE.get(call.phase, "other"), call.module
                )
            info.nbytes = max(info.nbytes, tensor_bytes(m))
            info.last_use = i
    for leaf in trace.leaves.values():  # Note [State the step never reads] in tracing/tracer.py
        m = leaf.meta
        info = out.get(m.storage)
        if info is None:
            if leaf.kind == STATE and _on_meta(m):
                # A meta tensor a call before a cut made (a pipeline stage's shape inference): no bytes, as
                # the full trace counted none.  A meta argument or parameter is counted: it stands for the
                # tensor it will be loaded as (docs/integrations.md, accelerate's init_empty_weights).
                continue
            info = out[m.storage] = _leaf_info(trace, m)
            info.nbytes = tensor_bytes(m)
    for number, nbytes in trace.storage_bytes.items():  # Note [Storages larger than their tensors] in record.py
        info = out.get(number)
        if info is not None and nbytes > info.nbytes:
            info.nbytes = nbytes
    for g in trace.grads.values():
        if g.storage in out:
            out[g.storage].category = "grads"
    _deaths(trace, out)
    found = roles(trace, {s: info.died for s, info in out.items()}) if categories else {}
    for number, role in found.items():
        if number in out:
            out[number].category = role
    for number in trace.start_bytes:  # resized before the cut (Note [What the calls before a cut leave alive])
        if number in out:
            resizes.setdefault(number, [])
    for number, events in resizes.items():
        _split(out, number, events, trace.start_bytes.get(number))
    return out


def _split(infos: dict, number: int, events: list, first: int | None = None) -> None:
    """A storage resized while it lived (Note [FSDP frees by resizing storage]
    in world/fsdp_storage.py) as one StorageInfo per stretch of constant size:
    the one resized to 0 bytes after call ``i`` is not live at ``i``, the one
    resized back at ``j`` is, as a storage born at ``j``.  Later stretches
    are keyed ``(number, k)``; ``first``: the first stretch's bytes, where
    not the storage's largest (it was resized before the trace's start)."""
    info = infos[number]
    stretches, start, size = [], info.born, info.nbytes if first is None else first
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
    # what the warmup's optimizer made is its state; roles.py names the rest from the step's calls
    phase = state_phase(leaf) if leaf is not None else None
    return StorageInfo(m.storage, m.device, -1, "optimizer state" if phase == "optimizer" else "other", "")


def _deaths(trace: Trace, infos: dict) -> None:
    if trace.deaths is not None:
        for s, info in infos.items():
            info.died = trace.deaths.get(s)
        return
    kept = {m.storage for m in pytree.tree_leaves(trace.output_meta) if isinstance(m, TensorMeta)}
    kept |= {g.storage for g in trace.grads.values()}
    for s, info in infos.items():
        if info.born >= 0 and s not in kept:
            info.died = info.last_use + 1


def _workspaces(trace: Trace, gpu: GPUProfile) -> dict:
    """Kernel workspaces as storages of their own (Note [Transient and persistent
    workspaces] in ``workspace.py``): a transient one lives during its call only."""
    out: dict = {}
    block = cpu_block()
    for i, call in enumerate(trace.calls):
        nbytes = transient_workspace(call, block)
        if nbytes:
            info = out[("workspace", i)] = StorageInfo(
                ("workspace", i), call.output_metas[0].device, i, "workspaces", call.module
            )
            info.nbytes, info.died = nbytes, i + 1
        # One per cuBLAS handle: the step's thread's, and the autograd
        # engine's device thread's for backward (Note [Transient and persistent workspaces]).
        key = ("workspace", "cublas-backward" if call.phase == "backward" else "cublas")
        if key not in out and uses_cublas(call):
            info = out[key] = StorageInfo(key, call.output_metas[0].device, i, "workspaces", "")  # the process's
            info.nbytes = cublas_workspace(gpu)
    return out


class Memory:
    """Live bytes over a trace; print it for a table.

    ``timeline[i]`` is the bytes live during call ``i`` (what it made and
    what is still alive after it, with its workspace); ``by_category`` and
    ``by_module`` (the module whose call made the bytes, or owns the
    parameter) are taken at the peak.  ``workspaces=False`` leaves kernel
    workspaces out (the storages of the trace only); ``gpu`` is the profile
    whose libraries size a CUDA trace's workspaces (default: the trace's).
    ``categories=False`` skips the analysis of what the optimizer's and
    FSDP's storages are (``roles.py``): the totals are the same, each
    storage keeps the category of the phase that made it.  ``unsized``
    counts, by op, the calls whose own memory only their library sizes at
    run time (cuDNN's RNN reserve, workspaces and dropout state): the peak
    leaves it out, and the printed table says so.
    """

    def __init__(
        self,
        trace: Trace,
        gpu: str | GPUProfile | None = None,
        workspaces: bool = True,
        categories: bool = True,
        device: str | None = None,
    ) -> None:
        self.trace = trace
        self.storages = _storages(trace, categories)
        if workspaces:
            self.storages.update(_workspaces(trace, gpu_profile(gpu or trace.gpu)))
        if device is not None:
            # One device's memory: a GPU's without the host's, as FSDP2's CPU offload splits them.
            self.storages = {k: s for k, s in self.storages.items() if s.device.type == device}
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
        # op name -> calls whose own memory only their library sizes (workspace.py): the peak leaves it out
        self.unsized: Counter = Counter(call.op for call in trace.calls if unsized(call))
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
        lines = [f"peak {fmt_bytes(self.peak)}" + self._where(), f"{step_text(self.trace)}."]
        rows = [(c, fmt_bytes(b), _pct(b, self.peak)) for c, b in self.by_category.items() if b]
        lines += render(("category", "at peak", "share"), rows, align="<>>")
        rows = [(m or "<top>", fmt_bytes(b), _pct(b, self.peak)) for m, b in self.by_module.most_common(10)]
        lines += render(("module", "at peak", "share"), rows, align="<>>")
        return "\n".join(lines + unsized_lines(self.unsized))

    def _where(self) -> str:
        if self.peak_call is None:
            return ""
        call = self.trace.calls[self.peak_call]
        return f" after call #{self.peak_call} {call.op} ({call.phase}" + (f", {call.module})" if call.module else ")")


def step_text(trace: Trace) -> str:
    """Which step of the traced code a trace is, for people (``md.tracer(warmup=N)``)."""
    n = trace.warmup
    if n:
        return f"Step {n + 1}, the steady state: what {n} warmup step{'s' if n > 1 else ''} left is live from its start"
    return "Step 1, no warmup: md.tracer(warmup=1) for the steady state"


def _running(deltas: list) -> list:
    out, acc = [], 0
    for d in deltas:
        acc += d
        out.append(acc)
    return out


def memory(
    trace: Trace,
    allocator: str | None = None,
    gpu: str | GPUProfile | None = None,
    capacity: int | None = None,
    workspaces: bool = True,
    since: str | int | None = None,
    device: str | None = None,
    **conf,
) -> Memory | CudaMemory:
    """The memory timeline of a trace; with ``allocator="cuda"``, as the caching allocator holds it.

    >>> import torch, metadispatch as md
    >>> t = md.trace(lambda x: (x * 2).view(-1).sum(), torch.ones(256))
    >>> m = md.memory(t)  # x, then x * 2 and its view (once), then the sum
    >>> m.peak, m.timeline, m.by_category["other"], m.by_category["activations"]
    (2052, [2048, 2048, 2052], 1024, 1028)
    >>> r = md.memory(t, allocator="cuda", gpu="h100")  # three blocks in one 2 MiB segment
    >>> r.peak == m.peak, r.reserved_peak, r.segments
    (True, 2097152, 1)

    ``gpu`` names a profile (default: the one the trace was recorded for,
    else ``h100``) whose memory is the capacity unless ``capacity`` (bytes)
    is given; ``workspaces=False`` leaves out kernel workspaces
    (``analysis/workspace.py``); ``conf`` are the
    ``PYTORCH_CUDA_ALLOC_CONF`` options (``expandable_segments=True``,
    ``max_split_size_mb=128``, ``roundup_power2_divisions=4``,
    ``garbage_collection_threshold=0.8``); see ``analysis/allocator.py``.
    ``since``: a mark's name (``md.mark``) or a call index; the figure is of
    the calls from there on, with what the calls before left alive (a model
    built in the trace) live from its start, not as activations.
    ``device``: a device type ("cuda", "cpu"); only its storages are
    counted (FSDP2's ``CPUOffloadPolicy`` keeps the shards on the host).
    """
    if since is not None:
        trace = step_from(trace, mark_index(trace, since))
    if allocator is None and not conf and gpu is None and capacity is None:
        return Memory(trace, workspaces=workspaces, device=device)
    if allocator not in (None, "cuda"):
        raise ValueError(f"allocator={allocator!r}: only 'cuda' is simulated")
    profile = gpu_profile(gpu or trace.gpu)
    return CudaMemory(Memory(trace, profile, workspaces, device=device), profile, AllocatorConfig(**conf), capacity)


def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"
