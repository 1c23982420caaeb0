"""``md.plan_ac``: which submodules to checkpoint so that a step fits a memory budget.

Requirements: module-level activation checkpointing as users write it
(``torch.utils.checkpoint`` around a block's forward, what
``checkpoint_wrapper`` does); a plan whose predicted peak is the peak of
the checkpointed step re-traced, never above the budget; a lower budget
never gives a higher peak (torch's ``activation_memory_budget`` is not
monotone in its budget); the least recomputation among the plans
considered, reported in FLOPs.

Note [Checkpointing plans nested by construction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The candidates (default: the blocks of the model's largest
``nn.ModuleList``) are ordered once, most activation bytes saved per
forward FLOP recomputed first, from a trace without checkpointing; plan
``k`` checkpoints the first ``k``.  Each plan ``k = 0..n`` is applied to a
fresh model and traced, so its peak is a traced figure, not an estimate.
Only the plans whose peak is below every smaller plan's are kept: along
that chain the peak falls strictly as ``k`` grows, and the plan for a
budget is the smallest ``k`` of the chain that fits.  A lower budget can
only move to a larger ``k`` of the chain, so its peak is lower or equal:
monotone by construction, whatever the model does.  Limits: nested prefixes
of one order, not every subset (``2**n`` plans); selective checkpointing of
single ops is not planned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ..analysis.flops import call_flops, flops
from ..analysis.memory import memory
from ..errors import MetaDispatchError
from ..ir.text import fmt_bytes
from ..tracing.tracer import tracer

__all__ = ["ACPlan", "plan_ac", "apply_ac", "blocks"]


class ACPlan:
    """Which modules to checkpoint (``modules``, qualified names), the step's
    ``peak`` with them (bytes, ``md.memory``'s, re-traced), the ``recompute``
    FLOPs the checkpointed forwards cost again in backward, the ``budget``
    and whether the plan meets it (``fits``); ``chain`` is every plan of the
    search as ``(modules, peak, recompute)``."""

    def __init__(self, modules: tuple, peak: int, recompute: int, budget: int, chain: list) -> None:
        self.modules, self.peak, self.recompute, self.budget = modules, peak, recompute, budget
        self.fits = peak <= budget
        self.chain = chain

    def __repr__(self) -> str:
        return f"<ACPlan {len(self.modules)} modules, peak {fmt_bytes(self.peak)}>"

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        names = ", ".join(self.modules) or "nothing"
        return (
            f"checkpoint {names}: peak {fmt_bytes(self.peak)} ({self.peak:,} B), {verdict} the budget "
            f"{fmt_bytes(self.budget)}; recomputes {self.recompute:.3g} FLOPs"
        )


def blocks(model: nn.Module) -> list[str]:
    """The qualified names of the children of the model's largest ``nn.ModuleList`` (its blocks)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise MetaDispatchError("plan_ac: the model has no nn.ModuleList of blocks; pass candidates=[names]")
    name, best = max(lists, key=lambda x: len(x[1]))
    return [f"{name}.{i}" if name else str(i) for i in range(len(best))]


def apply_ac(model: nn.Module, plan) -> nn.Module:
    """Checkpoint the modules ``plan`` names (an :class:`ACPlan` or names) in place; returns ``model``.

    Each module's forward runs under ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``, as ``checkpoint_wrapper`` runs it; its name,
    parameters and ``state_dict`` keys stay as they were.
    """
    names = plan.modules if isinstance(plan, ACPlan) else tuple(plan)
    for name in names:
        m = model.get_submodule(name)
        if "forward" not in m.__dict__:  # once
            m.forward = functools.partial(_checkpointed, m.forward)
    return model


def _checkpointed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def plan_ac(make_model_and_step: Callable, budget: int, *, candidates=None, **options) -> ACPlan:
    """The plan that fits ``budget`` bytes with the least recomputation (Note [Checkpointing plans nested by construction]).

    ``make_model_and_step()`` returns ``(model, step, args)``: a fresh
    model and a step that runs it (``step(*args)``); ``options`` go to
    ``md.tracer`` (``device``, ``gpu``, ``warmup``, ...).  A budget no plan
    meets gives the lowest-peak plan, with ``fits`` False.

    >>> import torch, metadispatch as md
    >>> def make():
    ...     model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)])
    ...     model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList(model)})
    ...     def step(x):
    ...         for block in model["layers"]:
    ...             x = block(x)
    ...         x.sum().backward()
    ...     return model, step, (torch.ones(512, 64),)
    >>> chain = md.plan_ac(make, budget=10**9).chain
    >>> plan = md.plan_ac(make, budget=chain[-1][1])
    >>> plan.modules, plan.fits, plan.recompute > 0
    (('layers.0', 'layers.1', 'layers.2'), True, True)
    """
    chain = _chain(make_model_and_step, candidates, options)
    for modules, peak, recompute in chain:
        if peak <= budget:
            return ACPlan(modules, peak, recompute, budget, chain)
    modules, peak, recompute = chain[-1]
    return ACPlan(modules, peak, recompute, budget, chain)


def _traced(make: Callable, modules: tuple, options: dict):
    model, step, args = make()
    apply_ac(model, modules)
    trace = tracer(**options)(step, *args)
    return memory(trace).peak, flops(trace).total, trace, model


def _chain(make: Callable, candidates, options: dict) -> list:
    """The chain of plans, each ``(modules, peak, recomputed FLOPs)``.

    Note [Recomputed FLOPs]
    ~~~~~~~~~~~~~~~~~~~~~~~
    What a plan's step costs more than the step without checkpointing, in
    FLOPs of the two traces: the forwards run again in backward, up to what
    backward needs (non-reentrant checkpoint stops early).  Not the calls
    the recorder notes ``recompute``: its test of the stack misses some, as
    it missed the first of two checkpointed LLaMA blocks.
    """
    peak, base, trace, model = _traced(make, (), options)
    names = list(candidates) if candidates is not None else blocks(model)
    order = sorted(names, key=lambda n: -_saved_per_flop(trace, n))  # stable: forward order on ties
    chain: list[tuple[tuple, int, int]] = [((), peak, 0)]
    for k in range(1, len(order) + 1):
        modules = tuple(order[:k])
        peak, total, _, _ = _traced(make, modules, options)
        if peak < chain[-1][1]:  # only plans that lower the peak (the Note)
            chain.append((modules, peak, total - base))
    return chain


def _saved_per_flop(trace, name: str) -> float:
    """Bytes a module's forward makes per FLOP it costs: what checkpointing it frees per FLOP recomputed."""
    inside = [c for c in trace.calls if c.phase == "forward" and (c.module == name or c.module.startswith(name + "."))]
    made = sum(m.dtype.itemsize * _numel(m.shape) for c in inside for m in c.output_metas)
    return made / max(1, sum(call_flops(c) or 0 for c in inside))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
