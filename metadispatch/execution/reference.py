"""The reference loop: replay written plainly, the specification the generated program is tested against.

Note [The reference loop]
~~~~~~~~~~~~~~~~~~~~~~~~~
``program.py`` writes each trace out as straight-line Python, for speed
(Note [Freeing early], Note [Calling ops through their Python bindings] in
bindings.py).  This is the same walk, interpreted, as micrograd and jax's
``eval_jaxpr`` read: bind each id to a real tensor, call each recorded op on
them, check what it returned.  It calls every op as its recorded overload,
frees nothing and has no fences, so ``tests/execution/test_program.py`` can hold the
generated program to it: the same tensors, bit for bit, and the same
mismatches, on the zoo's traces.  It takes the program's own ``run``
arguments (``Program``'s docstring), so the rest of replay -- binding,
random streams, checks, the write guard -- is shared.
"""

from __future__ import annotations

import torch

from ..binding.devices import CPU
from ..binding.writes import written_args
from ..ir.decode import is_marker
from ..ir.records import TensorMeta
from ..ir.rng import GeneratorRef, is_generator
from .collectives import collective_callable, is_collective

__all__ = ["reference_run"]


def reference_run(calls: list, device: torch.device, keep_cpu: bool, groups: dict, events=()):
    """A ``run(env, gens, ck, chk, same, wr, rng, fit, pre)`` that interprets ``calls``."""
    before: dict = {}  # call position -> the RNG events just before it
    for i, e in enumerate(events):
        before.setdefault(min(e.at, len(calls)), []).append(i)

    def run(env, gens, ck, chk, same, wr, rng, fit, pre):
        def value(a):
            if isinstance(a, TensorMeta):
                return env[a.id]
            if type(a) is tuple and any(isinstance(x, TensorMeta) for x in a):
                return [value(x) for x in a]
            if isinstance(a, torch.device):  # Note [Devices in replay] in binding/devices.py
                return CPU if keep_cpu and a.type == "cpu" else device
            if is_generator(a):
                return gens[int(a.index) if type(a) is GeneratorRef else -1]
            return a

        grad = False  # replay starts under no_grad (Note [Grad mode in replay] in program.py)
        for n, call in enumerate(calls):
            if (call.phase == "forward") != grad:
                grad = not grad
                torch.set_grad_enabled(grad)
            for i in before.get(n, ()):
                rng(i)
            if is_marker(call.func):
                continue
            written = written_args(call)
            if written:
                wr(n, *(env[m.id] for m in written))
            op = collective_callable(call.func, groups) if is_collective(call.func) else call.func
            out = op(*[value(a) for a in call.args], **{k: value(v) for k, v in call.kwargs.items()})
            results = out if len(call.outputs) > 1 else (out,)
            for o, r in zip(call.outputs, results):
                for m, t in zip(o, r) if type(o) is tuple else ((o, r),):
                    if type(m) is TensorMeta:
                        env[m.id] = t
            if ck and call.outputs:
                chk(n, results)
        for i in before.get(len(calls), ()):
            rng(i)

    return run
