"""The rank programs ``md.plan`` scores: one mesh's configurations built, wrapped and stepped in one mode.

Requirements: the wrapping is a script's (TP on each block, then FSDP2 on
each block and the root; the blocks are the children of the largest
``nn.ModuleList``, ``md.plan_ac``'s), written with torch's own
``parallelize_module`` and ``fully_shard``; each configuration comes back
as the trace of its own steady-state step, marks ``built``, ``step``,
``micro`` (the last micro-batch) and ``opt``, as a direct trace of it
would be.

Note [One build for the micro-batch sizes of a mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Configurations that differ only in micro-batch (and so in accumulation)
run one model, wrapped once: the same parameter shards, and after an
optimizer step and ``zero_grad`` the same state -- parameters, AdamW's
moments and step count, no gradients.  So they are traced in one mode: the
model is built and wrapped once, one warmup step runs at the first's
micro-batch, then each configuration's step in turn, and each is cut out
(``step_until`` its end, then ``step_from`` its start) as the trace of its
own steady state.  What the step of another micro-batch left alive is what
a warmup of its own would have left, so each cut gives the peak, reserved
peak and time of a direct trace of that configuration
(tests/planning/test_plan.py, within 1 KiB and exactly).  A build, FSDP2's
and TP's wrapping (``fully_shard``'s parameter setup is a quarter of a
shallow trace) and a warmup step are paid once a mesh instead of once a
configuration.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import MetaDispatchError
from ..ir.cut import step_until
from ..mode.mode import MetaMode
from ..tracing.marks import mark
from ..values.routing import RoutingAssumption
from . import parallel_dims
from .ac import apply_ac, blocks
from .tp import tp_plan as serving_tp_plan

__all__ = ["default_step", "tp_plan", "trace_programs"]


def trace_programs(
    make_model: Callable, cs: list, gpus: int, gpu, seq: int, step: Callable, vocab: int | None, layers=None
) -> list:
    """Rank 0's trace for each of ``cs`` (configurations of one mesh, AC and optimizer; Note [One build for
    the micro-batch sizes of a mesh]), the model built ``layers`` blocks deep (None: ``make_model()``)."""
    head = cs[0]
    opt_kw: dict = {"fused": True} if head["optimizer"] == "fused" else {"foreach": True}
    # EP's dispatch reads routing counts another rank sends: declared uniform (values/routing.py)
    routing = RoutingAssumption("uniform") if head.get("ep", 1) > 1 else None
    with MetaMode(device="cuda", gpu=gpu, world_size=gpus, rank=0, assume=routing) as mode:
        model = make_model() if layers is None else make_model(layers=layers)
        if head["ac"] == "block":
            apply_ac(model, blocks(model))
        units = [model.get_submodule(name) for name in blocks(model)]
        meshes = parallel_dims.wrap(model, head, units, tp_plan)  # TP (SP), EP, FSDP2 on (replicate, shard x cp)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, **opt_kw)
        tokens = vocab if vocab is not None else vocab_of(model)
        mark("built")
        for n, c in [(None, head), *enumerate(cs)]:  # the warmup, then each configuration's step
            accum = min(c["accum"], 2) if c["accum"] else 1  # Note [Tracing once per shape class] in train.py
            ids = torch.randint(0, tokens, (c["micro_batch"], seq), device="cuda")
            mark(f"step {n}")
            for i in range(accum):
                if i == accum - 1:
                    mark(f"micro {n}")
                with parallel_dims.micro_step(c, meshes, ids):  # CP shards ids on the sequence
                    step(model, ids)
            mark(f"opt {n}")
            opt.step()
            opt.zero_grad()
            mark(f"end {n}")
            del ids
    whole = mode.trace
    out = []
    for n in range(len(cs)):
        one = step_until(whole, whole.marks[f"end {n}"])
        one.marks = {"built": whole.marks["built"]} | {k: whole.marks[f"{k} {n}"] for k in ("step", "micro", "opt")}
        out.append(one)
    return out


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
