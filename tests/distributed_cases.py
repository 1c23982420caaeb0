"""Distributed training steps run twice: for real over ``gloo`` and traced.

Each case builds its model, wraps it and takes one optimizer step inside
the function, so a real run under ``md.LiveStorages`` and a trace see the
same storages from the start.  ``real_rank`` is what each spawned process
runs; it writes its peak and its collectives where the parent reads them.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import metadispatch as md
from metadispatch.cli.llama import Llama, LlamaConfig

BATCH, SEQ = 2, 16


def fsdp_step(foreach: bool, reshard: bool = True) -> torch.nn.Module:
    """FSDP2 on a tiny LLaMA (one unit per block, plus the root), one AdamW step."""
    # vocab and hidden sizes that 4 ranks shard unevenly (18, 18, 18, 16 rows; 14 each)
    config = LlamaConfig(vocab_size=70, dim=40, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=54)
    model = Llama(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    model(ids, ids).backward()
    opt.step()
    opt.zero_grad()
    return model


CASES = {
    "fsdp": lambda: fsdp_step(foreach=False),
    "fsdp-foreach": lambda: fsdp_step(foreach=True),
    "fsdp-no-reshard": lambda: fsdp_step(foreach=True, reshard=False),
}


def local_shapes(model: torch.nn.Module) -> list:
    """This rank's shard of each parameter (uneven ranks hold fewer rows)."""
    return [list(p.to_local().shape) for p in model.parameters()]


def comparable(calls) -> list:
    """What must agree between a real run and a trace, per collective."""
    return [(c.op, c.kind, c.tensors, c.bytes, c.sent) for c in calls]


def real_rank(rank: int, world_size: int, port: int, case: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        with md.testing.CollectiveLog() as log, md.LiveStorages(count_untracked=False) as live:  # Note [Storages made out of sight]
            model = CASES[case]()
        result = {"peak": live.peak, "collectives": comparable(log.calls), "shards": local_shapes(model)}
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def traced_rank(rank: int, world_size: int, case: str) -> tuple:
    """The trace of one rank, and its parameters' local shapes."""
    torch.manual_seed(0)
    with md.MetaMode(world_size=world_size, rank=rank) as mode:
        model = CASES[case]()
    return mode.trace, local_shapes(model)
