"""Every private torch API metadispatch touches, in one place.

A torch upgrade that renames one of these should need a change here only.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "TorchDispatchMode",
    "WeakIdKeyDictionary",
    "make_subclass",
    "no_python_dispatch",
    "push_mode",
    "pop_mode",
    "dispatch_mode_stack",
    "has_meta_kernel",
    "decomposition_table",
    "in_backward",
    "disabled_torch_function",
    "only_lift_cpu_tensors",
    "set_only_lift_cpu_tensors",
    "storage_key",
    "op_callable",
]

make_subclass = torch.Tensor._make_subclass
# Excludes the Python dispatch keys for the duration: kernels called inside
# run on the meta backend directly and never re-enter a mode or subclass.
no_python_dispatch = torch._C._DisableTorchDispatch
push_mode = torch._C._push_on_torch_dispatch_stack
disabled_torch_function = torch._C._disabled_torch_function_impl
only_lift_cpu_tensors = torch._C._only_lift_cpu_tensors
set_only_lift_cpu_tensors = torch._C._set_only_lift_cpu_tensors


def pop_mode() -> object:
    return torch._C._pop_torch_dispatch_stack(None)


def dispatch_mode_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def has_meta_kernel(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")


def decomposition_table() -> dict:
    from torch._decomp import decomposition_table as table

    return table


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass."""
    return torch._C._current_graph_task_id() != -1


def op_callable(func):
    """The C++ callable behind an OpOverload, minus one Python frame per call."""
    return getattr(func, "_op", func)


def storage_key(t: torch.Tensor) -> int:
    """An integer that is equal for tensors sharing one storage."""
    return t.untyped_storage()._cdata


# Note [Logical CUDA without CUDA]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's Python bindings call ``torch.cuda._lazy_init()`` for any factory or
# ``.to()`` that names a CUDA device, before dispatch reaches a mode; on a host
# without usable CUDA that raises.  torch itself skips the call while a
# FakeTensorMode is active (a check in C++ we cannot join without pretending
# to be one).  So while a MetaMode is entered on such a host, ``_lazy_init``
# is replaced by a no-op and restored on exit.  One trace remains: torch
# caches "CUDA initialised" in C++, so on that host a later real CUDA call
# fails with "PyTorch is not linked with support for cuda devices" instead of
# "Torch not compiled with CUDA enabled".  Hosts with a GPU are untouched.
_CUDA_USABLE: list = []


def cuda_usable() -> bool:
    if not _CUDA_USABLE:
        _CUDA_USABLE.append(torch.cuda.is_available())
    return _CUDA_USABLE[0]


class allow_logical_cuda:
    """Context manager: see Note [Logical CUDA without CUDA]."""

    def __enter__(self):
        self._saved = None
        if not cuda_usable():
            import torch.cuda

            self._saved = torch.cuda._lazy_init
            torch.cuda._lazy_init = _no_lazy_init
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            import torch.cuda

            torch.cuda._lazy_init = self._saved


def _no_lazy_init() -> None:
    return None
