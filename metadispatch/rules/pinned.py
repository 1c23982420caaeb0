"""Page-locked host memory: ``Tensor.pin_memory()`` and ``is_pinned()`` on a logical CPU tensor.

Note [Pinned memory on a logical host]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FSDP2's ``CPUOffloadPolicy`` (``pin_memory=True``, its default) keeps each
sharded parameter in page-locked host memory so that its copies to and from
the GPU can be asynchronous: ``padded_sharded_param.cpu().pin_memory()``,
and on lazy init it pins again whatever ``is_pinned()`` says is not.  A
real ``pin_memory`` is ``is_pinned`` then ``_pin_memory``, a new host
storage of the same sizes and strides into which the tensor is copied
(``at::native::_pin_memory``); pinning an already pinned tensor returns it.

With an accelerator -- a logical GPU answers for one -- ``_pin_memory``
makes that storage here, and the storage is remembered as pinned for as
long as it lives (weakly: a trace keeps no tensor alive), so ``is_pinned``
answers True for it and its views, as on a real host, and FSDP2 does not
pin twice.  Without an accelerator (a logical CPU world on a CPU-only
host) torch itself refuses to pin, and so does ``MetaTensor.pin_memory``
(Note [Storage-level calls on a MetaTensor] in ``tensor/tensor.py``).
Pinned bytes are host memory: ``md.memory`` counts them on the CPU.

Not modelled: ``x.to("cpu", non_blocking=True)`` from a GPU, whose real
destination is pinned, answers ``is_pinned()`` False here; only
``pin_memory`` pins.
"""

from __future__ import annotations

import weakref

import torch

from ..core.registry import builtin_rule

aten = torch.ops.aten

_PINNED: weakref.WeakSet = weakref.WeakSet()  # storages pinned while tracing, kept alive by their tensors only


@builtin_rule(aten._pin_memory.default)
def pin_memory(x, device=None):
    torch._check(
        x.device.type == "cpu", lambda: f"cannot pin '{x.device}' memory: only dense CPU tensors can be pinned"
    )
    out = x.new_empty_strided(x.shape, x.stride())
    _PINNED.add(out.untyped_storage())
    return out


@builtin_rule(aten.is_pinned.default)
def is_pinned(x, device=None):
    return x.untyped_storage() in _PINNED
