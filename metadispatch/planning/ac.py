"""``md.plan_ac``: which submodules to checkpoint so that a step fits a memory budget.

Requirements: module-level activation checkpointing as users write it
(``torch.utils.checkpoint`` around a block's forward, what
``checkpoint_wrapper`` does); a plan whose predicted peak is the peak of
the checkpointed step re-traced, never above the budget; a lower budget
never gives a higher peak (torch's ``activation_memory_budget`` is not
monotone in its budget); the least recomputation among the plans
considered, reported in FLOPs; optionally selective checkpointing, which
saves the outputs of chosen ops (matmuls, attention) and recomputes the
rest, as torchtitan's "selective op" AC does.

Note [Checkpointing plans nested by construction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The candidates (default: the blocks of the model's largest
``nn.ModuleList``) are ordered once, most activation bytes saved per
forward FLOP recomputed first, from a trace without checkpointing; plan
``k`` checkpoints the first ``k``.  Each plan ``k = 0..n`` is applied to a
fresh model and traced, so its peak is a traced figure, not an estimate.
The chain is the traced plans' frontier: by recomputation, least first
(FLOPs, then calls: selective checkpointing recomputes calls of no FLOPs),
each kept only where its peak is below that of every plan recomputing no
more (a tie in both keeps the lower peak).  Along the chain the
peak falls strictly as the recomputation grows, and the plan for a budget
is the first of the chain that fits: the least recomputation of any traced
plan that fits, since a plan left out is matched or beaten on both by one
kept.  It is monotone by construction, whatever the model does: a lower
budget fits fewer plans; if the plan it had fits still, it stays, and if
not, its new plan is under the new budget, which is below the old plan's
peak.  Limits: nested prefixes of one order, not every subset (``2**n``
plans).

With ``selective=True`` (or rungs of op lists of one's own) each block
also climbs a ladder: checkpointed saving the outputs of matmuls and
attention (``SAVE_MATMULS_AND_ATTENTION``: recomputing only the pointwise
ops between them, no FLOPs as ``FlopCounterMode`` counts them), then saving
attention only (``SAVE_ATTENTION``), then fully; every block at the first
rung in the order above, then every block at the second, and so on, each
step a traced plan.  Those plans join the prefixes above in one frontier,
so selective checkpointing never recomputes more than whole blocks for a
budget (the ViT of the tests peaks lowest with three whole blocks; the
ladder's plans that low checkpoint all four).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._compat import OpOverload, OpOverloadPacket
from ..analysis.flops import call_flops, flops
from ..analysis.memory import memory
from ..errors import MetaDispatchError
from ..ir.text import fmt_bytes
from ..tracing.tracer import tracer

__all__ = ["ACPlan", "plan_ac", "apply_ac", "remove_ac", "blocks", "SAVE_MATMULS_AND_ATTENTION", "SAVE_ATTENTION"]

# Ops whose outputs selective checkpointing keeps (packet names): the FLOPs-heavy ones
SAVE_ATTENTION = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
)
SAVE_MATMULS_AND_ATTENTION = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", *SAVE_ATTENTION)


class ACPlan:
    """Which modules to checkpoint (``modules``, qualified names) and how
    (``save``: the ops whose outputs each keeps under selective
    checkpointing, packet names; a module not in it is checkpointed fully),
    the step's ``peak`` with them (bytes, ``md.memory``'s, re-traced), the
    ``recompute`` FLOPs the checkpointed forwards cost again in backward,
    the ``budget`` and whether the plan meets it (``fits``);
    ``recompute_calls`` counts the calls recomputed, FLOPs or not; ``chain``
    is the search's frontier of plans as ``(modules, peak, recompute, save,
    recompute_calls)``."""

    def __init__(
        self, modules: tuple, peak: int, recompute: int, save: dict, calls: int, *, budget: int, chain: list
    ) -> None:
        self.modules, self.peak, self.recompute, self.budget = modules, peak, recompute, budget
        self.save, self.recompute_calls = dict(save), calls
        self.fits = peak <= budget
        self.chain = chain

    def at(self, budget: int) -> ACPlan:
        """The plan of the same search for another budget (a sweep of budgets costs one search)."""
        return ACPlan(*next((p for p in self.chain if p[1] <= budget), self.chain[-1]), budget=budget, chain=self.chain)

    def __repr__(self) -> str:
        return f"<ACPlan {len(self.modules)} modules, peak {fmt_bytes(self.peak)}>"

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        names = ", ".join(f"{n} ({_saving(self.save[n])})" if n in self.save else n for n in self.modules)
        names = names or "nothing"
        return (
            f"checkpoint {names}: peak {fmt_bytes(self.peak)} ({self.peak:,} B), {verdict} the budget "
            f"{fmt_bytes(self.budget)}; recomputes {self.recompute:.3g} FLOPs in {self.recompute_calls} calls"
        )


def _saving(save: tuple) -> str:
    """How a selectively checkpointed module is printed: its rung by name where it is one of ours."""
    named = {frozenset(SAVE_MATMULS_AND_ATTENTION): "matmuls and attention", frozenset(SAVE_ATTENTION): "attention"}
    return "selective, saving " + named.get(frozenset(save), ", ".join(save))


def blocks(model: nn.Module) -> list[str]:
    """The qualified names of the children of the model's largest ``nn.ModuleList`` (its blocks)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise MetaDispatchError("plan_ac: the model has no nn.ModuleList of blocks; pass candidates=[names]")
    name, best = max(lists, key=lambda x: len(x[1]))
    return [f"{name}.{i}" if name else str(i) for i in range(len(best))]


def apply_ac(model: nn.Module, plan) -> nn.Module:
    """Checkpoint the modules ``plan`` names in place; returns ``model``.

    ``plan`` is an :class:`ACPlan`, names, or a dict of names to the ops
    (packet names such as ``"aten.mm"``, or ops) whose outputs selective
    checkpointing keeps (empty: checkpointed fully).  Each module's forward
    runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
    as ``checkpoint_wrapper`` runs it, with ``context_fn`` from
    ``create_selective_checkpoint_contexts`` where ops are saved; its name,
    parameters and ``state_dict`` keys stay as they were.
    """
    if isinstance(plan, ACPlan):
        how = {name: plan.save.get(name, ()) for name in plan.modules}
    elif isinstance(plan, dict):
        how = plan
    else:
        how = {name: () for name in plan}
    for name, save in how.items():
        m = model.get_submodule(name)
        if not is_checkpointed(m):  # once; an instance's own forward (accelerate's hooks) is checkpointed too
            wrapped = functools.partial(_checkpointed, m.forward, _op_names(save))
            wrapped.own = m.__dict__.get("forward", _NONE)  # type: ignore[attr-defined]  # what remove_ac restores
            m.forward = wrapped
    return model


def remove_ac(model: nn.Module, plan) -> nn.Module:
    """Undo :func:`apply_ac` in place; returns ``model``.

    ``plan`` is what ``apply_ac`` was given (an :class:`ACPlan`, names, or a
    dict keyed by names).  Each named module gets back exactly the forward
    it had -- its own instance ``forward`` (accelerate's hooks set one) or
    none (the class's); a module not checkpointed is left as it is.
    """
    names = plan.modules if isinstance(plan, ACPlan) else plan
    for name in names:
        m = model.get_submodule(name)
        if is_checkpointed(m):
            own = m.__dict__["forward"].own
            if own is _NONE:
                del m.forward
            else:
                m.forward = own
    return model


_NONE = object()  # a module without an instance forward of its own


def is_checkpointed(m: nn.Module) -> bool:
    """Whether :func:`apply_ac` wrapped ``m``'s forward."""
    f = m.__dict__.get("forward")
    return isinstance(f, functools.partial) and f.func is _checkpointed


def _checkpointed(forward, save: frozenset, *args, **kwargs):
    if save:  # Note [Selective checkpointing under the mode]
        context = functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, save))
        kwargs["context_fn"] = context
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _policy(save: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Note [Selective checkpointing under the mode]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    torch's selective checkpointing runs the checkpointed forward under a
    ``TorchDispatchMode`` of its own that stores the outputs of the ops the
    policy saves, and the recompute under another that hands them back in
    place of running the op.  Both sit above ``MetaMode`` on the mode stack,
    so every op still reaches the mode once in forward, and in backward only
    those recomputed do: a saved op is neither recorded nor counted again.
    The stored outputs are the mode's tensors, live until backward consumes
    them -- the memory selective checkpointing costs, which the trace counts
    as a real run does (tests/planning/test_plan_ac.py, against
    ``md.LiveStorages`` on the CPU).  A model that changes state between
    forward and backward (a KV cache filled in forward) fails in torch's
    recompute, as it would without the mode: ``use_cache=False``.
    """
    return CheckpointPolicy.MUST_SAVE if str(op.overloadpacket) in save else CheckpointPolicy.PREFER_RECOMPUTE


def _op_names(ops) -> frozenset:
    """Packet names (``"aten.mm"``) of ops given as names, ``OpOverload`` or ``OpOverloadPacket``."""
    names = set()
    for op in ops:
        if isinstance(op, OpOverload):
            op = op.overloadpacket
        if not isinstance(op, (str, OpOverloadPacket)):
            raise MetaDispatchError(f"apply_ac: {op!r} is not an op (give a name such as 'aten.mm', or the op)")
        names.add(str(op))
    return frozenset(names)


def plan_ac(make_model_and_step: Callable, budget: int, *, candidates=None, selective=False, **options) -> ACPlan:
    """The plan that fits ``budget`` bytes with the least recomputation (Note [Checkpointing plans nested by construction]).

    ``make_model_and_step()`` returns ``(model, step, args)``: a fresh
    model and a step that runs it (``step(*args)``); ``options`` go to
    ``md.tracer`` (``device``, ``gpu``, ``warmup``, ...).  ``selective=True``
    plans selective checkpointing before full checkpointing of a block
    (saving ``SAVE_MATMULS_AND_ATTENTION``, then ``SAVE_ATTENTION``), or
    give the rungs: a sequence of op lists, each saving fewer.  A budget no
    plan meets gives the lowest-peak plan, with ``fits`` False.

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
    chain = _chain(make_model_and_step, candidates, _ladder(selective), options)
    return ACPlan(*chain[0], budget=1 << 62, chain=chain).at(budget)


def _ladder(selective) -> list:
    """The rungs of selective checkpointing, as op-name sets, before the last: checkpointed fully."""
    if selective is False or selective is None:
        return []
    rungs = (SAVE_MATMULS_AND_ATTENTION, SAVE_ATTENTION) if selective is True else selective
    if isinstance(rungs, str) or not all(isinstance(r, (list, tuple, set, frozenset)) and r for r in rungs):
        raise MetaDispatchError(f"plan_ac: selective={selective!r}: True, or a sequence of non-empty op lists")
    return [_op_names(r) for r in rungs]


def _traced(make: Callable, how: dict, options: dict):
    model, step, args = make()
    apply_ac(model, how)
    trace = tracer(**options)(step, *args)
    return memory(trace).peak, flops(trace).total, trace, model


def _chain(make: Callable, candidates, ladder: list, options: dict) -> list:
    """The frontier of the traced plans, each ``(modules, peak, recomputed FLOPs, save)``.

    Note [Recomputed FLOPs]
    ~~~~~~~~~~~~~~~~~~~~~~~
    What a plan's step costs more than the step without checkpointing, in
    FLOPs of the two traces: the forwards run again in backward, up to what
    backward needs (non-reentrant checkpoint stops early), less what
    selective checkpointing hands back saved.  Not the calls the recorder
    notes ``recompute``: its test of the stack misses some, as it missed the
    first of two checkpointed LLaMA blocks.
    """
    peak, base, trace, model = _traced(make, {}, options)
    calls = len(trace.calls)
    names = list(candidates) if candidates is not None else blocks(model)
    order = sorted(names, key=lambda n: -_saved_per_flop(trace, n))  # stable: forward order on ties
    plans: list[tuple[tuple, int, int, dict, int]] = [((), peak, 0, {}, 0)]
    steps: list[list] = [[(name, frozenset()) for name in order[:k]] for k in range(1, len(order) + 1)]  # whole blocks
    how: dict = {}  # module -> the ops it saves (empty: fully), in the order they were first checkpointed
    for rung in [*ladder, frozenset()] if ladder else []:
        for name in order:
            how[name] = rung
            steps.append(list(how.items()))
    for step in steps:
        peak, total, again, _ = _traced(make, dict(step), options)
        save = {n: tuple(sorted(r)) for n, r in step if r}
        plans.append((tuple(n for n, _ in step), peak, total - base, save, len(again.calls) - calls))
    chain: list = []
    for plan in sorted(plans, key=lambda p: (p[2], p[4], p[1])):  # the frontier (the Note)
        if not chain or plan[1] < chain[-1][1]:
            chain.append(plan)
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
