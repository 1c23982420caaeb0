"""md's expert parallelism (world/expert_parallel.py) on transformers' Qwen3-MoE block, forced to a routing.

The block is the one ``md.plan`` shards: its router (``Qwen3MoeTopKRouter``,
top-2), then its fused experts under :func:`md.world.expert_parallel`'s
dropless dispatch -- the picks counted per expert (``histc``), the counts
exchanged (``all_to_all_single``) and read as the split sizes of the
tokens' all-to-all, the local experts, the combine all-to-all back.  The
real run (``real_rank``, over ``gloo``) forces the routing the trace
declares (``md.RoutingAssumption``): the router's weight is the identity on
the first ``experts`` features and token ``t``'s input is 8 at its first
pick and 4 at its second, so the top-2 are the experts the routing gives it.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import metadispatch as md
from metadispatch.world.expert_parallel import expert_parallel
from tests.moe_cases import run_routings

TOKENS, DIM, EXPERTS, TOP_K = 16, 32, 4, 2


def config():
    import transformers

    return transformers.Qwen3MoeConfig(
        hidden_size=DIM, moe_intermediate_size=24, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True
    )


def picks(name: str, world: int) -> list:
    """Each token's two experts under routing ``name``: ``uniform`` (token t: 2t, 2t + 1 mod experts) or
    ``worst`` (every token to rank 0's experts, ``experts / world`` of them, spread evenly)."""
    if name == "uniform":
        return [((2 * t) % EXPERTS, (2 * t + 1) % EXPERTS) for t in range(TOKENS)]
    local = EXPERTS // world
    return [(0, 1) if t % 2 == 0 else (1, 0) for t in range(TOKENS)] if local == 2 else []


def forced_input(name: str, world: int) -> torch.Tensor:
    x = torch.zeros(TOKENS, DIM)
    for t, (a, b) in enumerate(picks(name, world)):
        x[t, a], x[t, b] = 8.0, 4.0
    return x


def moe_step(name: str, rank: int, world: int) -> None:
    """Build the block, shard its experts over all ``world`` ranks, and run forward and backward once."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(config())
    with torch.no_grad():
        block.gate.weight.copy_(torch.eye(EXPERTS, DIM))
        block.experts.gate_up_proj.normal_(0, 0.02)
        block.experts.down_proj.normal_(0, 0.02)
    expert_parallel(block.experts, init_device_mesh("cpu", (world,)))
    x = forced_input(name, world).requires_grad_()
    block(x[None]).pow(2).mean().backward()


def traced_rank(name: str, rank: int, world: int):
    torch.manual_seed(0)
    with md.MetaMode(device="cpu", world_size=world, rank=rank, assume=md.RoutingAssumption(name)) as mode:
        moe_step(name, rank, world)
    return mode.trace


def real_rank(rank: int, world: int, routings: list, out_dir: str) -> None:
    """Run the block for each routing over ``gloo``; write ``out_dir/<routing>/<rank>.json``."""
    run_routings(moe_step, rank, world, routings, out_dir)
