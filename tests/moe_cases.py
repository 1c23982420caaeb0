"""A dropless expert-parallel MoE layer, as torchtitan writes it, forced to a declared routing.

The layer counts the tokens routed to each expert (``histc`` of the top-k
indices, or ``bincount`` for ``recorded-bincount``), exchanges the counts
by ``all_to_all_single`` and reads them (``.tolist()``) as the split sizes of the tokens' all-to-all.  The real run
(``real_rank``, over ``gloo``) forces the routing the trace declares
(``md.RoutingAssumption``): the router is the identity on the first
``experts`` features and each token's input is a one-hot there, for the
expert the routing gives it.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

import metadispatch as md
from tests.distributed_cases import comparable

TOKENS, DIM, HIDDEN, LOCAL = 32, 16, 32, 2  # tokens a rank, model width, expert width, experts a rank


class DroplessMoE(torch.nn.Module):
    """Top-1 routing, no capacity: every token reaches its expert."""

    def __init__(self, world: int, counter: str = "histc") -> None:
        super().__init__()
        self.world, self.n_experts, self.counter = world, LOCAL * world, counter
        self.gate = torch.nn.Linear(DIM, self.n_experts, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.eye(self.n_experts, DIM))
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, DIM))
            for _ in range(LOCAL)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, e = dist.group.WORLD, self.n_experts
        scores = self.gate(x).softmax(-1)
        weight, top = scores.topk(1, dim=-1)
        if self.counter == "bincount":  # torchtitan's older token count: int64
            counts = torch.bincount(top.view(-1), minlength=e)
        else:
            counts = torch.histc(top.view(-1).float(), bins=e, min=0, max=e - 1)
        received = all_to_all_single(counts, None, None, group)
        send = counts.view(self.world, -1).sum(1).long().tolist()
        recv = received.view(self.world, -1).sum(1).long().tolist()
        order = top.view(-1).argsort(stable=True)
        got = all_to_all_single_autograd(x[order], recv, send, group)
        chunks = got.split(received.long().tolist())  # [source rank, local expert] blocks
        out = torch.cat([self.experts[j % LOCAL](c) for j, c in enumerate(chunks)])
        back = all_to_all_single_autograd(out, send, recv, group)
        return torch.zeros_like(x).index_add(0, order, back * weight.view(-1)[order, None])


# name -> the routing declared for a world of ``world`` ranks (and forced in its real run).
ROUTINGS = {
    "uniform": lambda world: "uniform",
    "worst": lambda world: "worst",
    "fractions": lambda world: {0: 0.5, 1: 0.25, LOCAL * world - 1: 0.25},
    # Recorded counts, a different row per rank: rank s sends 4 + 2s tokens to its last expert.
    "recorded": lambda world: [
        [TOKENS - 4 - 2 * s if e == 0 else (4 + 2 * s if e == LOCAL * world - 1 else 0) for e in range(LOCAL * world)]
        for s in range(world)
    ],
}
# The same recorded routing, the layer counting its tokens with bincount instead of histc.
ROUTINGS["recorded-bincount"] = ROUTINGS["recorded"]


def counter(name: str) -> str:
    """How the layer of routing ``name`` counts its tokens."""
    return "bincount" if name.endswith("-bincount") else "histc"


def forced_input(name: str, rank: int, world: int) -> torch.Tensor:
    """Tokens the identity router sends as routing ``name`` says, on this rank."""
    counts = md.RoutingAssumption(ROUTINGS[name](world)).counts(rank, world, LOCAL * world, TOKENS)
    experts = torch.repeat_interleave(torch.arange(LOCAL * world), torch.tensor(counts))
    x = torch.zeros(TOKENS, DIM)
    x[torch.arange(TOKENS), experts] = 8.0
    return x


def moe_step(name: str, rank: int, world: int) -> torch.nn.Module:
    """Forward and backward of the layer on forced tokens."""
    model = DroplessMoE(world, counter(name))
    model(forced_input(name, rank, world)).pow(2).mean().backward()
    return model


def traced_rank(name: str, rank: int, world: int):
    torch.manual_seed(0)
    policy = md.RoutingAssumption(ROUTINGS[name](world))
    with md.MetaMode(device="cpu", world_size=world, rank=rank, assume=policy) as mode:
        moe_step(name, rank, world)
    return mode.trace


def real_rank(rank: int, world: int, routings: list, out_dir: str) -> None:
    """Run the layer for each routing over ``gloo``; write ``out_dir/<routing>/<rank>.json``."""
    run_routings(moe_step, rank, world, routings, out_dir)


def run_routings(step, rank: int, world: int, routings: list, out_dir: str) -> None:
    """``step(routing, rank, world)`` for each routing over ``gloo``, its peak and collectives written to
    ``out_dir/<routing>/<rank>.json`` (shared with tests/ep_cases.py)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}", rank=rank, world_size=world
    )
    try:
        for routing in routings:
            torch.manual_seed(0)
            with md.testing.CollectiveLog() as log, md.LiveStorages(count_untracked=False) as live:
                step(routing, rank, world)
            os.makedirs(os.path.join(out_dir, routing), exist_ok=True)
            with open(os.path.join(out_dir, routing, f"{rank}.json"), "w") as f:
                json.dump({"peak": live.peak, "collectives": comparable(log.calls)}, f)
    finally:
        dist.destroy_process_group()
