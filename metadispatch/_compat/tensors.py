"""Tensors and what C++ decides from them: subclass construction with a logical CPU's keys, storages, versions, layouts.

Part of ``metadispatch._compat`` (its docstring says why private torch APIs live here alone).
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor

# Note [Backend keys of a logical CPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Everything torch's C++ decides from a tensor's device or dispatch keys --
# autocast (``AutocastCPU`` sits above Python dispatch and casts only tensors
# whose ``is_cpu()`` holds), composite kernels that pick a backend
# (``lstm`` -> ``mkldnn_rnn_layer``, SDPA's fused-kernel choice, convolution),
# device checks in composites (``stft``'s window), tensors a composite builds
# from ``self.options()`` (list indexing) -- takes the meta branch on a meta
# tensor.  So a MetaTensor on a logical CPU is built as FakeTensor builds its
# tensors: the C++ tensor keeps its meta storage but gets CPU's dispatch keys
# (``device_for_backend_keys``) and asks Python for its device
# (``dispatch_device``, answered by ``MetaTensor.device`` through
# ``prim::device``).  C++ then makes CPU's choices itself, whatever the torch
# version.  While a meta kernel runs, Meta is added to the thread's included
# keys, which outranks CPU, and ``device`` answers meta (``in_kernel``).
# Other logical devices keep plain meta keys: a CUDA key set on a host
# without CUDA would make autograd ask for a CUDA device guard and abort
# (Note [Logical device]).
_make_subclass = torch.Tensor._make_subclass
_CPU = torch.device("cpu")


def make_subclass(cls, elem: torch.Tensor, requires_grad: bool, device: torch.device):
    """``elem`` (a meta tensor) as a ``cls``; Note [Backend keys of a logical CPU].

    On a logical CPU the C++ tensor carries CPU's dispatch keys and asks
    Python for its device, as a FakeTensor does; on any other logical device
    it stays a plain meta tensor (Note [Logical device]).
    """
    if device.type == "cpu":
        return make_cpu_subclass(cls, elem, requires_grad)
    return _make_subclass(cls, elem, requires_grad)


# ``make_subclass``'s two cases without its Python frame, for the cache-hit path (core/hit.py).
make_cpu_subclass = functools.partial(_make_subclass, dispatch_device=True, device_for_backend_keys=_CPU)
make_meta_subclass = _make_subclass


def shallow_copy_compatible(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a.data = b`` is allowed by C++ (``set_data``): the same kind of
    TensorImpl -- a logical CPU's (CPU keys) and another device's (meta keys) are not."""
    return torch._has_compatible_shallow_copy_type(a, b)


meta_in_tls_dispatch_include = torch._C._meta_in_tls_dispatch_include
set_meta_in_tls_dispatch_include = torch._C._set_meta_in_tls_dispatch_include


def legacy_tensor_type(t):
    """The legacy tensor type (``torch.cuda.HalfTensor``) a class or its name means."""
    names = {f"{c.__module__}.{c.__name__}": c for c in torch._tensor_classes}
    cls = names.get(t) if isinstance(t, str) else (t if t in torch._tensor_classes else None)
    if cls is None:
        raise ValueError(f"invalid type: {t!r}")
    return cls


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch transform's wrapper (``grad``, ``vmap`` levels)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``Tensor::suggest_memory_format()``: the layout C++ kernels keep."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(t)


def storage_id(storage) -> int:
    """An integer that is equal for the Python objects of one C++ storage."""
    return storage._cdata


def storage_key(t: torch.Tensor) -> int:
    """An integer that is equal for tensors sharing one storage."""
    return t.untyped_storage()._cdata


def set_version(t: torch.Tensor, version: int) -> None:
    """Put back a tensor's version counter (autograd's in-place check reads it)."""
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def copy_math_bits(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give ``dst`` ``src``'s conjugate and negative bits (a lazy ``conj()``'s view)."""
    torch._C._set_conj(dst, src.is_conj())
    torch._C._set_neg(dst, src.is_neg())


def is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor: DTensor's sharding propagation runs ops on them, under
    FakeTensorMode, inside whatever mode watches a real run."""
    return isinstance(t, FakeTensor)


# nn.Module's private walk behind named_parameters/named_buffers, which a
# subclass that names its tensors its own way overrides (binding/inputs.py).
module_named_members = torch.nn.Module._named_members
