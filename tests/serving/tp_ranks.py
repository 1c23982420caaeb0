"""What one rank of a real tensor-parallel CPU run holds: spawned by tests/serving/test_serve_tp.py.

Each rank joins a ``gloo`` group, builds the transformers model from its
config (seeded), splits it with torch's ``parallelize_module`` as vLLM splits
a decoder layer -- q/k/v and gate/up colwise, o and down rowwise, written
here by name, not taken from metadispatch -- and measures, on real CPU
tensors: its parameters' local bytes, the bytes its ``DynamicCache`` holds
after a prefill of ``n - 1`` tokens and one decode step, per length, and the
collectives a prefill calls (``md.testing.CollectiveLog``).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import metadispatch as md
from metadispatch.serving.kv import _tensors, decoded_cache

VLLM_PLAN = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel,
    "model.layers.*.self_attn.k_proj": ColwiseParallel,
    "model.layers.*.self_attn.v_proj": ColwiseParallel,
    "model.layers.*.self_attn.o_proj": RowwiseParallel,
    "model.layers.*.mlp.gate_proj": ColwiseParallel,
    "model.layers.*.mlp.up_proj": ColwiseParallel,
    "model.layers.*.mlp.down_proj": RowwiseParallel,
}


def _bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        if (p := t.untyped_storage().data_ptr()) not in seen:
            seen.add(p)
            total += t.untyped_storage().nbytes()
    return total


def measure(rank: int, world_size: int, configs: dict, lengths: tuple, out_dir: str) -> None:
    """For every config: write ``out_dir/<name>/<rank>.json`` with this rank's weights, cache and collectives."""
    store = f"file://{os.path.join(out_dir, 'rendezvous')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for name, cfg in configs.items():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            parallelize_module(model, mesh, {k: v() for k, v in VLLM_PLAN.items()})
            result: dict = {"weights": _bytes([*model.parameters(), *model.buffers()], set()), "cache": {}}
            for n in lengths:
                with torch.no_grad():
                    cache = decoded_cache(model, torch.randint(0, cfg.vocab_size, (1, n)))
                seen: set = set()
                result["cache"][n] = sum(_bytes(_tensors(layer), seen) for layer in cache.layers)
            with md.testing.CollectiveLog() as log, torch.no_grad():
                model(torch.randint(0, cfg.vocab_size, (1, lengths[0])), use_cache=True)
            result["collectives"] = [c.kind for c in log.calls]
            os.makedirs(os.path.join(out_dir, name), exist_ok=True)
            with open(os.path.join(out_dir, name, f"{rank}.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()
