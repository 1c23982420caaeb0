"""The per-thread swap: real tensors reaching a torch function under a MetaMode become their stand-ins.

``SwapReal`` is a torch-function mode pushed on the thread's function stack
while a MetaMode is entered there (entry.py).  Above autograd, it hands
torch each real tensor's stand-in (Note [Swap above autograd] in
standins/standins.py), builds literals as the logical device would (values/literals.py),
applies CUDA's autocast policy on a logical GPU (autocast.py), calls the
composite overrides (composites.py), checks the devices factories and moves name (devices.py),
sees inside torch's Python functions
(inside.py), and runs backward under the mode (Note [Backward under the
function mode] in _compat/autograd.py).  Only this thread's calls meet it:
another thread sees the real tensors (Note [Other threads see the real
model] in standins/standins.py).
"""

from __future__ import annotations

import functools
import weakref
from types import FunctionType

import torch
from torch import nn

from .. import _compat
from .._compat import pytree
from ..errors import UnsupportedFeatureError, mark_call
from ..gpu import autocast, inside
from ..ir.records import type_str
from ..source import user_frame
from ..tensor.convert import with_real_tensor
from ..tensor.tensor import STATE, MetaTensor, normalize_device
from ..values import composites, literals
from . import devices, realcode

__all__ = ["SwapReal", "SWAP", "WIRING"]


class _Wiring:
    """What the swap needs of mode.py, which imports it: the MetaMode class."""

    def __init__(self) -> None:
        self.mode_type: type = type(None)


WIRING = _Wiring()


class SwapReal(_compat.TorchFunctionMode):
    """Note [Swap above autograd], for real tensors outside modules.

    A real tensor reaching a torch function under a MetaMode (a free
    parameter, ``F.linear(x, m.weight)``, ``p.grad = None``, ``x.add_(1)``)
    is replaced by its stand-in before autograd sees it: autograd then
    records no real leaf (no MetaTensor ``.grad`` on a real tensor, no real
    tensor kept alive by ``trace.output``'s graph), and ADInplaceOrView bumps
    the stand-in's version counter, not the real one's.  The dispatch mode
    still converts what reaches it another way.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        mode = _GET_MODE(_MODE_KEY)
        if (
            (func is _GETITEM or func is _SETITEM)
            and type(args[0]) is MetaTensor
            and isinstance(mode, WIRING.mode_type)
        ):
            if literals.has_int_list(args[1]):  # Note [A list as an index]
                args = (args[0], literals.index_lists(mode, args[0], args[1]), *args[2:])
            elif func is _GETITEM and (at := literals.basic_prefix(args[1])) is not None and not _has_real(args):
                return literals.index_after(mode, func, args, at)
        if (
            func not in _SPECIAL
            and func not in composites.BY_FUNCTION
            and isinstance(mode, WIRING.mode_type)
            and not _ANY_AUTOCAST()
            and not autocast.has_cache()
            and not _has_real(args)
            and (not kwargs or (kwargs.get("generator") is None and not _has_real(kwargs.values())))
        ):
            # Note [The plain call under the swap]
            # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
            # Most calls (every forward call of a model the mode built) have
            # no real tensor, no generator, no autocast and no function of
            # the ones handled below: all that is left of the walk below is
            # the ambient device and the call, without its twenty tests.
            first = args[0] if args else None
            if type(first) is MetaTensor:
                d = first._md.device
                STATE.ambient = d  # Note [Meta from options] in dispatch.py
                if d.type == "cuda" and type(func) is FunctionType:
                    return self._walk(
                        mode, func, types, args, kwargs or {}
                    )  # Note [Seeing inside torch's Python functions]
            if types == _META_ONLY:
                with _compat.no_torch_function_subclass():
                    return func(*args, **(kwargs or _NO_KWARGS))
            return func(*args, **(kwargs or _NO_KWARGS))
        return self._walk(mode, func, types, args, kwargs or {})

    def _walk(self, mode, func, types, args, kwargs):
        """Every case, in order (Note [Swap above autograd] in standins/standins.py)."""
        if isinstance(mode, WIRING.mode_type) and func not in _BY_IDENTITY:
            real = _has_real(args) or (kwargs and _has_real(kwargs.values()))
            real_first = None
            if real:
                real_first = args[0] if args else None
                args, kwargs = pytree.tree_map_only(torch.Tensor, mode.stand_in, (args, kwargs))
            if func is _POST_ACCUMULATE and type(real_first) in (torch.Tensor, nn.Parameter):
                # registered on a real parameter in the step: the hook gets it back
                args = (args[0], functools.partial(with_real_tensor, args[1], weakref.ref(real_first)), *args[2:])
            if func == _SET_DATA and mode.record and isinstance(args[1], MetaTensor):
                with _compat.no_python_dispatch():  # a constant's copy is made for real
                    mode._recorder.before_data_swap(args[0], args[1])
            if func in realcode.FROM_BYTES and realcode.reads_bytes(func, args):
                return realcode.from_bytes(mode, func, args, kwargs)  # Note [Tensors made from bytes inside a MetaMode]
            if func is devices.NEW_TENSOR and type(args[0]) is MetaTensor:
                func, args, kwargs = literals.as_tensor_call(args, kwargs)  # Note [new_tensor is a literal]
            if func in literals.LITERALS:
                args = literals.with_values(func, args)  # Note [Tensors inside a literal]
            if func in literals.LITERALS and kwargs.get("device") is not None:
                _, kwargs = devices.on_checked_device(mode, func, kwargs)  # Note [A factory's named device]
            if func in literals.LITERALS and literals.applies(mode, func, args, kwargs):
                return literals.build(mode, func, args, kwargs)  # Note [A literal made on a device]
            if real and func == _SET_DATA and isinstance(args[0], MetaTensor):
                # ``real.data = meta`` (``m.double()`` before the module's
                # first forward), ``meta.data = real``: MetaTensor's setter
                # carries the trace's record.
                args[0].data = args[1]
                return None
            if _compat.any_autocast():
                _refuse_autocast(func, args, kwargs)
                if func not in _BACKWARD and func is not _GRAD and autocast.applies(args, kwargs):
                    # Note [Autocast on a logical GPU] in autocast.py
                    func, args, kwargs, run_inside = autocast.prepare(func, args, kwargs)
                    if run_inside:
                        return _compat.call_with_function_mode(self, func, args, kwargs)
            elif autocast.has_cache():
                autocast.clear_cache()
            generator = kwargs.get("generator")
            if generator is not None:
                mode.keep_generator(generator)
            first = args[0] if args else None
            if type(first) is MetaTensor:
                STATE.ambient = first._md.device  # Note [Meta from options] in dispatch.py
            override = composites.override_for(func, args, kwargs)  # Note [Composite overrides]
            if override is not None:
                return override(*args, **kwargs)
            if (
                type(func) is FunctionType
                and type(first) is MetaTensor
                and first._md.device.type == "cuda"
                and func not in _BACKWARD
                and func is not _GRAD
                and not inside.reentered(func, args)
            ):
                # Note [Seeing inside torch's Python functions] in inside.py
                return _compat.call_with_function_mode(self, inside.see_inside(func, args), args, kwargs)
            if func in _BACKWARD:
                # Note [Backward under the function mode] in _compat/autograd.py
                func, args, kwargs = _compat.engine_backward, (self,), _BACKWARD[func](*args, **kwargs)
            elif func is _GRAD:
                func, args = _compat.engine_grad, (self, *args)
            elif func in _STAND_IN_METHODS and type(first) is MetaTensor:
                if func in devices.TO_GPU:
                    args, kwargs = devices.move_checked(mode, func, args, kwargs)  # Note [A factory's named device]
                # A real tensor's method (a MetaTensor's own never comes
                # here), now on its stand-in (Note [A real tensor's methods
                # on its stand-in]).
                out = _STAND_IN_METHODS[func](*args, **kwargs)
                if out is first and func in _MOVES and type(real_first) in (torch.Tensor, nn.Parameter):
                    # Moved to where its stand-in already is: the real tensor
                    # itself, as torch returns it, so that ``module.to`` keeps
                    # the user's buffers in the module, not stand-ins.
                    return real_first
                return out
            if func in devices.FACTORIES and (
                kwargs.get("device") is not None or kwargs.get("pin_memory") or inside.seeing_inside()
            ):
                if not types or types == _META_ONLY:
                    # As below: no handler but MetaTensor's could be asked, and the
                    # call's bookkeeping (the record of ``torch.tensor([], device=d)``'s
                    # lift_fresh: shape, strides, dim) then reads its getters without one.
                    with _compat.no_torch_function_subclass():
                        return devices.factory(mode, func, args, kwargs)
                return devices.factory(mode, func, args, kwargs)
            if (
                func in devices.LIKE
                and kwargs.get("device") is not None
                and normalize_device(kwargs["device"]).type == "meta"
            ):
                return devices.explicitly_meta(func, args, kwargs)  # Note [Meta from options] in core/dispatch.py
            if func is _DATA_PTR and type(first) is MetaTensor:
                pinned = first if first._md.pinned_by is not None else first._base
                if type(pinned) is MetaTensor and pinned._md.pinned_by is not None:
                    _refuse_address(first, pinned)
        if types == _META_ONLY:
            # MetaTensor's own handler would only call func again: skip it
            # (Note [Composite overrides without a mode]).
            with _compat.no_torch_function_subclass():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


_META_ONLY = (MetaTensor,)
_DATA_PTR = torch.Tensor.data_ptr


# Note [A pinned buffer's address]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A page-locked buffer made by a factory (``torch.empty(n, pin_memory=True)``)
# is made to be filled through its address: safetensors' ``safe_open(path,
# device="cuda")`` reads each tensor into one from Rust, through
# ``data_ptr()``, before copying it to the GPU.  A MetaTensor holds no bytes
# and its ``data_ptr()`` is 0 -- code that compares addresses (an RNN's
# ``flatten_parameters``, transformers' shared-tensor check) keeps that --
# but a write through it killed the process with a segfault.  So the
# address of such a buffer is refused, with UnsupportedFeatureError naming
# the factory and the user's line: the reader raises instead of writing.
# So is a view's (``buf[off:off + n]``, torch's ``_base`` the buffer), whose
# address C++ makes as the storage's, 0, plus its offset: a small non-null
# number, written through as readily.
def _refuse_address(t: MetaTensor, pinned: MetaTensor) -> None:
    view = "" if t is pinned else f"a view at offset {t.storage_offset()} of "
    error = UnsupportedFeatureError(
        f"Tensor.data_ptr() of {view}a {pinned._md.pinned_by} MetaTensor "
        f"({type_str(t.dtype, t.shape, device=t._md.device)}): "
        "a pinned buffer's address is where its bytes are written (safetensors' safe_open(device='cuda') does), "
        "and a MetaTensor holds none (Note [A pinned buffer's address]). Open the file with device='cpu': its "
        "tensors then stand in on the mode's device"
    )
    mark_call(error, "Tensor.data_ptr", user_frame())
    raise error


_NO_KWARGS: dict = {}
_GET_MODE = _compat.get_infra_mode
_GETITEM, _SETITEM = literals.GETITEM, torch.Tensor.__setitem__
_MODE_KEY = _compat.mode_key
_ANY_AUTOCAST = _compat.any_autocast


# Note [Autocast on other logical devices]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# CUDA's autocast policy is applied to a logical GPU above autograd (Note
# [Autocast on a logical GPU] in autocast.py).  Other logical devices' autocast
# (xpu, mps) casts nothing for a MetaTensor, which is a meta tensor to C++, and
# is not modelled: a torch function given a tensor on such a device while
# its autocast is on is refused, naming the function and the user's line,
# rather than traced as the float32 program the device does not run.
_AUTOCAST_LOGICAL = ("xpu", "mps")


def _refuse_autocast(func, args, kwargs) -> None:
    on = [d for d in _AUTOCAST_LOGICAL if torch.is_autocast_enabled(d)]
    if not on:
        return
    for t in pytree.tree_leaves((args, kwargs)):
        if type(t) is MetaTensor and t._md.device.type in on:
            kind = t._md.device.type
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            error = UnsupportedFeatureError(
                f"{name}: torch.autocast({kind!r}) on a logical {kind} device is not modelled (Note "
                f"[Autocast on other logical devices], docs/logical-cuda.md): torch casts only tensors on a real "
                f"{kind} device, so the trace would leave out the {torch.get_autocast_dtype(kind)} casts "
                f"and describe a float32 program the GPU does not run. Trace without autocast (a model "
                "cast with .to(torch.bfloat16) runs its matmuls in bf16 too), or autocast on a logical "
                "CPU, which is exact"
            )
            mark_call(error, name, user_frame())
            raise error


def _tensor_backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> dict:
    return {
        "tensors": self,
        "grad_tensors": gradient,
        "retain_graph": retain_graph,
        "create_graph": create_graph,
        "inputs": inputs,
    }


def _autograd_backward(
    tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None
) -> dict:
    grads = grad_tensors if grad_variables is None else grad_variables
    return {
        "tensors": tensors,
        "grad_tensors": grads,
        "retain_graph": retain_graph,
        "create_graph": create_graph,
        "inputs": inputs,
    }


# Tensor.backward's and torch.autograd.backward's parameters as
# _compat.engine_backward's (Note [Backward under the function mode]).
_BACKWARD = {torch.Tensor.backward: _tensor_backward, torch.autograd.backward: _autograd_backward}
_GRAD = torch.autograd.grad  # its parameters are _compat.engine_grad's

# Dict keys and identities: a real tensor hashes as itself (optimizer state
# is keyed by the real parameters).
_BY_IDENTITY = {torch.Tensor.__hash__}
_POST_ACCUMULATE = torch.Tensor.register_post_accumulate_grad_hook
_SET_DATA = torch.Tensor.data.__set__  # a new method-wrapper at each access: compared with ==
# Tensor methods that read values outside aten (``idx.tolist()`` on a tensor
# from the user's scope): MetaTensor's own, which answer from a known value.
# Note [A real tensor's methods on its stand-in]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A real tensor's method or property reaching the mode (a module built
# outside a bare MetaMode and used inside it) runs on its stand-in; torch's
# own implementation of the ones MetaTensor overrides answers from the C++
# tensor -- ``.device`` said ``meta`` (``next(model.parameters()).device``,
# transformers' ``model.device``), ``.to("cuda")`` compared the C++ meta
# device and copied, through autograd for a parameter, whose device guard for
# CUDA fails on a CPU-only build -- or refuses a subclass (``tolist``).  So
# MetaTensor's own answers them.
_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)
_STAND_IN_METHODS = {
    **{getattr(torch.Tensor, name): getattr(MetaTensor, name) for name in ("tolist", "numpy", "__array__")},
    # Note [Storage-level calls on a MetaTensor] in tensor.py
    **{getattr(torch.Tensor, name): getattr(MetaTensor, name) for name in ("share_memory_", "pin_memory")},
    **{getattr(torch.Tensor, name): getattr(MetaTensor, name) for name in ("to", "cuda", "cpu", "get_device")},
    **{
        getattr(torch.Tensor, name).__get__: getattr(MetaTensor, name).fget
        for name in ("device", "is_cuda", "is_cpu", "is_meta")
    },
}


def _has_real(values) -> bool:
    for v in values:
        t = type(v)
        if t is torch.Tensor or t is nn.Parameter:
            return True
        if (t is list or t is tuple) and v and _has_real(v):
            return True
    return False


# The functions the walk treats as other than a plain call, whatever their
# arguments (the composite overrides are asked apart: they are registered
# later, by rule families).
_SPECIAL = frozenset(
    {
        *_BY_IDENTITY,
        _POST_ACCUMULATE,
        _SET_DATA,
        *realcode.FROM_BYTES,
        *literals.LITERALS,
        *_BACKWARD,
        _GRAD,
        *_STAND_IN_METHODS,
        *devices.FACTORIES,  # Note [A factory's named device]
        *devices.LIKE,  # their device named meta
        devices.NEW_TENSOR,  # Note [new_tensor is a literal]
        _DATA_PTR,  # Note [A pinned buffer's address]
    }
)

SWAP = SwapReal()
