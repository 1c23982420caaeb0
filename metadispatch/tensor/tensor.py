"""MetaTensor: a tensor that holds no data but reports a real device.

Note [Logical device]
~~~~~~~~~~~~~~~~~~~~~
A MetaTensor *is* a meta tensor at the C++ level (its storage has no data),
made a Python subclass with ``_make_subclass``.  The device a real tensor would
live on -- ``cpu``, ``cuda:1`` -- is kept in Python (``_md.device``) and
reported by the ``device`` property.  We do not give the C++ tensor that
device: on a CPU-only build autograd then asks for a CUDA device guard and
aborts the process (FakeTensorMode does exactly that on a backward pass "on
cuda" without CUDA).  While a meta kernel runs, ``device`` answers ``meta``,
so torch's Python meta registrations, which read ``t.device``, build their
outputs on meta; see ``in_kernel``.

On a logical CPU the C++ tensor carries CPU's dispatch keys and reports
``cpu`` to C++ as well, so torch's C++ makes CPU's choices (autocast, RNN and
attention kernels) itself (Note [Backend keys of a logical CPU] in
``_compat/tensors.py``).

Because the C++ tensor's storage is an ordinary meta storage, meta kernels run on it
directly: views share its storage, and in-place ops that change metadata
(``resize_``, ``unsqueeze_``, ``t_``) change it in place, as on a real tensor.

Note [MetaTensor in one module]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The class, the Tensor methods it overrides (``.data``, ``.to``, ``.numpy``
and the other value reads, the storage-level calls it refuses) and the
helpers those call (``read_value``, the per-thread dispatch state, the
wiring to the dispatcher) are one module: the helpers read a MetaTensor's
state and the overrides call them, so split they would import each other.
Converting a real tensor, which only makes MetaTensors, is convert.py.
"""

from __future__ import annotations

import copy
import threading

import torch

from .. import _compat
from ..errors import DataDependentError, UnsupportedFeatureError, mark_call
from ..ir.records import type_str
from ..source import user_frame
from .state import TensorState

__all__ = [
    "MetaTensor",
    "in_kernel",
    "is_wrapper_subclass",
    "value_of",
    "read_value",
    "note_value_read",
    "value_reads",
    "WIRING",
]

META = torch.device("meta")


class _State(threading.local):
    in_kernel = False
    ambient = torch.device("cpu")  # the device of the last op's tensors
    explicit_meta = False  # inside ``MetaTensor.to("meta")``; Note [Meta from options]
    named_device = False  # inside ``torch.zeros(..., device=D)``; Note [A factory's named device]


STATE = _State()


class in_kernel:
    """Run meta kernels: Python dispatch off, ``MetaTensor.device`` is meta.

    A class rather than a generator context manager: it runs on every call
    that reaches a kernel, and this is several times cheaper.
    """

    __slots__ = ("_prev", "_guard", "_meta")

    def __enter__(self):
        self._prev = STATE.in_kernel
        STATE.in_kernel = True
        self._guard = _compat.no_python_dispatch()
        self._guard.__enter__()
        # A logical-CPU MetaTensor carries CPU's backend keys; Meta in the
        # thread's included keys outranks them, so meta kernels run.
        self._meta = _compat.meta_in_tls_dispatch_include()
        _compat.set_meta_in_tls_dispatch_include(True)

    def __exit__(self, *exc):
        _compat.set_meta_in_tls_dispatch_include(self._meta)
        self._guard.__exit__(*exc)
        STATE.in_kernel = self._prev


def is_wrapper_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass with its own ``__torch_dispatch__`` (DTensor), other than ours.

    It holds no storage a stand-in could share; its own dispatch runs its
    calls on its inner tensors (Note [Wrapper subclasses dispatch first] in
    dispatch.py).
    """
    cls = type(t)
    return (
        cls is not torch.Tensor
        and cls is not torch.nn.Parameter
        and cls is not MetaTensor
        and cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
        and not _compat.is_fake(t)
    )


def normalize_device(device) -> torch.device:
    if type(device) is int and not _compat.host_cuda_available():
        # Note [An int device is the logical GPU's index]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # torch reads ``device=1`` as index 1 of the host's accelerator, and
        # raises where there is none; the machine a trace models has CUDA
        # (``torch.cuda.is_available()`` answers True under a logical GPU),
        # so it is ``cuda:1``, and is checked as ``"cuda:1"`` would be.
        # ``torch.device(1)`` itself is C++'s: it still raises on such a host.
        device = torch.device("cuda", device)
    d = torch.device(device)
    if d.index is None and d.type not in ("cpu", "meta"):
        # A real CUDA factory puts "cuda" on the current device; on a host
        # without CUDA that is device 0.
        idx = torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_available() else 0
        d = torch.device(d.type, idx)
    return d


def wrap(elem: torch.Tensor, device: torch.device, requires_grad: bool = False) -> MetaTensor:
    """Make a MetaTensor sharing ``elem``'s (meta) storage and metadata."""
    t = _compat.make_subclass(MetaTensor, elem, requires_grad, device)
    t._md = TensorState(device)
    return t


def _data_error(what: str):
    def method(self, *args, **kwargs):
        value = read_value(self)  # Note [Known values] in known.py
        if value is not None and self._md.known[1].assumed:
            _assumed_read(self, what, value)
        if value is None:
            value = _made_up_value(self, what)
        if value is not None:
            # The value is ours, not the user's, and real: neither the
            # torch-function nor the dispatch mode may see it (``numpy()``
            # calls ``detach``, which the mode would answer with a
            # MetaTensor, and numpy would then read no data).
            with _compat.no_torch_function(), _compat.no_python_dispatch():
                return getattr(value, what)(*args, **kwargs)
        raise DataDependentError(
            f"Tensor.{what}() needs the values of a {_describe(self)} MetaTensor, which holds no data", op=what
        )

    method.__name__ = what
    return method


# Note [Storage-level calls on a MetaTensor]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``model.share_memory()`` (every ``torch.multiprocessing`` recipe) and
# ``t.pin_memory()`` (with no accelerator; Note [Pinned memory on a
# logical host] in rules/pinned.py) act on a tensor's storage, not on its metadata: they
# move its bytes into shared or page-locked memory.  A MetaTensor's storage
# is torch's ``meta`` one, which holds no bytes, and torch refused with a raw
# "_share_fd_: only available on CPU" or "cannot pin 'MetaFloatType'" from
# deep inside its storage code -- blaming a CPU tensor for not being on the
# CPU.  They raise UnsupportedFeatureError naming the call, the tensor and
# the user's line; nothing is changed, the user's real tensors least of all.
def _storage_error(what: str, instead: str):
    def method(self, *args, **kwargs):
        error = UnsupportedFeatureError(
            f"Tensor.{what}() on a {_describe(self)} MetaTensor: it moves a tensor's bytes, and a MetaTensor "
            f"holds none (Note [Storage-level calls on a MetaTensor]). {instead}"
        )
        mark_call(error, f"Tensor.{what}", user_frame())
        raise error

    method.__name__ = what
    return method


def _made_up_value(t, what: str) -> torch.Tensor | None:
    """Under ``md.check``, a made-up value for a read that no op answers
    (Note [Made-up values under md.check] in check.py), else None."""
    for mode in reversed(_compat.dispatch_mode_stack()):
        read = getattr(mode, "read_fallback", None)
        if read is not None:
            return read(t, what)
    return None


def _assumed_read(t, what: str, value) -> None:
    """Tell a declared policy that lists such reads (``md.RoutingAssumption``:
    Note [Dispatching under a declared routing] in values/routing.py) that
    ``Tensor.<what>()`` read a value that follows from its declaration."""
    for mode in reversed(_compat.dispatch_mode_stack()):
        listed = getattr(getattr(mode, "assume", None), "value_read", None)
        if listed is not None:
            with _compat.no_torch_function(), _compat.no_python_dispatch():
                listed(f"Tensor.{what}", value)
            return


def _describe(t: torch.Tensor) -> str:
    try:
        return type_str(t.dtype, t.shape, device=t._md.device, show_cpu=True)
    except Exception:  # repr-path helper: must never raise
        return "<MetaTensor>"


def value_of(t) -> torch.Tensor | None:
    """The real value of a MetaTensor, or None when it is not known (Note [Known values] in known.py)."""
    kv = t._md.known if isinstance(t, MetaTensor) else None
    if kv is None or not kv[1].valid:
        return None
    return kv[0]


class _Reads(threading.local):
    count = 0


_READS = _Reads()


def value_reads() -> int:
    """How many answers on this thread were computed from a known value so far.

    The cache compares it before and after routing a call: an answer that
    read a value is not a function of the metadata, and is not cached
    (Note [What the key must hold] in cache.py).
    """
    return _READS.count


def note_value_read() -> None:
    """Count an answer computed from known values (see :func:`value_reads`)."""
    _READS.count += 1


def read_value(t) -> torch.Tensor | None:
    """:func:`value_of`, for code that computes an answer from the value."""
    value = value_of(t)
    if value is not None:
        _READS.count += 1
    return value


# Note [Wiring]
# ~~~~~~~~~~~~~
# MetaTensor is the bottom of core: the dispatcher, the router, the cache
# and known values all build on it.  Yet a MetaTensor needs two things from
# above: ``__torch_dispatch__`` must reach the dispatcher (dispatch.py), and
# ``.to()`` and the router must run nested calls under a non-recording mode
# (mode.py).  Rather than import them inside functions (an import cycle
# hidden from import time, and ~1.4 us a call on the hot path), mode.py,
# the top of core, hands both down once when the package is imported.  They
# are attributes of this module's object, not global torch state.
class _Wiring:
    __slots__ = ("dispatch", "scratch_mode", "function")

    def __init__(self) -> None:
        self.dispatch = self.scratch_mode = self.function = _unwired


def _unwired(*args, **kwargs):
    raise RuntimeError("metadispatch.core was imported partially: import metadispatch")


WIRING = _Wiring()


def _dense_across(t: MetaTensor, value: MetaTensor) -> bool:
    """Whether ``t.data = value`` is one a real run allows between dense
    devices (CPU and CUDA) that C++ refuses for the two MetaTensors; meta
    stays refused, as for real tensors."""
    devices = (t._md.device.type, value._md.device.type)
    return "meta" not in devices and not _compat.shallow_copy_compatible(t, value)


def _swap_data(t: MetaTensor, value: MetaTensor) -> None:
    """Note [Data across logical devices]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``param.data = param.to("cuda")`` on a real CPU tensor swaps in CUDA
    data (FSDP2 moves its parameters so).  A MetaTensor on a logical CPU has
    CPU's dispatch keys and one on a logical GPU meta's (Note [Backend keys
    of a logical CPU] in _compat/tensors.py), which C++'s ``set_data``
    refuses to mix.  Then the C++ tensors are swapped instead, as FSDP2
    does for a tensor subclass: ``t`` takes ``value``'s TensorImpl (sharing
    its storage) and keeps its own Python state, ``requires_grad`` and
    identity; the logical device and record follow as for ``set_data``.
    """
    state, requires_grad = dict(t.__dict__), t.requires_grad
    torch.utils.swap_tensors(t, value.detach())
    t.__dict__.clear()
    t.__dict__.update(state)
    t.requires_grad_(requires_grad)


class MetaTensor(torch.Tensor):
    """A tensor with shape, dtype, strides and device, but no data.

    >>> import torch, metadispatch as md
    >>> x = md.to_meta(torch.ones(2, 3), device="cuda:1")
    >>> x
    MetaTensor(f32[2, 3], device='cuda:1')
    >>> (x @ x.T).shape, (x @ x.T).device
    (torch.Size([2, 2]), device(type='cuda', index=1))
    """

    _md: TensorState  # Note [A MetaTensor's state] in state.py

    def __new__(cls, data=None, requires_grad: bool = True, **state):
        """Note [Rebuilding a parameter by its type]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Libraries rebuild a parameter as ``type(p)(data, **p.__dict__)`` so
        that a Parameter subclass keeps its class: accelerate's
        ``init_empty_weights`` does it for every parameter it moves to meta.
        Under a mode ``nn.Parameter(x)`` is a MetaTensor flagged ``_is_param``
        (Parameter's own ``__new__`` for a tensor subclass), so ``type(p)`` is
        this class and ``p.__dict__`` holds our state (``_is_param``,
        ``_md``), and torch's constructor refused it.  It is taken as the
        ``nn.Parameter(data, requires_grad)`` it stands for: ``data`` detached
        as ``Parameter.__new__`` does it (so the mode records what
        ``nn.Parameter`` records), flagged a parameter, with its own record.
        Any other keyword is refused as ``nn.Parameter`` refuses it, and a
        real ``data`` too: only a mode knows the device and the trace to
        convert it for.
        """
        extra = sorted(k for k in state if k != "_is_param" and not k.startswith("_md"))
        if extra:
            raise TypeError(f"MetaTensor.__new__() got an unexpected keyword argument {extra[0]!r}")
        if not isinstance(data, MetaTensor):
            raise TypeError(
                "MetaTensor(data, requires_grad) rebuilds a parameter from a MetaTensor "
                "(Note [Rebuilding a parameter by its type]); "
                f"got {type(data).__name__}: use md.to_meta or a MetaMode to make one"
            )
        out = data.detach().requires_grad_(requires_grad)
        out._is_param = True
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Note [Composite overrides without a mode] in mode.py
        return WIRING.function(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return WIRING.dispatch(func, args, kwargs or {}, None)  # Note [Wiring]

    # -- the logical device (Note [Logical device])
    @property
    def device(self) -> torch.device:
        return META if STATE.in_kernel else self._md.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    def get_device(self) -> int:
        d = self.device
        return -1 if d.type == "cpu" else (d.index or 0)

    # ``param.data = other`` swaps the C++ tensor but not Python attributes;
    # carry the logical device across (nn.Module._apply relies on this), and
    # the trace's record: the tensor now *is* ``other``'s data, so a later
    # call reads ``other``'s id -- with its own, ``m.double()`` inside a step
    # recorded every use of the weight as the f32 original.
    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        if isinstance(value, MetaTensor) and _dense_across(self, value):
            _swap_data(self, value)
        else:
            torch.Tensor.data.__set__(self, value)
        if isinstance(value, MetaTensor):
            # The device and the record move; the name (this tensor is still
            # ``param fc.weight``) stays.
            mine, theirs = self._md, value._md
            mine.device = theirs.device
            if theirs.recorder is not None:
                mine.recorder, mine.meta, mine.call = theirs.recorder, theirs.meta, theirs.call

    def to(self, *args, **kwargs):
        # Real tensors return themselves from .to() when nothing changes; the
        # C++ check compares against the meta device, so decide here.
        # _parse_to does not take ``copy`` (keyword, or the bool positional
        # after ``non_blocking``); Tensor.to does.
        copy = kwargs.pop("copy", False) if "copy" in kwargs else False
        if args and isinstance(args[0], MetaTensor):
            # to(other) means other's device and dtype; _parse_to would read
            # its C++ device, meta.
            args = (args[0]._md.device, args[0].dtype) + args[1:]
        if args and type(args[0]) is int:  # Note [An int device is the logical GPU's index]
            args = (normalize_device(args[0]), *args[1:])
        if type(kwargs.get("device")) is int:
            kwargs = dict(kwargs, device=normalize_device(kwargs["device"]))
        flags = [i for i, a in enumerate(args) if isinstance(a, bool)]
        if len(flags) == 2:
            copy, args = args[flags[1]], args[: flags[1]] + args[flags[1] + 1 :]
        device, dtype, non_blocking, memory_format = _compat.parse_to(*args, **kwargs)
        same_device = device is None or normalize_device(device) == self._md.device
        same_dtype = dtype is None or dtype == self.dtype
        if same_device and same_dtype and not copy and memory_format in (None, torch.preserve_format):
            return self
        # Re-issued with the device's index filled in: torch's C++ would ask a
        # CUDA device guard for it, and a CPU-only build has none.
        target = {"non_blocking": non_blocking, "copy": copy}
        if device is not None:
            target["device"] = normalize_device(device)
        if dtype is not None:
            target["dtype"] = dtype
        if memory_format is not None:
            target["memory_format"] = memory_format
        if (
            device is not None
            and device.type not in ("cpu", "meta")
            and _compat.get_infra_mode(_compat.mode_key) is None
        ):
            # Outside any MetaMode torch's binding would initialise CUDA for
            # the target first (Note [Logical CUDA without CUDA]): convert
            # under a non-recording mode, which spares that.
            with WIRING.scratch_mode():
                return super().to(**target)
        if device is None or device.type != "meta":
            return super().to(**target)
        # To meta from another logical device: the C++ tensor is on meta
        # already, so force the copy, and mark it as really meant
        # (Note [Meta from options] in dispatch.py).
        prev, STATE.explicit_meta = STATE.explicit_meta, True
        try:
            return super().to(**dict(target, copy=True))
        finally:
            STATE.explicit_meta = prev

    def type(self, dtype=None, non_blocking=False, **kwargs):
        """``"torch.cuda.FloatTensor"`` for the logical device (C++ would say
        ``torch.meta...`` off CPU); given a dtype or a tensor type (class or
        name), convert as a real tensor would."""
        if dtype is None:
            name = torch.Tensor.type(self)
            return (
                name.replace("torch.meta.", f"torch.{self._md.device.type}.", 1)
                if self._md.device.type not in ("cpu", "meta")
                else name
            )
        if isinstance(dtype, torch.dtype):
            return self.to(dtype, non_blocking=non_blocking)
        cls = _compat.legacy_tensor_type(dtype)
        if cls.is_sparse:
            raise NotImplementedError("MetaTensor supports strided tensors only, got a sparse type")
        on = "cuda" if cls.is_cuda else "cpu"
        device = self._md.device if self._md.device.type == on else torch.device(on)
        return self.to(device, cls.dtype, non_blocking=non_blocking)

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self.to(
            torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"),
            non_blocking=non_blocking,
            memory_format=memory_format,
        )

    def cpu(self, memory_format=torch.preserve_format):
        return self.to("cpu", memory_format=memory_format)

    def __repr__(self, *, tensor_contents=None) -> str:
        extra = ", requires_grad=True" if self.requires_grad else ""
        if self.grad_fn is not None:
            extra = f", grad_fn=<{type(self.grad_fn).__name__}>"
        return f"MetaTensor({_describe(self).rsplit('@', 1)[0]}, device='{self._md.device}'{extra})"

    tolist = _data_error("tolist")
    numpy = _data_error("numpy")
    __array__ = _data_error("__array__")
    share_memory_ = _storage_error(
        "share_memory_", "Call model.share_memory() on the real model before tracing or building under the mode"
    )
    _refuse_pin = _storage_error(
        "pin_memory", "Pin the real tensors before tracing, or leave pin_memory off while tracing"
    )

    def pin_memory(self, *args, **kwargs):
        # With an accelerator (a logical GPU answers for one) pinning is
        # traced as torch dispatches it (Note [Pinned memory on a logical
        # host] in rules/pinned.py); without one torch refuses to pin.
        if not (torch.cuda.is_available() or torch.accelerator.is_available()):
            return self._refuse_pin()
        if self.is_pinned():  # torch's own pin_memory: is_pinned, then _pin_memory
            return self
        return torch.ops.aten._pin_memory.default(self, *args, **kwargs)

    def __reduce_ex__(self, protocol):
        raise TypeError("a MetaTensor holds no data and cannot be pickled; save a trace instead")

    def __deepcopy__(self, memo):
        """A ``clone``: an aten call, so a recording mode records the copy.

        torch's own ``__deepcopy__`` copies the storage unless the device is
        meta -- ours says the logical device -- and then fails to put a CPU
        storage under a meta tensor; ``nn.TransformerEncoder`` deep-copies its
        layer at construction.  As a clone, the copy is in the construction
        trace and ``md.materialize`` gives it the original's values.  Our
        bookkeeping attributes (``_md*``: recorder, name, known value) are not
        copied; the parameter flag and the user's attributes are.
        """
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if not key.startswith("_md"):
                setattr(new, key, copy.deepcopy(value, memo))
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        return new
