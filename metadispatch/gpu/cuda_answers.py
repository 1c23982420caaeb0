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
from ..errors import UnsupportedFeatureError, mark_call
from ..source import user_frame
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
    """One mode answering: its profile, how often it is entered, its memory
    counters, its GPU's index and whether it is a logical world's rank."""

    __slots__ = ("profile", "times", "counters", "index", "world")

    def __init__(self, profile: GPUProfile, counters, index: int = 0, world: bool = False) -> None:
        self.profile, self.times, self.counters = profile, 1, counters
        self.index, self.world = index, world


# Note [The logical GPU's index]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On a host without CUDA the logical machine of ``MetaMode(device="cuda:1")``
# is that one GPU (Note [A factory's named device] in mode/devices.py):
# ``device_count()`` is 1, and the current device -- ``current_device()``,
# ``torch.accelerator.current_device_index()``, what ``"cuda"`` and
# ``device=None`` name -- is its index, 1, as in a real job that called
# ``torch.cuda.set_device(1)`` (it answered 0, so
# ``torch.device("cuda", torch.cuda.current_device())`` named a GPU the
# machine lacks).  ``set_device``, ``with torch.cuda.device(i)`` and the
# questions that take a device (``get_device_name(i)``, ``mem_get_info(i)``)
# accept that index and refuse another, as a factory naming it is refused;
# a logical world's rank accepts every index (``set_device(local_rank)``):
# each rank's GPU is the mode's.
def _index(a: _Answering, device, name: str) -> int:
    """The index ``device`` names (None, "cuda": the current one), refused if not the mode's GPU."""
    if isinstance(device, torch.cuda.device):  # as eager's _get_device_index
        device = device.idx
    if device is None:
        return a.index
    named = device if isinstance(device, int) else torch.device(device)
    if isinstance(named, torch.device) and named.type != "cuda":  # eager's ValueError
        raise ValueError(f"torch.cuda.{name}({device!r}): expected a cuda device, but got: {named}")
    if a.world:
        return a.index
    index = named if isinstance(named, int) else named.index
    if index is None or index == a.index or index < 0:
        return a.index
    error = UnsupportedFeatureError(
        f"torch.cuda.{name}({device!r}): the logical machine of this MetaMode has 1 CUDA device, "
        f"'cuda:{a.index}'; a real job there fails with 'invalid device ordinal' "
        "(Note [The logical GPU's index]). Name the mode's device, or trace with MetaMode() and no device"
    )
    mark_call(error, f"torch.cuda.{name}", user_frame())
    raise error


def _set_device(a: _Answering, device) -> None:
    _index(a, device, "set_device")  # eager returns nothing


def _on_device(name: str, answer):
    def checked(a, device=None):
        _index(a, device, name)
        return answer(a)

    return checked


def _exchange(a: _Answering, device: int) -> int:
    # torch.cuda.device's __enter__/__exit__: the previous index (one GPU: the mode's)
    if device < 0:
        return -1
    _index(a, device, "device")
    return a.index


# name -> the answer, given the _Answering of the calling thread's mode
_ANSWERS = {
    "is_available": lambda a: True,
    "device_count": lambda a: 1,
    "current_device": lambda a: a.index,  # Note [The logical GPU's index]
    "set_device": _set_device,
    "_exchange_device": _exchange,
    "_maybe_exchange_device": _exchange,
    "get_device_name": _on_device("get_device_name", lambda a: a.profile.title),
    "get_device_capability": _on_device("get_device_capability", lambda a: a.profile.compute_capability),
    "get_device_properties": _on_device("get_device_properties", lambda a: _properties(a.profile)),
    "mem_get_info": _on_device("mem_get_info", lambda a: (a.profile.memory - a.counters.reserved(), a.profile.memory)),
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
    "current_device_index": lambda a: a.index,
    "set_device_index": _set_device,
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


def _add(key: int, profile: GPUProfile, trace, index: int, world: bool) -> None:
    entry = _ANSWERING.get(key)
    if entry is not None:
        entry.times += 1
        return
    _ANSWERING[key] = _Answering(profile, WIRING.counters(trace, profile), index, world)


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
    device, world = mode.device, mode.world is not None
    index = device.index or 0 if device is not None and device.type == "cuda" and not world else 0
    _compat.call_locked(_LOCK, _add, id(mode), profile, mode.trace, index, world)


# (owner, attribute, make, why): the ledger's rows.
PATCHES = [
    (owner, name, functools.partial(_replacement, owner, name), "torch.cuda's answers for a logical GPU, in its thread")
    for owner, name in _targets()
    if hasattr(owner, name)
]
