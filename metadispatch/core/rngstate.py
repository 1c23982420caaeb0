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

The functions are replaced through the ledger (``PATCHES``, Note [The
ledger] in mode/ledger.py) in the threads of recording modes, and record
only for the mode active on the calling thread; every other thread gets
torch's.

Note [States that change unseen]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Not every write goes through a function we can patch: ``Generator``'s
methods (``torch.default_generator.set_state``, ``g.manual_seed``) belong to
a C type, and ``from torch import set_rng_state`` binds torch's function
before any mode exists.  But tracing never advances a real generator, so a
generator whose real state is not the one the log last knew has been
written by the traced code.  Before each random op, the state of the
generator it draws from is compared with the one known; a difference is
recorded as a write of the state found: its bytes, or -- where it is a marker (Note [Marker states])
-- "load the state the stream had at that point", so replay sets the same
state at the same point.  One write cannot be replayed and says so instead:
``torch.seed()`` (patched) seeds from the operating system, so eager draws
other numbers on every run; it is a ``seed`` event, and replay lists the
stream as made up.

Limit: ``Generator.seed()`` called as a method (on an explicit generator,
or ``torch.default_generator.seed()``) looks like any other write and is
recorded as the state it set: replay then draws that run's numbers.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from .. import _compat
from ..errors import UnsupportedFeatureError
from ..gpu import cuda_answers
from ..ir.rng import GeneratorRef, RngEvent

__all__ = ["RngLog", "PATCHES", "WIRING", "start_states"]

_CPU_BYTES = 5056  # a CPU generator's state
_MARK = slice(32, 48)  # Note [Marker states]: a word of the Mersenne Twister's table, past seed and counters


class _Wiring:
    """``current()`` gives the RngLog of the mode active on this thread, or None (set by mode.py)."""

    current = staticmethod(lambda: None)


WIRING = _Wiring()


class RngLog:
    """What one trace's random streams need; see the module docstring."""

    def __init__(self, trace) -> None:
        self._trace = lambda: trace  # weak once released (Note [Dropping a trace frees it] in record.py)
        # A generator reaches the dispatcher as a fresh Python wrapper each
        # call, so it is keyed by the C++ generator; the wrapper is held so
        # that the address is not reused while the trace is recorded
        # (released by forget(), when md.trace is done).  States are held
        # weakly: the log must not keep alive what checkpointing stores.
        self._generators: dict = {}  # generator key -> (wrapper, index)
        self._saved: dict = {}  # id(state tensor) -> (weakref, slot)
        self._slots = 0
        # Note [States that change unseen]: stream -> the real state it was
        # last known to hold ("cpu", or an explicit generator's index).
        self._known: dict = {}
        self._real: dict = {}  # generator index -> its last state not a marker (restored at the end)
        self._markers: dict = {}  # marker bytes -> (stream, call) (Note [Marker states])
        self._slot_at: dict = {}  # (stream, call) -> the slot saving that state
        self._count = 0

    def generator(self, g: torch.Generator) -> GeneratorRef | None:
        """An explicit generator argument as recorded; None for the default CPU generator itself."""
        key = _compat.generator_key(g)
        if key == _compat.generator_key(torch.default_generator):
            return None  # ``generator=torch.default_generator``: the default stream, drawn as such
        hit = self._generators.get(key)
        if hit is None:
            index = len(self.trace.generators)
            hit = self._generators[key] = (g, index)
            state = g.get_state()
            self.trace.generators.append((str(g.device), state))
            self._known[index] = self._real[index] = state
            self._loaded(f"generator {index}", state)  # a marker copied into it (below)
        return GeneratorRef(hit[1])

    def before_draw(self, generator, at: int) -> None:
        """Note [States that change unseen]: call ``at`` draws from ``generator``
        (a GeneratorRef, or None: the default CPU one)."""
        if generator is None:
            key, stream, g = "cpu", "cpu", torch.default_generator
        else:
            key, stream = generator.index, f"generator {generator.index}"
            g = next(w for w, i in self._generators.values() if i == key)
        with _compat.no_torch_function():  # our own comparisons, not the traced code's
            self._check(g, key, stream, at)

    def _check(self, g: torch.Generator, key, stream: str, at: int) -> None:
        now = g.get_state()
        if not torch.equal(now, self._known.get(key, self.trace.rng_state)):
            if not self._loaded(stream, now):
                self._real[key] = now
                self.trace.rng_events.append(RngEvent(at, "load", stream, -1, now))
        if g.device.type == "cpu":
            self._known[key] = self._mark(g, now, stream, at + 1)

    def _mark(self, g: torch.Generator, state: torch.Tensor, stream: str, at: int) -> torch.Tensor:
        """Give ``g`` a state of its own, standing for ``stream``'s state before call ``at``.

        Note [Marker states]
        ~~~~~~~~~~~~~~~~~~~~
        Tracing draws nothing, so without this a generator would hold the
        same bytes throughout, and a write restoring a state read earlier
        (``s = g.get_state()``, a draw, ``g.set_state(s)``) would change
        nothing we could see.  After each draw the generator is given a
        *marker*: its state with one word of the Mersenne Twister's table
        replaced by a counter (the seed it reports is kept).  A state read
        later holds the marker; a write of it is recognised and becomes
        "load the state the stream had before call ``at``", which replay
        saves at that point.  Real generators end the trace as they began.
        """
        self._count += 1
        marker = state.clone()
        marker[_MARK].copy_(torch.tensor([self._count, 0x6D64], dtype=torch.int64).view(torch.uint8))
        g.set_state(marker)
        self._markers[_key(marker)] = (stream, at)
        return marker

    def _loaded(self, stream: str, state: torch.Tensor) -> bool:
        """If ``state`` is a marker, record "load the state it stands for" into ``stream``."""
        hit = self._markers.get(_key(state)) if type(state) is torch.Tensor and state.numel() == _CPU_BYTES else None
        if hit is None:
            return False
        source, at = hit
        slot = self._slot_at.get(hit)
        if slot is None:
            slot = self._slot_at[hit] = self._slots
            self._slots += 1
            events = self.trace.rng_events
            i = next((n for n, e in enumerate(events) if e.at >= at), len(events))
            events.insert(i, RngEvent(at, "save", source, slot))
        self.trace.rng_events.append(RngEvent(len(self.trace.calls), "load", stream, slot))
        return True

    def wrote(self, stream: str) -> None:
        """A patched function wrote ``stream``: its state now is known."""
        if stream == "cpu":
            self._known["cpu"] = torch.default_generator.get_state()

    def seeded(self, stream: str) -> None:
        """``torch.seed()``: a state from the operating system (Note [States that change unseen])."""
        self.trace.rng_events.append(RngEvent(len(self.trace.calls), "seed", stream, -1))
        self.wrote(stream)

    @property
    def trace(self):
        return self._trace()

    def release_trace(self) -> None:
        self._trace = weakref.ref(self._trace())

    def forget(self) -> None:
        """Let go of the generators seen (Note [No real tensor outlives the recording] in mode.py),
        each given back the last state it held that was not a marker."""
        for g, index in self._generators.values():
            if _key(g.get_state()) in self._markers:
                g.set_state(self._real[index])
        self._generators.clear()
        self._markers.clear()

    def save(self, stream: str, state: torch.Tensor) -> None:
        """The traced code read ``stream``'s state and got ``state`` (Note [RNG state as slots])."""
        slot = self._slots
        self._slots += 1
        self._saved[id(state)] = (weakref.ref(state), slot)
        self.trace.rng_events.append(RngEvent(len(self.trace.calls), "save", stream, slot))

    def load(self, stream: str, state: torch.Tensor) -> None:
        """The traced code set ``stream``'s state to ``state``."""
        self.wrote(stream)
        hit = self._saved.get(id(state))
        if (hit is None or hit[0]() is not state) and self._loaded(stream, state):
            return
        if hit is not None and hit[0]() is state:
            event = RngEvent(len(self.trace.calls), "load", stream, hit[1])
        else:
            # Kept as given: a copy made here would be an op, traced on meta.
            event = RngEvent(len(self.trace.calls), "load", stream, -1, state)
        self.trace.rng_events.append(event)


def _key(state: torch.Tensor) -> bytes:
    """A (contiguous, CPU) state's bytes, read without an op: the mode may be active.

    Torch functions are off while reading: called from a patched function in
    the traced code, ``data_ptr`` would otherwise reach the mode, which
    answers it for the real tensor's stand-in -- not these bytes (a state
    then matched a marker it is not, and replay drew other numbers)."""
    with _compat.no_torch_function():
        return ctypes.string_at(state.data_ptr(), state.numel())


def _refuse_computed(stream: str, state) -> None:
    """A state computed inside the traced code is a MetaTensor: no bytes to set or record."""
    if isinstance(state, torch.Tensor) and type(state) is not torch.Tensor:  # a MetaTensor
        raise UnsupportedFeatureError(
            f"torch.set_rng_state ({stream}) was given a tensor computed inside the traced code "
            "(a .clone() of what torch.get_rng_state returned, say): it holds no bytes while "
            "tracing, so the state eager restores cannot be recorded. Pass the tensor "
            "get_rng_state returned itself, or copy it outside the traced code"
        )


def start_states(trace) -> None:
    """Note the default generators' states a run starts from, once per trace."""
    if trace.rng_state is None:
        # The generator's own method: torch.get_rng_state may be patched by
        # an outer mode, which would record this read.
        trace.rng_state = torch.default_generator.get_state()
    if torch.cuda.is_initialized() and not trace.rng_cuda:
        # Only where a real CUDA already runs: initialising it here would
        # create a context the user did not ask for.
        for i, state in enumerate(_TORCH.get("cuda.get_rng_state_all", torch.cuda.get_rng_state_all)()):
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
    log = WIRING.current()
    if log is not None:
        _refuse_computed("cpu", new_state)
    _TORCH["set_rng_state"](new_state)
    if log is not None:
        log.load("cpu", new_state)


def _seed() -> int:
    out = _TORCH["seed"]()
    log = WIRING.current()
    if log is not None:
        log.seeded("cpu")
        for stream in log.trace.rng_cuda:
            log.seeded(stream)
    return out


def _manual_seed(seed):
    out = _TORCH["manual_seed"](seed)
    log = WIRING.current()
    if log is not None:
        log.load("cpu", _TORCH["get_rng_state"]())
        for stream in log.trace.rng_cuda:
            log.load(stream, _TORCH["cuda.get_rng_state"](stream))
    return out


_CUDA_BYTES = 16  # a CUDA generator's state: its seed and its Philox offset, 8 bytes each


def _cuda_get_rng_state(device="cuda") -> torch.Tensor:
    """Note [A logical GPU's generator state]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    On a host without CUDA a logical GPU has no generator: torch's
    ``get_rng_state`` raised "Torch not compiled with CUDA enabled" while
    ``torch.cuda.is_available()`` said True, so code that saves and restores
    the GPU's state around a block (``torch.random.fork_rng``, a trainer
    saving its RNG state) died.  What such code needs is Note [RNG state as
    slots]: which read a later write restores, not the bytes.  So the read
    returns a handle -- 16 zero bytes, a CUDA state's size -- recorded as a
    slot, and a write of it is "load that slot", which replay on a real GPU
    performs with the real states; a write of other bytes is recorded with
    them and sets nothing here.  The bytes are not the state a real GPU
    would report, and nothing in the trace draws from them: draws on a
    logical GPU's stream replay as made up (binding/streams.py).
    """
    if cuda_answers.without_generator():
        with _compat.no_python_dispatch(), _compat.no_torch_function():  # a real tensor, no op
            state = torch.zeros(_CUDA_BYTES, dtype=torch.uint8)
    else:
        state = _TORCH["cuda.get_rng_state"](device)
    log = WIRING.current()
    if log is not None:
        log.save(_cuda_stream(device), state)
    return state


def _cuda_set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    log = WIRING.current()
    if log is not None:
        _refuse_computed(_cuda_stream(device), new_state)
    if not cuda_answers.without_generator():  # Note [A logical GPU's generator state]
        _TORCH["cuda.set_rng_state"](new_state, device)
    if log is not None:
        log.load(_cuda_stream(device), new_state)


def _cuda_get_rng_state_all() -> list:
    return [_cuda_get_rng_state(i) for i in range(torch.cuda.device_count())]


def _cuda_set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        _cuda_set_rng_state(state, i)


def _cuda_written(name: str, every: bool):
    """torch.cuda's ``manual_seed``/``manual_seed_all``/``seed``/``seed_all``, recorded."""

    def written(*args):
        out = _TORCH[name](*args)
        log = WIRING.current()
        if log is not None and torch.cuda.is_initialized():
            streams = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if every else [_cuda_stream("cuda")]
            for stream in streams:
                if "seed" in name and "manual" not in name:
                    log.seeded(stream)
                else:
                    log.load(stream, _TORCH["cuda.get_rng_state"](stream))
        return out

    return written


def _patch(key: str, fn):
    def make(below):
        _TORCH[key] = below  # what the replacement records around
        return fn

    return make


_WHY = "the random streams, recorded (Note [RNG state as slots])"
# (owner, attribute, make, why): the ledger's rows (mode/ledger.py), claimed
# by a recording mode's thread.
PATCHES = [
    (mod, name, _patch(key, fn), _WHY)
    for mod, name, key, fn in [
        (torch, "get_rng_state", "get_rng_state", _get_rng_state),
        (torch, "set_rng_state", "set_rng_state", _set_rng_state),
        (torch, "manual_seed", "manual_seed", _manual_seed),
        (torch.random, "get_rng_state", "get_rng_state", _get_rng_state),
        (torch.random, "set_rng_state", "set_rng_state", _set_rng_state),
        (torch.random, "manual_seed", "manual_seed", _manual_seed),
        (torch.cuda, "get_rng_state", "cuda.get_rng_state", _cuda_get_rng_state),
        (torch.cuda, "set_rng_state", "cuda.set_rng_state", _cuda_set_rng_state),
        (torch.cuda, "get_rng_state_all", "cuda.get_rng_state_all", _cuda_get_rng_state_all),
        (torch.cuda, "set_rng_state_all", "cuda.set_rng_state_all", _cuda_set_rng_state_all),
        (torch.cuda, "manual_seed", "cuda.manual_seed", _cuda_written("cuda.manual_seed", every=False)),
        (torch.cuda, "manual_seed_all", "cuda.manual_seed_all", _cuda_written("cuda.manual_seed_all", every=True)),
        (torch.cuda, "seed", "cuda.seed", _cuda_written("cuda.seed", every=False)),
        (torch.cuda, "seed_all", "cuda.seed_all", _cuda_written("cuda.seed_all", every=True)),
        (torch, "seed", "seed", _seed),
        (torch.random, "seed", "seed", _seed),
    ]
]
