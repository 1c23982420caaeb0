"""``torch.cuda``'s host-side answers for a logical CUDA device, on a host without one.

Distributed code asks ``torch.cuda`` questions that a tensor's device does
not answer: ``fully_shard`` takes its device from ``current_device()``,
overlaps communication with ``Stream``s and orders them with ``Event``s,
``init_device_mesh("cuda", ...)`` calls ``set_device``.  On a CPU-only host
each of those raises.  While a ``MetaMode`` with a logical world is
entered on such a host, they are answered: one device per rank
(``device_count() == 1``, every rank's tensors on ``cuda:0``), streams and
events that order nothing (a trace is one sequence of calls), the GPU
profile's name and compute capability (the mode's, else the default), and
``is_available()`` true, as the traced program expects -- in the mode's
thread only (``PATCHES``, Note [The ledger] in mode/ledger.py); a logical
world on the CPU gets the host's answers.

Limits: a trace has no timing, so stream overlap is not modelled: memory
is counted in call order, as on a single stream.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .. import _compat
from ..spec.profiles import GPUProfile

__all__ = ["install", "PATCHES", "Stream", "Event", "DEFAULT_STREAM"]


class Event:
    """A CUDA event that orders nothing."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event) -> float:
        return 0.0  # a trace has no timing: md.runtime estimates it


class Stream:
    """A CUDA stream: work on it runs in call order, like every other."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> Event:
        return event if event is not None else Event()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:  # optimizers ask before step(): no CUDA graph is captured
        return False

    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


DEFAULT_STREAM = Stream()


class _Profile(threading.local):
    profile: GPUProfile  # set by install() before any patch answers in this thread


_PROFILE = _Profile()  # the GPU this thread's logical world answers as


def _answers() -> dict:
    return {
        "get_device_capability": lambda device=None: _PROFILE.profile.compute_capability,
        "get_device_name": lambda device=None: _PROFILE.profile.name,
        "is_available": lambda: True,
        # False, as under a one-process logical GPU (cuda_answers.py): no CUDA
        # generator exists, and torch's seeding (``torch.manual_seed`` seeds
        # CUDA too) runs its callbacks at once when told CUDA is initialised.
        "is_initialized": lambda: False,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: DEFAULT_STREAM,
        "default_stream": lambda device=None: DEFAULT_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "Stream": Stream,
        "Event": Event,
    }


# torch.accelerator delegates is_available() to torch.cuda (answered above)
# but asks C++ for the rest: on a CUDA build of torch without a driver,
# ``optimizer.step()``'s graph-capture check then calls into the CUDA runtime
# and fails ("driver version is insufficient").  On a CPU build the
# accelerator is None and these are never asked.
def _accelerator_answers() -> dict:
    return {
        "current_stream": lambda device=None: DEFAULT_STREAM,
        "set_stream": lambda stream: None,
        "current_device_index": lambda: 0,
        "set_device_index": lambda device: None,
        "device_count": lambda: 1,
        "synchronize": lambda device=None: None,
    }


# Note [A logical world's accelerator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``fully_shard(model)`` without a mesh makes one on the build's accelerator
# (``torch._C._get_accelerator()``), as do ``init_process_group()``'s default
# backend and ``torch.accelerator.current_accelerator()``.  A CPU build
# answers "cpu": FSDP2 then moves the parameters to the CPU, and a MetaTensor
# on a logical CUDA device cannot take a CPU tensor as its ``.data``.  A real
# GPU job's build answers "cuda", and so does a logical world's GPU.
_CUDA = torch.device("cuda")


def _accelerator_queries() -> list:
    owner, names = _compat.accelerator_queries
    return [(owner, name, _answer(lambda: _CUDA)) for name in names if hasattr(owner, name)]


def install(steps: list, profile: GPUProfile) -> None:
    """Answer as ``profile``'s GPU in this thread until the undo steps run (the
    mode claims ``PATCHES`` through the ledger: mode/ledger.py)."""
    steps.append(functools.partial(setattr, _PROFILE, "profile", getattr(_PROFILE, "profile", profile)))
    _PROFILE.profile = profile


def _answer(answer):
    return lambda below: answer


# (owner, attribute, make, why): the ledger's rows.
PATCHES = [
    (owner, name, _answer(answer), "torch.cuda's host-side answers for a logical world's GPU, in its thread")
    for owner, answers in ((torch.cuda, _answers()), (torch.accelerator, _accelerator_answers()))
    for name, answer in answers.items()
    if hasattr(owner, name)
] + [
    (owner, name, make, "the build's accelerator: CUDA, as a GPU job's (Note [A logical world's accelerator])")
    for owner, name, make in _accelerator_queries()
]
