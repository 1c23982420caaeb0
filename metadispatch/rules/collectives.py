"""Collectives: what torch's meta kernels get wrong about them.

The c10d ops (``torch.distributed``'s eager API, FSDP) write into tensors
they are given, and their meta kernels (``torch/distributed/
_meta_registrations.py``) return those tensors and a Work that does nothing:
right as they are.  ``_c10d_functional.wait_tensor`` is not: the real op
returns its input, the same tensor (it waits for the collective that
produced it), while torch's meta kernel returns a new one -- a storage-level
memory model built on it would count every functional collective's output
twice.
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule

__all__ = ["wait_tensor"]


@builtin_rule(torch.ops._c10d_functional.wait_tensor.default)
def wait_tensor(tensor):
    return tensor
