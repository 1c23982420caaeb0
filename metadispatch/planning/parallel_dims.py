"""``md.plan``'s sequence (``sp``), context (``cp``) and expert (``ep``) parallelism: the search and the build.

Requirements: each configuration is built with torch's own APIs as a
torchtitan-style script builds it, so its trace is that of the job, and
a rule it breaks is named (``.why``) before anything is traced.

Note [The meshes of a configuration]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank ``i`` of ``N = replicate x shard x cp x tp`` GPUs sits at ``(r, s,
c, t)`` of ``arange(N).view(R, S, C, T)``.  TP is the innermost dimension
(as before); CP ranks share a batch but hold different tokens of it, so
FSDP2 shards the parameters over ``shard x cp`` (torchtitan's
``dp_shard_cp``): the FSDP2 and TP mesh is ``(R, S * C, T)``, and the CP
mesh the ``c`` dimension of ``(R, S, C, T)`` -- two ``init_device_mesh``
calls over one layout, no private flattening.  The batch is split over
``R x S`` data-parallel ranks.  EP borrows from FSDP2's shard dimension,
``shard x cp`` (torchtitan's EP borrows from ``dp_shard x cp``): the
experts are spread over ``ep`` consecutive ranks of it -- the ``e``
dimension of ``(R, S * C / E, E, T)`` -- and FSDP2 shards each block's
experts over ``(R, S * C / E)``, its other parameters over the
``(R, S * C)`` of the rest (each CP rank routes its own tokens, each TP
rank the same whole ones); a block's experts are wrapped on their own mesh
first, so the block's ``fully_shard`` leaves them alone.

Note [Sequence parallelism per block]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``sp``, the residual stream between blocks is a DTensor sharded on
the sequence (``Shard(1)``), as torchtitan's plan keeps it: the norms run
on each rank's tokens (``SequenceParallel``), the attention's and MLP's
inputs are all-gathered once (``PrepareModuleInput`` to ``Replicate``)
before the colwise projections, and the rowwise ones reduce-scatter back
to ``Shard(1)`` instead of all-reducing.  An MLP TP does not split (fused
MoE experts) is gathered in and scattered out whole.  The embedding and
LM head stay whole here, as without ``sp``: the first block's input is
scattered to ``Shard(1)`` (a local slice, no communication) and the last
block's output gathered back (an all-gather), so ``sp`` saves the
activations inside the blocks, not the logits'.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..world.expert_parallel import expert_modules, expert_parallel
from .tp import COLWISE, ROWWISE

__all__ = ["DEFAULTS", "expand", "rule", "with_pipelines", "pipeline_rule", "wrap", "micro_step"]

DEFAULTS = {"sp": False, "cp": 1, "ep": 1}  # what a configuration without them is
NORMS = ("input_layernorm", "post_attention_layernorm")


def expand(search: dict, tp: int) -> list:
    """The ``(sp, cp, ep)`` of ``search`` to try with ``tp`` (``sp`` only where ``tp > 1``)."""
    sps = [s for s in search.get("sp", [False]) if not s or tp > 1]
    return [(s, c, e) for s in sps for c in search.get("cp", [1]) for e in search.get("ep", [1])]


def rule(c: dict, seq: int, experts: int | None) -> str | None:
    """The rule ``c``'s sp, cp or ep breaks (the GPU count and heads are checked by the caller)."""
    tp, cp, ep = c["tp"], c.get("cp", 1), c.get("ep", 1)
    if c.get("sp") and seq % tp:
        return f"sp: seq {seq} is not a multiple of tp {tp}"
    if cp > 1 and seq % (2 * cp):
        return f"cp {cp} needs seq {seq} divisible by 2 x cp = {2 * cp} (load-balanced ring attention)"
    if ep == 1:
        return None
    if experts is None:
        return f"ep {ep}: the model has no fused MoE experts"
    if experts % ep:
        return f"ep {ep} does not divide num_experts={experts}"
    if c["shard"] * cp % ep:
        x = f" x cp {cp}" if cp > 1 else ""
        return f"ep {ep} does not divide shard {c['shard']}{x} (EP borrows FSDP2's shard ranks)"
    return None


def with_pipelines(search: dict, pipelines: list) -> list:
    """Each pipeline configuration with every ``(sp, cp, ep)`` of ``search`` for its ``tp``: those other than
    the defaults are candidates :func:`pipeline_rule` refuses by name, not configurations left out."""
    return [{**c, **dict(zip(DEFAULTS, x))} for c in pipelines for x in expand(search, c["tp"])]


def pipeline_rule(c: dict) -> str | None:
    """Why a pipeline configuration with sp, cp or ep is not scored: planning/pipeline_candidates.py wraps
    each stage with TP and FSDP2 only, so its trace would not be that configuration's."""
    dims = [d for d, on in (("sp", c.get("sp")), ("cp", c.get("cp", 1) > 1), ("ep", c.get("ep", 1) > 1)) if on]
    if not dims:
        return None
    return f"{' and '.join(dims)} with pp is not searched (the pipeline's stages are wrapped with TP and FSDP2 only)"


def wrap(model, c: dict, units: list, tp_plan) -> dict:
    """TP (with SP), EP and FSDP2 on ``model``'s blocks ``units`` for ``c``; the meshes by name
    (Note [The meshes of a configuration])."""
    r, s, cp, tp, ep = c["replicate"], c["shard"], c.get("cp", 1), c["tp"], c.get("ep", 1)
    mesh = init_device_mesh("cuda", (r, s * cp, tp), mesh_dim_names=("replicate", "shard", "tp"))
    meshes = {"main": mesh}
    if cp > 1:
        meshes["cp"] = init_device_mesh("cuda", (r, s, cp, tp), mesh_dim_names=("replicate", "shard", "cp", "tp"))["cp"]
    if tp > 1:
        for layer in units:
            parallelize_module(layer, mesh["tp"], sp_plan(layer) if c.get("sp") else tp_plan(layer))
        if c.get("sp"):
            parallelize_module(
                units[0],
                mesh["tp"],
                PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
                ),
            )
            parallelize_module(
                units[-1],
                mesh["tp"],
                PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)),
            )
    experts: list = []
    if ep > 1:
        em = init_device_mesh("cuda", (r, s * cp // ep, ep, tp), mesh_dim_names=("replicate", "shard", "ep", "tp"))
        experts = [expert_parallel(m, em["ep"]) for m in expert_modules(model)]
        edp = em["replicate", "shard"] if r > 1 else em["shard"]
        for m in experts:  # on a mesh of one rank too (torchtitan's): DTensors, as the optimizer's others
            fully_shard(m, mesh=edp)
            # Each expert's gradient already sums the tokens of its ep ranks (the all-to-all's
            # backward): averaged over edp alone it is ep times a dense one's; torchtitan divides
            # by the whole data-parallel size, as here.
            m.set_gradient_divide_factor(float(r * s * cp))
    if r * s * cp > 1:
        dp = mesh["replicate", "shard"] if r > 1 else mesh["shard"]
        for layer in units:  # a block's experts, wrapped on their mesh above, are left to it
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return meshes


def micro_step(c: dict, meshes: dict, ids):
    """The context one micro-batch's forward and backward run in: ``context_parallel`` sharding ``ids``
    on the sequence over the CP ranks (torchtitan's), or nothing."""
    if c.get("cp", 1) == 1:
        return contextlib.nullcontext()
    return context_parallel(meshes["cp"], buffers=[ids], buffer_seq_dims=[1])


def sp_plan(layer: torch.nn.Module) -> dict:
    """``parallelize_module``'s plan for one block with sequence parallelism (Note [Sequence parallelism per block])."""
    plan: dict = {}
    split = {n.rsplit(".", 1)[0] for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] in COLWISE}
    for name, m in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in NORMS:
            plan[name] = SequenceParallel()
        elif isinstance(m, torch.nn.Linear) and leaf in COLWISE:
            plan[name] = ColwiseParallel()
        elif isinstance(m, torch.nn.Linear) and leaf in ROWWISE:
            plan[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        elif leaf == "self_attn":
            plan[name] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        elif leaf == "mlp" and name in split:
            plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        elif leaf == "mlp":  # not split by TP (MoE experts): whole in, sequence-sharded out
            plan[name] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=False,
            )
    return plan
