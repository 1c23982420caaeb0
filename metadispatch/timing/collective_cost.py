"""How long a collective takes: the latency-bandwidth (alpha-beta) model of ring and tree.

Note [Time of a collective]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
For a group of ``n`` ranks, payload ``S`` bytes (as nccl-tests counts it:
``Collective.bytes``), per-step latency ``a`` and per-rank link bandwidth
``B`` (bytes per second, one direction)::

    all_gather, reduce_scatter, all_to_all   ring  (n-1) a +   (n-1)/n S / B
    all_reduce                               ring 2(n-1) a + 2 (n-1)/n S / B
                                             tree 2 ceil(log2 n) a + 2 S / B
    broadcast                                ring  (n-1) a + S / B   (pipelined)
                                             tree  ceil(log2 n) a + S / B

an all-reduce or broadcast taking the faster of ring and tree, as NCCL's
tuner aims to (Thakur, Rabenseifner and Gropp, "Optimization of collective
communication operations in MPICH", 2005; NCCL's ring and double binary
tree).  ``(n-1)/n S`` is ``Collective.sent``: what a ring moves through
each rank.  ``B`` is the GPU profile's interconnect while the group's ranks
lie on one node (``gpus_per_node`` consecutive ranks), else ``network``,
the per-GPU bandwidth between nodes (default 50 GB/s: one 400 Gb/s NIC per
GPU, as a DGX H100 has).  One group of size 1 costs nothing.

Limits: no congestion between groups running at once, no overlap with
compute (the time is the collective's alone; FSDP hides much of it behind
compute), no NVLS/PAT/CollNet algorithms, no protocol (LL/LL128/Simple)
choice; ``latency`` (default 5 us) is one figure for every step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..spec.profiles import GPUProfile, gpu_profile

__all__ = ["Link", "link", "seconds"]

NETWORK = 50e9  # bytes/s per GPU between nodes: a 400 Gb/s NIC each
LATENCY = 5e-6  # seconds per algorithm step
GPUS_PER_NODE = 8


class Link(NamedTuple):
    """What the model needs besides the collective: bandwidths and latency."""

    node: float  # bytes/s per rank within a node, one direction
    network: float  # bytes/s per rank between nodes
    latency: float  # seconds per step
    gpus_per_node: int


def link(
    gpu: str | GPUProfile | None = None,
    bandwidth: float | None = None,
    network: float = NETWORK,
    latency: float = LATENCY,
    gpus_per_node: int = GPUS_PER_NODE,
) -> Link:
    """The :class:`Link` of ``gpu``'s interconnect, or of ``bandwidth`` bytes/s."""
    node = bandwidth if bandwidth is not None else gpu_profile(gpu).interconnect
    for name, v in (("bandwidth", node), ("network", network)):
        if not v > 0:
            raise ValueError(f"{name}={v!r}: bytes per second, positive")
    if not latency >= 0 or type(gpus_per_node) is not int or gpus_per_node < 1:
        raise ValueError(f"latency={latency!r}, gpus_per_node={gpus_per_node!r}: seconds >= 0 and an int >= 1")
    return Link(node, network, latency, gpus_per_node)


def seconds(kind: str, payload: int, ranks: tuple, net: Link) -> float:
    """Estimated seconds of one collective (Note [Time of a collective])."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    nodes = {r // net.gpus_per_node for r in ranks}
    b = net.node if len(nodes) == 1 else min(net.node, net.network)
    a, s, depth = net.latency, payload, math.ceil(math.log2(n))
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * a + (n - 1) / n * s / b
    if kind == "all_reduce":
        return min(2 * (n - 1) * a + 2 * (n - 1) / n * s / b, 2 * depth * a + 2 * s / b)
    if kind == "broadcast":
        return min((n - 1) * a + s / b, depth * a + s / b)
    return a + s / b  # reduce, gather, scatter, point-to-point: one transfer of the payload
