"""The rank programs ``md.plan`` scores: one mesh's configurations built, wrapped and stepped in one mode.

Requirements: the wrapping is a script's (TP on each block, then FSDP2 on
each block and the root; the blocks are the children of the largest
``nn.ModuleList``, ``md.plan_ac``'s), written with torch's own
``parallelize_module`` and ``fully_shard``; each configuration comes back
as the trace of its own steady-state step, marks ``built``, ``step``,
``micro`` (the last micro-batch) and ``opt``, as a direct trace of it
would be.

Note [One build for the configurations of a mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Configurations that differ only in micro-batch (and so in accumulation),
in per-block AC and in the optimizer run one model, wrapped once: the same
parameter shards, and after an optimizer step and ``zero_grad`` the same
state -- parameters, the optimizer's moments and step count, no gradients.
So they are traced in one mode: the model is built and wrapped once; for
each optimizer, one warmup step runs at its first configuration's
micro-batch and AC, then each configuration's step in turn (AC is switched
on or off between steps: ``apply_ac`` sets the blocks' ``forward``, which
FSDP2's and TP's hooks around ``__call__`` do not touch, so it wraps the
same calls before the wrapping or after), and each is cut out
(``step_until`` its end, then ``step_from`` its start) as the trace of its
own steady state.  The next optimizer starts once the last one and its
state are freed.  What the step of another micro-batch or AC left alive
is what a warmup of its own would have left, so each cut gives the peak,
reserved peak and time of a direct trace of that configuration
(tests/planning/test_plan.py against ``md.tracer`` traces written with
torch's own APIs, AC applied before the wrapping: within 1 KiB, reserved
exactly).  A build, FSDP2's and TP's wrapping (``fully_shard``'s parameter
setup is a quarter of a shallow trace), a warmup step and DTensor's
first sharding propagation of each op (half a second for each foreach op
of AdamW over TP's 2-d shards on LLaMA-7B) are paid once a mesh instead of
once a configuration.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch

from ..errors import MetaDispatchError
from ..ir.cut import Scan, step_until
from ..mode.mode import MetaMode
from ..tracing.marks import mark
from ..values.routing import RoutingAssumption
from . import parallel_dims
from .ac import apply_ac, blocks, remove_ac
from .tp import tp_plan as serving_tp_plan

__all__ = ["default_step", "tp_plan", "trace_programs"]


def trace_programs(
    make_model: Callable,
    cs: list,
    gpus: int,
    gpu,
    seq: int,
    step: Callable,
    vocab: int | None,
    layers=None,
    first: str | None = None,
) -> list:
    """Rank 0's trace for each of ``cs`` (configurations of one mesh; Note [One build for the configurations
    of a mesh]), the model built ``layers`` blocks deep (None: ``make_model()``).  An entry is the exception
    where that configuration's step raised one (RuntimeError, MetaDispatchError), and None for those after
    it in its build (not traced: trace them in another).  ``first``: the optimizer whose configurations are traced
    in full; each other one's is its optimizer step alone (Note [One optimizer step per mesh] in train.py)."""
    head = cs[0]
    groups: dict = {}  # optimizer -> its configurations, in the order given
    for c in cs:
        groups.setdefault(c["optimizer"], []).append(c)
    if first is not None:  # its configurations first: the others' optimizer steps run on their gradients
        groups = dict(sorted(groups.items(), key=lambda kv: kv[0] != first))
    traced: dict = {}  # id of a configuration -> its step's number in the build, or what it raised
    # EP's dispatch reads routing counts another rank sends: declared uniform (values/routing.py)
    routing = RoutingAssumption("uniform") if head.get("ep", 1) > 1 else None
    with MetaMode(device="cuda", gpu=gpu, world_size=gpus, rank=0, assume=routing) as mode:
        model = make_model() if layers is None else make_model(layers=layers)
        names = blocks(model)
        units = [model.get_submodule(name) for name in names]
        meshes = parallel_dims.wrap(model, head, units, tp_plan)  # TP (SP), EP, FSDP2 on (replicate, shard x cp)
        tokens = vocab if vocab is not None else vocab_of(model)
        mark("built")
        n = 0
        for name, group in groups.items():
            at = group[0]  # what raised: this optimizer's first configuration, until a step is begun
            try:
                opt_kw: dict = {"fused": True} if name == "fused" else {"foreach": True}
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, **opt_kw)
                if first is not None and name != first and n:  # its optimizer step alone
                    n += 1
                    _optimizer_alone(model, names, opt, group[0], meshes, step, tokens, seq, n)
                    traced.update((id(c), n) for c in group)
                else:
                    for c in [None, *group]:  # the warmup (at the first's micro-batch and AC), then each step
                        at = c or group[0]
                        _set_ac(model, names, at["ac"] == "block")
                        accum = min(at["accum"], 2) if at["accum"] else 1  # Note [Tracing once per shape class]
                        ids = torch.randint(0, tokens, (at["micro_batch"], seq), device="cuda")
                        n += 1
                        traced[id(at)] = n
                        mark(f"step {n}")
                        for i in range(accum):
                            if i == accum - 1:
                                mark(f"micro {n}")
                            with parallel_dims.micro_step(at, meshes, ids):  # CP shards ids on the sequence
                                step(model, ids)
                        mark(f"opt {n}")
                        opt.step()
                        opt.zero_grad()
                        mark(f"end {n}")
                        del ids
                _drop(opt)  # its state dies here, before the next optimizer's warmup
                del opt
            except (RuntimeError, MetaDispatchError) as e:  # torch or metadispatch refusing this step
                traced[id(at)] = e
                break
    whole, out = mode.trace, []
    scan = Scan(whole.calls)  # each cut's calls before it, scanned once for the build (ir/cut.py)
    for c in cs:
        k = traced.get(id(c))
        if not isinstance(k, int):
            out.append(k)
            continue
        one = step_until(whole, whole.marks[f"end {k}"])
        one.marks = {"built": whole.marks["built"]} | {m: whole.marks[f"{m} {k}"] for m in ("step", "micro", "opt")}
        one.assumptions = _own_assumptions(whole, k)
        one.scan = scan  # type: ignore[attr-defined]  # step_from(one, its step's start, one.scan)
        out.append(one)
    return out


def _own_assumptions(whole, k: int) -> list:
    """Note [Each configuration's own assumptions]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A cut ends at step ``k`` but begins at the build: the warmup and the steps
    of the other configurations of the build ran before it, and their declared
    values (EP's routing counts and split sizes, read at their micro-batch) are
    not this configuration's.  So a cut lists the build's assumptions and its
    own step's, those the scored step (``since="step"``) rests on; a warmup's
    would be the step's own again, where it ran at this configuration at all.
    A configuration traced alone (``.retrace()``) lists the same
    (tests/planning/test_plan_own.py).
    """
    built, lo, hi = whole.marks["built"], whole.marks[f"step {k}"], whole.marks[f"end {k}"]
    return [a for a in whole.assumptions if a.index < built or lo <= a.index < hi]


def _optimizer_alone(model, names: list, opt, at: dict, meshes, step: Callable, tokens: int, seq: int, n: int):
    """Step ``n``: one micro-batch of ``at`` (marks ``step`` and ``micro``), then ``opt``'s steady-state optimizer
    step (mark ``opt``), after a warmup of one micro-batch and ``opt.step()`` making its state.

    The optimizer step's calls read the shapes of the parameters, gradients and state -- the mesh's, not the
    batch's or the AC's -- and it starts from the bytes a backward leaves, as in a step of its own, with the
    micro-batch's kernel workspaces (cuBLAS's: a cut of the optimizer step alone counted 64 MiB fewer on LLaMA-7B).
    """
    _set_ac(model, names, at["ac"] == "block")
    for scored in (False, True):
        ids = torch.randint(0, tokens, (at["micro_batch"], seq), device="cuda")
        for m in ("step", "micro") if scored else ():
            mark(f"{m} {n}")
        with parallel_dims.micro_step(at, meshes, ids):
            step(model, ids)
        if scored:
            mark(f"opt {n}")
        opt.step()
        opt.zero_grad()
    mark(f"end {n}")


def _drop(opt) -> None:
    """Free ``opt``'s state now, before the next optimizer's warmup: its tensors die with the optimizer's
    references to them, the state dict's.

    ``gc.collect()`` here took 0.45 s a call (two a build: a third of a 1-layer
    LLaMA-7B build on 64 GPUs), walking every object the process holds.
    AdamW holds its state in no reference cycle, so clearing the state frees
    it at once; a collection runs only where a state tensor outlives that
    (held in a cycle), so the state is dead before the next step either way.
    """
    held = [weakref.ref(t) for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    opt.state.clear()
    if any(r() is not None for r in held):
        gc.collect()


def _set_ac(model, names: list, on: bool) -> None:
    """Per-block checkpointing on or off, between steps (Note [One build for the configurations of a mesh]);
    off restores exactly the forward each block had (``remove_ac``)."""
    (apply_ac if on else remove_ac)(model, names)


def vocab_of(model) -> int:
    """The token range: the model's ``config.vocab_size`` or its first embedding's."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is None:
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
        if emb is None:
            raise MetaDispatchError("plan: the model has no config.vocab_size nor nn.Embedding; pass vocab=")
        size = emb.num_embeddings
    return int(size)


def tp_plan(layer: torch.nn.Module) -> dict:
    """Attention and MLP projections colwise then rowwise, by LLaMA's names (planning/tp.py)."""
    return serving_tp_plan(layer, "plan")


def default_step(model, ids) -> None:
    """``model(ids, labels=ids)``'s loss (or the output), backward."""
    # The output (the logits) is not kept through backward, as ``model(...).loss.backward()`` keeps it not.
    _loss(model(ids, labels=ids)).backward()


def _loss(out):
    loss = getattr(out, "loss", out)
    return loss[0] if isinstance(loss, tuple) else loss
