"""The dispatcher and dispatch modes: the mode slot MetaMode takes, its flags, kernels and decompositions an op has.

Part of ``metadispatch._compat`` (its docstring says why private torch APIs live here alone).
"""

from __future__ import annotations

import torch
import torch.utils._python_dispatch as _python_dispatch
import torch.utils.checkpoint

# Excludes the Python dispatch keys for the duration: kernels called inside
# run on the meta backend directly and never re-enter a mode or subclass.
no_python_dispatch = torch._C._DisableTorchDispatch


push_mode = torch._C._push_on_torch_dispatch_stack
disabled_torch_function = torch._C._disabled_torch_function_impl
only_lift_cpu_tensors = torch._C._only_lift_cpu_tensors
set_only_lift_cpu_tensors = torch._C._set_only_lift_cpu_tensors


def pop_mode() -> object:
    return torch._C._pop_torch_dispatch_stack(torch._C._TorchDispatchModeKey.FAKE)


def dispatch_mode_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def has_meta_kernel(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")


def as_at_the_backend():
    """A guard under which a ``CompositeImplicitAutograd`` body, run from a
    Python dispatch mode, sees the keys it sees when the backend runs it:
    the Python key's fallback leaves out every key above it, ADInplaceOrView
    among them, so the body's views of a parameter would not require grad and
    ``matmul`` would not fold (Note [Composites that reach the mode] in
    core/dispatch.py)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.ADInplaceOrView)
    return torch._C._ForceDispatchKeyGuard(include, exclude)


def has_implicit_composite(name: str) -> bool:
    """Whether ``name`` (``aten::linear``) is a ``CompositeImplicitAutograd`` op on CPU and CUDA:
    its composite kernel is the backend's (``silu_backward`` has one too, for other backends)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeImplicitAutograd") and not has(name, "CPU") and not has(name, "CUDA")


def runs_on(func, device_type: str) -> bool:
    """Whether ``func`` (an OpOverload) has a kernel for ``device_type``, composites included."""
    schema = func._schema
    name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS", "xpu": "XPU"}.get(device_type, device_type.upper())
    try:
        return torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, key)
    except RuntimeError:  # a key this torch does not know: let the call say so
        return True


def decomposition_table() -> dict:
    from torch._decomp import decomposition_table as table

    return table


def library(ns: str, kind: str):
    """A ``torch.library.Library`` whose registrations ``_destroy()`` removes."""
    return torch.library.Library(ns, kind)


def python_meta_kernel(func):
    """torch's Python meta function for ``func`` (``torch._meta_registrations``), or None."""
    from torch._decomp import global_decomposition_table

    return global_decomposition_table["meta"].get(func)


def op_callable(func):
    """The C++ callable behind an OpOverload, minus one Python frame per call."""
    return getattr(func, "_op", func)


def registered_op_names() -> frozenset:
    """``ns::op.overload`` (``ns::op`` for a default overload) of every operator
    the dispatcher knows now: a lookup that creates nothing and imports nothing."""
    return frozenset(torch._C._dispatch_get_all_op_names())


# Note [Logical CUDA without CUDA]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's Python bindings initialise CUDA (``torch.cuda._lazy_init``) for any
# factory, ``torch.tensor`` or ``.to()`` that names a CUDA device, before
# dispatch reaches a mode; on a host without usable CUDA that raises.  torch
# skips that step -- and nothing else -- while the FAKE dispatch-mode slot is
# taken, which is where FakeTensorMode lives.  MetaMode takes the same slot
# (``mode_key``), so "cuda" works on a CPU-only host and no global state is
# patched.  The slot is also torch's infra-mode position: user modes entered
# around a MetaMode (FlopCounterMode, logging modes) see every op first, as
# they do with FakeTensorMode.  One consequence: MetaMode and FakeTensorMode
# cannot be active at once.
mode_key = torch._C._TorchDispatchModeKey.FAKE
get_infra_mode = torch._C._get_dispatch_mode
unset_infra_mode = torch._C._unset_dispatch_mode
set_infra_mode = torch._C._set_dispatch_mode


def call_without_infra_mode(fn, args, kwargs):
    """``fn(*args, **kwargs)`` with the FAKE slot's mode out of it for the duration."""
    mode = get_infra_mode(mode_key)
    # fmt: off
    unset_infra_mode(mode_key)
    try: return fn(*args, **kwargs)  # noqa: E701
    finally: set_infra_mode(mode)  # noqa: E701
    # fmt: on


# Note [What a mode entry changes in torch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Entering a dispatch mode sets three flags in torch.utils._python_dispatch
# besides the mode slot; MetaMode sets and restores them itself so that modes
# left out of order leave them as they were before the first one.
_MODE_FLAGS = (
    "_is_in_torch_dispatch_mode",
    "_is_in_non_infra_torch_dispatch_mode",
    "_is_in_any_mode_without_ignore_compile_internals",
)


def dispatch_mode_flags() -> tuple:
    return tuple(getattr(_python_dispatch, name) for name in _MODE_FLAGS)


def set_dispatch_mode_flags(flags: tuple) -> None:
    for name, value in zip(_MODE_FLAGS, flags):
        setattr(_python_dispatch, name, value)
    _python_dispatch.set_is_in_mode_without_ignore_compile_internals(flags[2])


def aten_names_with_kernel(key: str) -> frozenset[str]:
    """The aten op names (overload dropped) with a kernel registered at
    dispatch key ``key`` for some overload (``"AutocastCUDA"``,
    ``"CompositeImplicitAutograd"``)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return frozenset(
        op[6:].split(".")[0] for op in torch._C._dispatch_get_all_op_names() if op.startswith("aten::") and has(op, key)
    )


# Dispatch below the autograd keys for the duration (a custom autograd
# Function's forward calling an op whose meta-backend entry is its composite).
below_autograd = torch._C._AutoDispatchBelowAutograd


def data_dependent_errors() -> tuple:
    """The exceptions torch's fake machinery raises for a size that depends on data."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
