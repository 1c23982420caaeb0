"""A functional collective's ``.wait()`` in a logical world, against a real 2-process gloo run:
the op sequence per rank, wait included (Note [A wrapped collective can be waited on] in world/world.py)."""

import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import metadispatch as md


def _step():
    x = torch.ones(4) * (dist.get_rank() + 1)
    y = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    z = y.wait()
    # Not waited on: eager's wrapper waits inside its own handler, below any
    # TorchDispatchMode, so the real log has no wait_tensor for this one.
    w = funcol.all_gather_tensor(x, 0, dist.group.WORLD).view(2, 4)
    return (z * 2).sum() + (w * 2).sum()


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _real_rank(rank: int, out: str) -> None:
    warnings.simplefilter("ignore")
    # a file store, not a port: a free port picked by the parent can be taken before the children bind it
    # (CI, tests in parallel: rank 0 aborted once, "terminate called without an active exception")
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'rendezvous')}", rank=rank, world_size=2)
    with _Log() as log:
        _step()
    dist.destroy_process_group()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(log.ops, f)


def test_funcol_wait_matches_real_gloo_run(tmp_path):
    mp.spawn(_real_rank, args=(str(tmp_path),), nprocs=2)
    for rank in range(2):
        real = json.loads((tmp_path / f"{rank}.json").read_text())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with md.MetaMode(device="cpu", world_size=2, rank=rank) as mode:
                _step()
        traced = [c.op for c in mode.trace.calls]
        assert real.count("_c10d_functional.wait_tensor.default") == 1
        assert traced == real, f"rank {rank}"
