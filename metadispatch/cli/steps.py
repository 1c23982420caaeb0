"""The training step the command line traces: forward and backward, an optimizer, and which step.

A one-step trace of a training step sees the optimizer make its state
inside the step -- AdamW's two float copies of the parameters appear in
``opt.step()``, after the forward and backward ran without them -- so it
answers "fits" where every later step runs out.  The command line traces a
warmed step by default: ``--steps 2`` (the second, steady-state step, the
first run and cut away: ``md.tracer(warmup=1)``) with ``--optimizer
adamw``; ``--optimizer none`` and ``--steps 1`` give the bare first step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["OPTIMIZERS", "with_optimizer", "with_built_optimizer", "describe"]

# What training scripts write, torch's defaults otherwise (foreach where torch picks it).
OPTIMIZERS: dict[str, Callable | None] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "none": None,
}
TITLES = {"adamw": "AdamW", "sgd": "SGD with momentum", "adafactor": "Adafactor"}


def with_optimizer(step: Callable, name: str) -> Callable:
    """``step(model, *inputs)`` followed by ``opt.step(); opt.zero_grad()``.

    The optimizer is made on the first call, on the parameters the traced
    step sees (the stand-ins), and kept for the later ones, as a training
    loop keeps it: its state made in step 1 is the state step 2 carries.
    """
    make = OPTIMIZERS[name]
    if make is None:
        return step
    made: list = []

    def run(model, *inputs):
        out = step(model, *inputs)
        if not made:
            made.append(make([p for p in model.parameters() if p.requires_grad]))
        made[0].step()
        made[0].zero_grad()
        return out

    return run


def with_built_optimizer(step: Callable, name: str, model) -> Callable:
    """``step(model, *inputs)`` followed by ``opt.step(); opt.zero_grad()`` with an optimizer made now.

    The same step for every batch of ``model``, as ``md.max_batch`` shares a
    warm-up between two batches of one model (Note [One warm-up for two
    batches] in planning/batch.py): an optimizer made before the trace steps
    on the stand-ins and is put back as it was after each trace.
    """
    make = OPTIMIZERS[name]
    if make is None:
        return step
    opt = make([p for p in model.parameters() if p.requires_grad])

    def run(model, *inputs):
        out = step(model, *inputs)
        opt.step()
        opt.zero_grad()
        return out

    return run


def describe(name: str, steps: int) -> str:
    """``AdamW, step 2 of 2 (the steady state)`` for the header line."""
    which = f"step {steps} of {steps}" + (" (the steady state)" if steps > 1 else " (the first: no warmup)")
    return f"{TITLES[name]}, {which}" if name in TITLES else which
