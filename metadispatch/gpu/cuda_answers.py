"""``torch.cuda``'s answers for the logical GPU of a MetaMode, in its thread only.

Note [The logical GPU answers per thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Model code asks the GPU questions a tensor's device does not answer:
transformers checks ``get_device_capability()`` before ``_grouped_mm``,
training scripts print ``get_device_name()``, total memory and their peak
memory.  On a host without CUDA each raises "Torch not compiled with CUDA
enabled".  While a MetaMode on a logical ``cuda`` device is entered -- on a
host without CUDA, or with ``gpu=`` named on any host -- code in *that
thread* gets the answers of the mode's GPU profile (profiles.py): one
device, its name, compute capability and properties; the memory counters
(``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
``max_memory_reserved``, ``memory_stats``, ``reset_peak_memory_stats``)
from the trace recorded so far (Note [Memory counters from the trace so
far] in analysis/cuda_counters.py, wired in as ``WIRING.counters``), and
``mem_get_info``'s free memory as the profile's less what that reserves;
no-op synchronisation and ``nvtx`` ranges; and the streams and events of a
logical world (logical_cuda.py), which order nothing: a trace is one
sequence of calls, and an event's ``elapsed_time`` is 0.  ``Stream`` and
``Event`` stay classes, so ``isinstance`` keeps working in every thread.
(``torch.cuda.manual_seed`` and the other RNG functions are recorded by
rngstate.py, which answers ``get_rng_state`` with a handle where no CUDA
generator exists; ``is_initialized`` stays false, so torch's own
utilities -- checkpointing -- save no CUDA state.)

The functions are replaced on ``torch.cuda`` (and, for the memory counters,
on ``torch.cuda.memory``, whose own functions call each other there; the
device and stream questions ``torch.accelerator`` asks C++ besides) through
the ledger (``PATCHES``; Note [The ledger] in mode/ledger.py): only threads
whose mode answers reach them, and each replacement asks which mode holds
the calling thread's dispatch-mode slot: this thread outside the mode or
inside an inner mode on another device gets torch's own function.  A
logical world (world.py) answers ``torch.cuda`` process-wide
(logical_cuda.py); on a host without CUDA its mode answers here too, so that
its thread gets the memory counters of its rank's trace.

Limits: one device; ``torch.cuda.memory_snapshot`` and the other allocator
internals are torch's (``md.memory(trace, allocator="cuda").snapshot()``
gives the simulated one); a stream or event made inside the mode is a
logical one after it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import torch

from .. import _compat
from ..spec.profiles import GPUProfile
from . import autocast, logical_cuda

__all__ = ["enter", "wanted", "WIRING", "PATCHES"]

_REAL_IS_AVAILABLE = _compat.host_cuda_available  # never the answer a logical GPU gives


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports, from a profile."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    L2_cache_size: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


@functools.cache
def _properties(profile: GPUProfile) -> DeviceProperties:
    major, minor = profile.compute_capability
    return DeviceProperties(profile.title, major, minor, profile.memory, profile.sm_count, profile.l2_bytes)


def _nothing(*args, **kwargs) -> None:
    return None


class _Wiring:
    """``counters(trace, profile)``: one mode's memory counters (analysis/cuda_counters.py sets it)."""

    __slots__ = ("counters",)

    def __init__(self) -> None:
        self.counters = _unwired


def _unwired(*args, **kwargs):
    raise RuntimeError("metadispatch.core was imported partially: import metadispatch")


WIRING = _Wiring()


class _Answering:
    """One mode answering: its profile, how often it is entered, its memory counters."""

    __slots__ = ("profile", "times", "counters")

    def __init__(self, profile: GPUProfile, counters) -> None:
        self.profile, self.times, self.counters = profile, 1, counters


# name -> the answer, given the _Answering of the calling thread's mode
_ANSWERS = {
    "is_available": lambda a: True,
    "device_count": lambda a: 1,
    "current_device": lambda a: 0,
    "set_device": _nothing,
    "get_device_name": lambda a, device=None: a.profile.title,
    "get_device_capability": lambda a, device=None: a.profile.compute_capability,
    "get_device_properties": lambda a, device=None: _properties(a.profile),
    "mem_get_info": lambda a, device=None: (a.profile.memory - a.counters.reserved(), a.profile.memory),
    "synchronize": _nothing,
    "current_stream": lambda a, device=None: logical_cuda.DEFAULT_STREAM,
    "default_stream": lambda a, device=None: logical_cuda.DEFAULT_STREAM,
    "set_stream": _nothing,
    "stream": lambda a, stream=None: contextlib.nullcontext(stream),
}
_MEMORY = {
    "memory_stats": lambda a, device=None: a.counters.stats(),
    "memory_allocated": lambda a, device=None: a.counters.allocated(),
    "max_memory_allocated": lambda a, device=None: a.counters.max_allocated(),
    "memory_reserved": lambda a, device=None: a.counters.reserved(),
    "max_memory_reserved": lambda a, device=None: a.counters.max_reserved(),
    "reset_peak_memory_stats": lambda a, device=None: a.counters.reset_peak(),
    "reset_max_memory_allocated": lambda a, device=None: a.counters.reset_peak(),
}
# torch.accelerator asks C++ for these (not torch.cuda): on a CUDA build of
# torch without a driver, ``optimizer.step()``'s graph-capture check fails
# (logical_cuda.py answers the same for a world).
_ACCELERATOR = {
    "current_stream": _ANSWERS["current_stream"],
    "set_stream": _nothing,
    "current_device_index": lambda a: 0,
    "set_device_index": _nothing,
    "device_count": _ANSWERS["device_count"],
    "synchronize": _nothing,
}
# torch.backends.cudnn: the profile's GPU has cuDNN (its version the
# profile's); on a CPU-only build ``is_acceptable`` warned "compiled without
# cuDNN" at every RNN's ``flatten_parameters``.
_CUDNN_DTYPES = (torch.float16, torch.float32, torch.float64, torch.bfloat16)


def _cudnn_acceptable(a, tensor) -> bool:
    return torch.backends.cudnn.enabled and tensor.device.type == "cuda" and tensor.dtype in _CUDNN_DTYPES


_CUDNN = {
    "is_available": lambda a: True,
    "version": lambda a: a.profile.cudnn_version,
    "is_acceptable": _cudnn_acceptable,
}
_CLASSES: dict = {"Stream": logical_cuda.Stream, "Event": logical_cuda.Event}
_NVTX = ("range_push", "range_pop", "mark")
# id(mode) -> _Answering for every mode answering, in any thread
_ANSWERING: dict = {}
_LOCK = threading.Lock()


def wanted(device, gpu_named: bool, world: bool = False) -> bool:
    """Whether a mode on ``device`` answers: a logical cuda device, where there
    is no real one or a GPU was named; a logical world's on no named device,
    where there is no real one.  (A logical world on ``device="cpu"`` gets the
    host's answers, as a real CPU job does.)"""
    return gpu_like(device, world) and (gpu_named or not _REAL_IS_AVAILABLE())


def gpu_like(device, world: bool) -> bool:
    """Whether a mode's logical device is a GPU: ``cuda``, or none named in a logical world."""
    return device.type == "cuda" if device is not None else world


def host_has_cuda() -> bool:
    """Whether this host has a CUDA device (torch's own answer, whatever is patched)."""
    return _REAL_IS_AVAILABLE()


def without_generator() -> bool:
    """Whether a logical GPU answers this thread on a host without CUDA: no
    CUDA generator exists behind ``torch.cuda``'s RNG state functions
    (rngstate.py, Note [A logical GPU's generator state])."""
    return not _REAL_IS_AVAILABLE() and _current() is not None


def _current() -> _Answering | None:
    mode = _compat.get_infra_mode(_compat.mode_key)
    return _ANSWERING.get(id(mode)) if mode is not None else None


def _per_thread(real, answer):
    def per_thread(*args, **kwargs):
        a = _current()
        return real(*args, **kwargs) if a is None else answer(a, *args, **kwargs)

    per_thread.__wrapped__ = real
    return per_thread


class _PerThreadClass(type):
    """``torch.cuda.Stream``/``Event`` while replaced: calling one makes the
    logical class's object in an answering thread, torch's elsewhere; both
    are instances of it."""

    _real: type
    _logical: type

    def __call__(cls, *args, **kwargs):
        return (cls._real if _current() is None else cls._logical)(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, (cls._real, cls._logical))

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, (cls._real, cls._logical))


def _replacement(owner, name: str, real):
    if owner is torch:
        return _per_thread(real, functools.partial(_clear_autocast_cache, real))
    if owner is torch.backends.cudnn:
        return _per_thread(real, _CUDNN[name])
    if owner is torch.cuda.nvtx:
        return _per_thread(real, _nothing)
    if owner is torch.accelerator:
        return _per_thread(real, _ACCELERATOR[name])
    if name in _CLASSES:
        return _PerThreadClass(name, (), {"_real": real, "_logical": _CLASSES[name], "__wrapped__": real})
    return _per_thread(real, _ANSWERS.get(name) or _MEMORY[name])


def _targets() -> list:
    return (
        [(torch.cuda, name) for name in (*_ANSWERS, *_MEMORY, *_CLASSES)]
        + [(torch.cuda.memory, name) for name in _MEMORY]
        + [(torch.cuda.nvtx, name) for name in _NVTX]
        + [(torch.accelerator, name) for name in _ACCELERATOR]
        + [(torch, "clear_autocast_cache")]
        + [(torch.backends.cudnn, name) for name in _CUDNN]
    )


def _clear_autocast_cache(real, _answering) -> None:
    # ``torch.autocast`` empties C++'s cast cache when the outermost one
    # exits; the logical GPU's casts are cached in Python (autocast.py).
    autocast.clear_cache()
    real()


def _add(key: int, profile: GPUProfile, trace) -> None:
    entry = _ANSWERING.get(key)
    if entry is not None:
        entry.times += 1
        return
    _ANSWERING[key] = _Answering(profile, WIRING.counters(trace, profile))


def _remove(key: int) -> None:
    entry = _ANSWERING.get(key)
    if entry is None:
        return  # never added (an interrupt before it), or removed already
    entry.times -= 1
    if not entry.times:
        del _ANSWERING[key]


def enter(steps: list, mode, profile: GPUProfile) -> None:
    """Answer for ``mode`` in its thread until the undo steps run (the mode
    claims ``PATCHES`` through the ledger: mode/ledger.py)."""
    steps.append(functools.partial(_compat.call_locked, _LOCK, _remove, id(mode)))
    _compat.call_locked(_LOCK, _add, id(mode), profile, mode.trace)


# (owner, attribute, make, why): the ledger's rows.
PATCHES = [
    (owner, name, functools.partial(_replacement, owner, name), "torch.cuda's answers for a logical GPU, in its thread")
    for owner, name in _targets()
    if hasattr(owner, name)
]
