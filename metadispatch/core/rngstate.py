"""Recording the random streams of a traced run (the data: ``ir/rng.py``).

Meta kernels draw no numbers, so what a random op *would* draw is decided by
the generator it reads and that generator's state.  While a recording
MetaMode is entered, :class:`RngLog` notes

* each explicit ``torch.Generator``'s state at its first use, keyed by the
  object's identity (a generator is then a :class:`GeneratorRef` in calls);
* every ``torch.get_rng_state`` / ``torch.set_rng_state`` /
  ``torch.manual_seed`` (and the ``torch.cuda`` ones) the traced code makes,
  as :class:`RngEvent` records between calls.

Note [RNG state as slots]
~~~~~~~~~~~~~~~~~~~~~~~~~
Activation checkpointing saves ``torch.get_rng_state()`` in forward and puts
it back with ``torch.set_rng_state`` before recomputing, so that dropout
draws the same mask twice; ``fork_rng`` does the same around a block.  None
of these are aten ops: without a record, replay would draw a fresh mask for
the recomputed forward.  The state a traced run reads is the real
generator's, which tracing never advanced, so its bytes say nothing about
eager's; what matters is *which* read a later write restores.  So a read
becomes a numbered slot, and a write of the very tensor a read returned
becomes "load that slot"; replay reads and writes the real states at the
same points.  A write of any other tensor (a state the user kept from
before) is recorded with its bytes.

The functions are patched only while a recording mode is entered, restored
on exit (also when it raises), and record only for the mode active on the
calling thread; elsewhere they are torch's.  Limits: ``Generator.set_state``
and ``manual_seed`` called on an explicit generator inside the traced code
are methods of a C type and are not seen (its first-use state is).
"""

from __future__ import annotations

import functools
import weakref

import torch

from .. import _compat
from ..ir.rng import GeneratorRef, RngEvent

__all__ = ["RngLog", "install", "WIRING", "start_states"]


class _Wiring:
    """``current()`` gives the RngLog of the mode active on this thread, or None (set by mode.py)."""

    current = staticmethod(lambda: None)


WIRING = _Wiring()


class RngLog:
    """What one trace's random streams need; see the module docstring."""

    def __init__(self, trace) -> None:
        self.trace = trace
        # A generator reaches the dispatcher as a fresh Python wrapper each
        # call, so it is keyed by the C++ generator; the wrapper is held so
        # that the address is not reused while the trace is recorded
        # (released by forget(), when md.trace is done).  States are held
        # weakly: the log must not keep alive what checkpointing stores.
        self._generators: dict = {}  # generator key -> (wrapper, index)
        self._saved: dict = {}  # id(state tensor) -> (weakref, slot)
        self._slots = 0

    def generator(self, g: torch.Generator) -> GeneratorRef:
        key = _compat.generator_key(g)
        hit = self._generators.get(key)
        if hit is None:
            hit = self._generators[key] = (g, len(self.trace.generators))
            self.trace.generators.append((str(g.device), g.get_state()))
        return GeneratorRef(hit[1])

    def forget(self) -> None:
        """Let go of the generators seen (Note [No real tensor outlives the recording] in mode.py)."""
        self._generators.clear()

    def save(self, stream: str, state: torch.Tensor) -> None:
        """The traced code read ``stream``'s state and got ``state`` (Note [RNG state as slots])."""
        slot = self._slots
        self._slots += 1
        self._saved[id(state)] = (weakref.ref(state), slot)
        self.trace.rng_events.append(RngEvent(len(self.trace.calls), "save", stream, slot))

    def load(self, stream: str, state: torch.Tensor) -> None:
        """The traced code set ``stream``'s state to ``state``."""
        hit = self._saved.get(id(state))
        if hit is not None and hit[0]() is state:
            event = RngEvent(len(self.trace.calls), "load", stream, hit[1])
        else:
            # Kept as given: a copy made here would be an op, traced on meta.
            event = RngEvent(len(self.trace.calls), "load", stream, -1, state)
        self.trace.rng_events.append(event)


def start_states(trace) -> None:
    """Note the default generators' states a run starts from, once per trace."""
    if trace.rng_state is None:
        # The generator's own method: torch.get_rng_state may be patched by
        # an outer mode, which would record this read.
        trace.rng_state = torch.default_generator.get_state()
    if torch.cuda.is_initialized() and not trace.rng_cuda:
        # Only where a real CUDA already runs: initialising it here would
        # create a context the user did not ask for.
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            trace.rng_cuda[f"cuda:{i}"] = state


# -- the patched functions

_TORCH: dict = {}  # name -> torch's function, captured when first installed


def _cuda_stream(device) -> str:
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}"


def _get_rng_state() -> torch.Tensor:
    state = _TORCH["get_rng_state"]()
    log = WIRING.current()
    if log is not None:
        log.save("cpu", state)
    return state


def _set_rng_state(new_state: torch.Tensor) -> None:
    _TORCH["set_rng_state"](new_state)
    log = WIRING.current()
    if log is not None:
        log.load("cpu", new_state)


def _manual_seed(seed):
    out = _TORCH["manual_seed"](seed)
    log = WIRING.current()
    if log is not None:
        log.load("cpu", _TORCH["get_rng_state"]())
        for stream in log.trace.rng_cuda:
            log.load(stream, _TORCH["cuda.get_rng_state"](stream))
    return out


def _cuda_get_rng_state(device="cuda") -> torch.Tensor:
    state = _TORCH["cuda.get_rng_state"](device)
    log = WIRING.current()
    if log is not None:
        log.save(_cuda_stream(device), state)
    return state


def _cuda_set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    _TORCH["cuda.set_rng_state"](new_state, device)
    log = WIRING.current()
    if log is not None:
        log.load(_cuda_stream(device), new_state)


# (module, attribute, key in _TORCH, replacement)
_PATCHES = [
    (torch, "get_rng_state", "get_rng_state", _get_rng_state),
    (torch, "set_rng_state", "set_rng_state", _set_rng_state),
    (torch, "manual_seed", "manual_seed", _manual_seed),
    (torch.random, "get_rng_state", "get_rng_state", _get_rng_state),
    (torch.random, "set_rng_state", "set_rng_state", _set_rng_state),
    (torch.random, "manual_seed", "manual_seed", _manual_seed),
    (torch.cuda, "get_rng_state", "cuda.get_rng_state", _cuda_get_rng_state),
    (torch.cuda, "set_rng_state", "cuda.set_rng_state", _cuda_set_rng_state),
]


def install(steps: list) -> None:
    """Patch the RNG state functions; append the undo to ``steps`` first.

    A mode entered inside another finds them patched and leaves them to the
    outer one.
    """
    if torch.get_rng_state is _get_rng_state:
        return
    saved = [(mod, name, getattr(mod, name)) for mod, name, _, _ in _PATCHES]
    for mod, name, key, _ in _PATCHES:
        _TORCH.setdefault(key, getattr(mod, name))
    steps.append(functools.partial(_restore, saved))
    for mod, name, _, fn in _PATCHES:
        setattr(mod, name, fn)


def _restore(saved: list) -> None:
    for mod, name, fn in saved:
        setattr(mod, name, fn)
