"""``torch.cuda``'s answers for the logical GPU of a MetaMode, in its thread only.

Note [The logical GPU answers per thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Model code asks the GPU questions a tensor's device does not answer:
transformers checks ``get_device_capability()`` before ``_grouped_mm``,
training scripts print ``get_device_name()`` and total memory.  On a host
without CUDA each raises "Torch not compiled with CUDA enabled".  While a
MetaMode on a logical ``cuda`` device is entered -- on a host without CUDA,
or with ``gpu=`` named on any host -- code in *that thread* gets the answers
of the mode's GPU profile (profiles.py): one device, its name, compute
capability, properties and free memory, and no-op synchronisation and
``nvtx`` ranges.  (``torch.cuda.manual_seed`` and the other RNG functions
are recorded by rngstate.py; ``is_initialized`` stays false, as no CUDA
generator state exists to save.)

The functions are replaced on ``torch.cuda`` while at least one such mode is
entered anywhere (a count under a lock), and each replacement asks which
mode holds the calling thread's dispatch-mode slot: another thread, or this
one outside the mode or inside an inner mode on another device, gets
torch's own function.  The last mode out puts torch's functions back, also
when it leaves by an exception (the undo step comes before the change: Note
[Interrupts in mode entry and exit] in mode.py).  A logical world
(world.py) answers its own, process-wide, instead.

Limits: the memory counters (``memory_allocated`` and friends) are not
answered; ``torch.cuda.Stream``/``Event`` classes are left alone.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from .. import _compat
from .profiles import GPUProfile

__all__ = ["enter", "wanted"]

_REAL_IS_AVAILABLE = torch.cuda.is_available


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


def _properties(profile: GPUProfile) -> DeviceProperties:
    major, minor = profile.compute_capability
    return DeviceProperties(profile.title, major, minor, profile.memory, profile.sm_count, profile.l2_bytes)


def _nothing(*args, **kwargs) -> None:
    return None


@functools.cache
def _answers(profile: GPUProfile) -> dict:
    props = _properties(profile)
    return {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": _nothing,
        "get_device_name": lambda device=None: props.name,
        "get_device_capability": lambda device=None: profile.compute_capability,
        "get_device_properties": lambda device=None: props,
        # nothing is allocated on a logical device: all of it is free
        "mem_get_info": lambda device=None: (profile.memory, profile.memory),
        "synchronize": _nothing,
    }


_NVTX = ("range_push", "range_pop", "mark")
# id(mode) -> [profile, times entered] for every mode answering, in any thread
_ANSWERING: dict = {}
_LOCK = threading.Lock()
_SAVED: list = []  # (owner, name, torch's function) while installed


def wanted(device, gpu_named: bool) -> bool:
    """Whether a mode on ``device`` answers: a logical cuda device, where there
    is no real one or a GPU was named."""
    return device is not None and device.type == "cuda" and (gpu_named or not _REAL_IS_AVAILABLE())


def _current_profile():
    mode = _compat.get_infra_mode(_compat.mode_key)
    entry = _ANSWERING.get(id(mode)) if mode is not None else None
    return entry[0] if entry is not None else None


def _per_thread(owner, name, real):
    def answer(*args, **kwargs):
        profile = _current_profile()
        if profile is None:
            return real(*args, **kwargs)
        if owner is torch.cuda.nvtx:
            return None
        return _answers(profile)[name](*args, **kwargs)

    answer.__wrapped__ = real
    return answer


def _targets(profile: GPUProfile) -> list:
    return [(torch.cuda, name) for name in _answers(profile)] + [(torch.cuda.nvtx, name) for name in _NVTX]


def _add(key: int, profile: GPUProfile) -> None:
    entry = _ANSWERING.get(key)
    if entry is not None:
        entry[1] += 1
        return
    if not _ANSWERING:
        for owner, name in _targets(profile):
            if hasattr(owner, name):
                real = getattr(owner, name)
                _SAVED.append((owner, name, real))
                setattr(owner, name, _per_thread(owner, name, real))
    _ANSWERING[key] = [profile, 1]


def _remove(key: int) -> None:
    entry = _ANSWERING.get(key)
    if entry is None:
        return  # never added (an interrupt before it), or removed already
    entry[1] -= 1
    if entry[1]:
        return
    del _ANSWERING[key]
    if not _ANSWERING:
        while _SAVED:
            owner, name, real = _SAVED.pop()
            setattr(owner, name, real)


def enter(steps: list, mode, profile: GPUProfile) -> None:
    """Answer for ``mode`` in its thread until the undo steps run."""
    steps.append(functools.partial(_compat.call_locked, _LOCK, _remove, id(mode)))
    _compat.call_locked(_LOCK, _add, id(mode), profile)
