"""Ops whose torch meta function branches on the device: ask it for the logical one.

Note [Device-hinted meta kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Some of torch's Python meta functions (``torch/_meta_registrations.py``)
know that the real kernels differ between devices -- LAPACK returns ``Vh``
and eigenvectors column-major on CPU, MKL lays out FFT outputs by its own
rule, CPU ``embedding_bag`` returns differently sized auxiliary outputs --
and pick a branch with ``device_hint(t)``.  That reads ``t.device``, which is
``meta`` while a kernel runs on a MetaTensor (Note [Logical device]), and a
meta device reads as "cuda".  So the native stage always answers CUDA's way.

FakeTensor gets the right branch because ``device_hint`` reads its
``fake_device``.  We get it by calling torch's meta function ourselves as a
rule: rules run with MetaTensors that report their logical device, so
``device_hint`` sees ``cpu`` (or ``cuda:1``), and the ops the function calls
(``new_empty``, ``as_strided_``) are routed as usual.  The answer for each
device is torch's own; nothing here encodes a device's behaviour.

``_embedding_bag`` and ``_embedding_bag_forward_only`` are asked the same
way in ``embedding.py``, which also keeps the CPU kernel's storages (Note
[Embedding-bag storages]).  Only functional overloads are listed; ``out=`` overloads keep the native
stage.  An op whose meta function disappears in a later torch is skipped.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..core.registry import builtin_rule

aten = torch.ops.aten

# Every functional op whose Python meta function consults device_hint and
# gives other metadata (not just a warning) per device.
OPS = (
    aten._fft_c2c.default,
    aten._fft_r2c.default,
    aten._fft_c2r.default,
    aten._linalg_svd.default,
    aten.linalg_eig.default,
    aten.nonzero_static.default,
    aten.pixel_shuffle.default,
    aten.reflection_pad2d.default,
    aten.replication_pad2d.default,
    aten.histc.default,
)


def _hinted(meta_fn):
    def rule(*args, **kwargs):
        return meta_fn(*args, **kwargs)

    rule.__name__ = rule.__qualname__ = f"device_hinted_{meta_fn.__name__}"
    return rule


for _op in OPS:
    _fn = _compat.python_meta_kernel(_op)
    if _fn is not None:
        builtin_rule(_op)(_hinted(_fn))
