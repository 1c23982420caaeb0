"""Tensor-parallel serving: one rank of a causal LM whose attention and MLP are split over ``tp`` logical GPUs.

Note [Serving one rank of a tensor-parallel model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
vLLM splits a decoder layer as Megatron does: the query, key and value
projections and the MLP's gate and up projections by output features
(each rank computes its own heads and its own slice of the intermediate
activation), the attention's output projection and the MLP's down
projection by input features, each followed by an all-reduce of the
hidden state.  torch's ``parallelize_module`` does the same with
``ColwiseParallel`` and ``RowwiseParallel``, so :func:`shard` rebuilds the
model from its config under ``MetaMode(world_size=tp, rank=0)`` and applies
that plan to every ``nn.Linear`` named ``q_proj``, ``k_proj``, ``v_proj``,
``gate_proj``, ``up_proj`` (colwise) and ``o_proj``, ``down_proj``
(rowwise) -- the names transformers' LLaMA-family models use.  The rank's
attention then reshapes its local projection into its own heads (the
models view with ``-1`` heads), so the cache it writes holds ``kv_heads /
tp`` heads: the KV bytes, the weights, the activation peak and the
all-reduces are read from this rank's trace, not divided by a formula.

Grouped-query attention with fewer KV heads than ranks: vLLM gives each
rank one KV head, a replica of head ``rank * kv_heads // tp`` (its
``num_kv_head_replicas``).  The same layout is built here by a config with
``num_key_value_heads = tp``: one head's projection and cache per rank,
which is what each rank holds (the replicas' values differ from a real
run's, their sizes do not).  ``tp`` must divide the attention heads and
the MLP's intermediate size, and the KV heads or be a multiple of them
(vLLM's rule); anything else is refused.  The embedding and the LM head
stay whole on every rank here, where vLLM splits their vocabulary: the
plan lists that as an assumption (an upper bound on the weights).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..errors import MetaDispatchError
from ..mode.mode import MetaMode

__all__ = ["COLWISE", "ROWWISE", "shard", "tp_plan", "local_tensors", "check_divides", "split_problems"]

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def tp_plan(model: nn.Module, who: str = "serve_plan") -> dict:
    """``parallelize_module``'s plan for ``model``: every projection by its name, colwise or rowwise
    (``serve_plan``'s and ``md.plan``'s; ``who`` names the caller in the refusal)."""
    plan: dict = {}
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, nn.Linear) and leaf in COLWISE + ROWWISE:
            plan[name] = ColwiseParallel() if leaf in COLWISE else RowwiseParallel()
    if not plan:
        raise MetaDispatchError(
            f"{who}: tp > 1 splits {', '.join(COLWISE)} colwise and {', '.join(ROWWISE)} rowwise; "
            f"{type(model).__name__} has no nn.Linear by those names"
        )
    return plan


def tp_config(config, tp: int):
    """A copy of ``config`` whose KV heads are split or replicated over ``tp`` ranks as vLLM does."""
    check_divides(config, tp)
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if isinstance(kv, int) and kv < tp:
        config = copy.deepcopy(config)
        config.num_key_value_heads = tp  # one head per rank: Note [Serving one rank of a tensor-parallel model]
    return config


def check_divides(config, tp: int) -> None:
    """Refuse a ``tp`` the heads or the MLP cannot be split by."""
    problems = split_problems(config, tp)
    if problems:
        raise MetaDispatchError(f"serve_plan: tp={tp} does not split {', '.join(problems)}")


def split_problems(config, tp: int) -> list[str]:
    """What in ``config`` a ``tp`` cannot split (``"num_attention_heads=4"``...); empty when it splits all."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None)
    problems = []
    if isinstance(heads, int) and heads % tp:
        problems.append(f"num_attention_heads={heads}")
    if isinstance(inter, int) and inter % tp:
        problems.append(f"intermediate_size={inter}")
    if isinstance(kv, int) and (kv % tp if kv >= tp else tp % kv):
        problems.append(f"num_key_value_heads={kv} (tp must divide it, or be a multiple of it: vLLM's rule)")
    return problems


def shard(model: nn.Module, tp: int, gpu: str) -> nn.Module:
    """Rank 0 of ``model`` split over ``tp`` logical GPUs (Note [Serving one rank of a tensor-parallel model]).

    The model is rebuilt from ``model.config`` in its dtype, never changed.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise MetaDispatchError(
            f"serve_plan: tp > 1 rebuilds the model from its config; {type(model).__name__} has no .config"
        )
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    with MetaMode(device="cuda", gpu=gpu, world_size=tp, rank=0):
        ranked = type(model)(tp_config(config, tp)).to(dtype).eval()
        parallelize_module(ranked, init_device_mesh("cuda", (tp,)), tp_plan(ranked))
    return ranked


def local_tensors(tensors):
    """Each tensor as this rank holds it: a DTensor's local shard."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
