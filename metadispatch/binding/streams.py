"""Random streams in replay: draw exactly the numbers eager drew, or say not.

The trace records where eager's random numbers came from (``ir/rng.py``):
the default generators' start states, each explicit generator's state at
its first use, and the state reads and writes torch utilities made between
calls (Note [RNG state as slots] in ``core/rngstate.py``).  :class:`Streams`
sets replay's generators to those states and performs the reads and writes
at the same points, so a replayed dropout -- recomputed by checkpointing or
not -- draws eager's mask, with no seed to pass.

Where that cannot hold, the stream is *made up*: it is drawn from ``seed``
and listed in ``made_up`` with the first call that reads it, like a leaf
filled without data.  That happens when

* the trace holds no state for a stream (a file from an older version, a
  CUDA generator traced where no real CUDA ran);
* the replay device's generator is not the traced device's: a trace for
  ``cuda`` replayed on CPU draws from CPU's Mersenne Twister, not CUDA's
  Philox, and nothing here can compute Philox's numbers on a CPU.

Replay starts inside ``torch.random.fork_rng``: the caller's generators are
as they were afterwards; explicit generators are fresh objects.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Streams", "MadeUp", "stream_of"]


class MadeUp(NamedTuple):
    """A leaf or random stream replay filled without the user's data."""

    name: str  # "arg args[0]", "param fc.weight", "cpu generator"
    call: int | None  # the first call that reads it
    why: str

    def __str__(self) -> str:
        at = f" (first read by call #{self.call})" if self.call is not None else ""
        return f"{self.name}{at}: {self.why}"


_LOST = {
    "seed": "reseeded from the operating system (torch.seed()) by the traced code: "
    "eager draws other numbers on every run",
}


def stream_of(device: torch.device) -> str:
    """The default generator a tensor on ``device`` draws from: ``cpu``, ``cuda:0``."""
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


class Streams:
    """Replay's generators for one run of ``prog`` on ``device``."""

    def __init__(self, trace, prog, device: torch.device, seed: int) -> None:
        self.trace = trace
        self.device = device
        self.seed = seed
        self.made_up: list = []
        self.slots: dict = {}
        self._here = stream_of(device)
        for stream, call in prog.default_draws.items():
            why = self._why_not(stream)
            if why:
                self.made_up.append(MadeUp(f"{stream} generator", call, why))
        self.gens = {k: self._generator(k, call) for k, call in prog.generator_uses.items()}
        self.made_up += [
            MadeUp(f"{e.stream} generator" if not e.stream.startswith("generator") else e.stream, e.at, _LOST[e.action])
            for e in trace.rng_events
            if e.action in _LOST
        ]

    def _start_state(self, stream: str):
        return self.trace.rng_state if stream == "cpu" else self.trace.rng_cuda.get(stream)

    def _why_not(self, stream: str) -> str:
        if stream.partition(":")[0] != self.device.type:
            return (
                f"the trace drew from the {stream} generator; {self._here}'s draws "
                f"other numbers, so random values differ from eager on {stream}"
            )
        if self._start_state(stream) is None:
            return "the trace holds no start state for it; drawn from seed"
        return ""

    def _generator(self, k: int, call: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        recorded = self.trace.generators[k] if 0 <= k < len(self.trace.generators) else None
        why = (
            "the trace holds no state for it (written before generators were recorded)"
            if recorded is None or recorded[1] is None
            else f"it was a {recorded[0]} generator, replay draws on {self.device}"
            if torch.device(recorded[0]).type != self.device.type
            else ""
        )
        if why:
            self.made_up.append(MadeUp(f"generator {k}" if k >= 0 else "generator", call, why))
            return gen.manual_seed(self.seed)
        assert recorded is not None  # why is empty only with a recorded state
        return gen.set_state(recorded[1])

    def start(self) -> None:
        """Set the default generators to the trace's start states (or ``seed``)."""
        cpu = self.trace.rng_state
        if cpu is not None:
            torch.set_rng_state(cpu)
        else:
            # Only the generators this replay uses: torch.manual_seed also
            # queues seeds for every lazy backend, at a stack capture each.
            torch.default_generator.manual_seed(self.seed)
        if self.device.type == "cuda":
            state = self._start_state(self._here)
            if state is not None:
                torch.cuda.set_rng_state(state, self.device)
            else:
                torch.cuda.manual_seed(self.seed)

    def event(self, i: int) -> None:
        """Perform the trace's ``i``-th state read or write (execution/program.py calls this)."""
        e = self.trace.rng_events[i]
        if e.action in _LOST:
            return  # listed in made_up: the stream goes on from whatever it holds
        if e.stream.startswith("generator "):
            gen = self.gens.get(int(e.stream.split()[1]))
            state = e.state if e.state is not None else self.slots.get(e.slot)
            if gen is not None and state is not None and gen.device.type == state.device.type:
                gen.set_state(state)
            return
        if e.stream == "cpu":
            get, put = torch.get_rng_state, torch.set_rng_state
        elif e.stream.partition(":")[0] == self.device.type == "cuda":
            get = lambda: torch.cuda.get_rng_state(self.device)  # noqa: E731
            put = lambda s: torch.cuda.set_rng_state(s, self.device)  # type: ignore[assignment]  # noqa: E731
        else:
            return  # a generator this replay does not draw from
        if e.action == "save":
            self.slots[e.slot] = get()
        else:
            put(e.state if e.state is not None else self.slots[e.slot])
