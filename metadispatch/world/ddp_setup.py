"""DDP's two C++ setup helpers, as the collectives they run, for a logical world.

``DistributedDataParallel.__init__`` checks that every rank holds parameters
of the same shapes (``dist._verify_params_across_processes``) and broadcasts
rank 0's parameters and buffers (``dist._broadcast_coalesced``).  Both are
C++ that reads tensor data -- a metadata tensor of shapes, flattened
buckets -- which MetaTensors do not have.  In a logical world every rank is
the traced one, so there is nothing to verify and nothing to receive; what
a trace needs is the communication and the memory, which these stand-ins
reproduce as the C++ does it:

- verify: an all-gather of each rank's metadata length (one int64), then a
  broadcast of rank 0's metadata (each parameter's sizes and strides, int64);
- broadcast: the tensors flattened into buckets of at most ``buffer_size``
  bytes (one dtype per bucket, in order), each bucket broadcast and copied
  back.

Installed by ``World.install``; the originals are put back on exit.
"""

from __future__ import annotations

import torch

from .. import _compat

__all__ = ["PATCHES"]


def _verify_params(process_group, tensors, logger=None) -> None:
    if not tensors:
        return
    device = tensors[0].device
    meta = torch.empty(sum(2 * t.dim() for t in tensors), dtype=torch.long, device=device)
    length = torch.empty(1, dtype=torch.long, device=device)
    lengths = [torch.empty(1, dtype=torch.long, device=device) for _ in range(process_group.size())]
    _compat.dist.all_gather(lengths, length, group=process_group)
    _compat.dist.broadcast(meta, group_src=0, group=process_group)


def _broadcast_coalesced(process_group, tensors, buffer_size: int, src: int = 0) -> None:
    for bucket in _buckets(tensors, buffer_size):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        _compat.dist.broadcast(flat, group_src=src, group=process_group)
        offset = 0
        with torch.no_grad():
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _buckets(tensors, limit: int) -> list:
    """Consecutive runs of one dtype, each at most ``limit`` bytes (at least one tensor)."""
    out: list = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or out[-1][0].dtype != t.dtype or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


# (owner, attribute, make, why): the ledger's rows (mode/ledger.py), with world.py's.
PATCHES = [
    (
        _compat.dist,
        "_verify_params_across_processes",
        lambda below: _verify_params,
        "DDP's setup check, as its collective",
    ),
    (
        _compat.dist,
        "_broadcast_coalesced",
        lambda below: _broadcast_coalesced,
        "DDP's setup broadcast, as its collectives",
    ),
]
