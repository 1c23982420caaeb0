"""Where the memory-efficient attention kernel puts its dropout seed and offset.

Note [Efficient attention's seed and offset]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``_scaled_dot_product_efficient_attention`` and ``_efficient_attention_forward``
return the Philox seed and offset their dropout used as two int64 scalars.
torch's meta kernel makes them on ``meta`` (its comment "Seed and Offset": the
device depends on whether a CUDA graph is being captured), which a logical
GPU reads as its own device.  CUDA's kernel (``_efficient_attention_forward``
in attention.cu) makes them on the CPU unless a graph is being captured, with
dropout or without: a real H100 returned CPU scalars for every model of the
zoo (tools/gpu_conformance.py), and replay compared the device.  A logical GPU
captures no graph, so they are CPU scalars here too.  The flash and cuDNN
kernels keep torch's answer (their seed/offset tensors are CUDA's since
torch's "BC breaking change to flash seed/offset").
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core.registry import builtin_rule
from ..tensor.tensor import wrap

aten = torch.ops.aten
_CPU = torch.device("cpu")


def _cpu_scalars(out, query):
    if query.device.type != "cuda":
        return out
    with _compat.no_python_dispatch():
        seed, offset = (torch.empty((), dtype=torch.int64, device="meta") for _ in range(2))
    return (*out[:2], wrap(seed, _CPU), wrap(offset, _CPU), *out[4:])


@builtin_rule(aten._scaled_dot_product_efficient_attention.default)
def scaled_dot_product_efficient_attention(query, *args, fallback, **kwargs):
    return _cpu_scalars(fallback(query, *args, **kwargs), query)


@builtin_rule(aten._efficient_attention_forward.default)
def efficient_attention_forward(query, *args, fallback, **kwargs):
    return _cpu_scalars(fallback(query, *args, **kwargs), query)
