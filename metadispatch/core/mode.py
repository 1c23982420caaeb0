"""MetaMode: a dispatch mode under which every tensor op is traced on meta.

FakeTensor-style: factory functions return MetaTensors, real tensors reaching
an op are converted (memoised, never written), and every call is recorded in
``mode.trace``.  Entering installs torch's module-tracking hooks for module
attribution; leaving removes them and restores what entering changed, also
when an exception escapes.
"""

from __future__ import annotations

import threading

import torch

from .. import _compat
from . import composites, known
from .dispatch import dispatch
from .cache import MetaCache
from ..errors import MetaDispatchError
from .fakecompat import check_from_tensor_options, check_mode_options
from .modules import ModuleStack
from .record import Recorder
from .tensor import STATE, WIRING, Converter, MetaTensor, normalize_device
from ..ir.trace import Trace

__all__ = ["MetaMode", "scratch_mode"]

_CPU = torch.device("cpu")


class MetaMode(_compat.TorchDispatchMode):
    """Trace every aten call on MetaTensors; see the module docstring.

    >>> import torch, metadispatch as md
    >>> with md.MetaMode(device="cuda") as mode:
    ...     w = torch.empty(4, 3)
    ...     y = torch.nn.functional.relu(w @ w.T)
    >>> y
    MetaTensor(f32[4, 4], device='cuda:0')
    >>> print(mode.trace)
    $0: f32[4, 3]@cuda:0 = aten.empty.memory_format([4, 3], device='cuda:0', pin_memory=False)
    $1: f32[3, 4]{1, 3}@cuda:0 = aten.permute.default($0, [1, 0])
    $2: f32[4, 4]@cuda:0 = aten.mm.default($0, $1)
    $3: f32[4, 4]@cuda:0 = aten.relu.default($2)
    """

    def __init__(self, device=None, *, stack: bool = False, record: bool = True,
                 const_limit: int = 4096, cache: bool = True,
                 known_limit: int = known.DEFAULT_LIMIT, **fake_options) -> None:
        check_mode_options(fake_options)  # FakeTensorMode's options; see fakecompat.py
        super().__init__()
        self.device = normalize_device(device) if device is not None else None
        self.stack = stack
        self.record = record
        self.trace = Trace()
        self._recorder = Recorder(self.trace, stack=stack, const_limit=const_limit)
        self._converter = Converter(self.device)
        self._depth = 0  # > 0 while a rule or decomposition runs nested
        self.cache = MetaCache() if cache else None
        self._saved: list = []  # per __enter__, what __exit__ restores
        self.fallback = None  # set by md.check: answers ops no stage can
        self._mode_key = _compat.mode_key  # Note [Logical CUDA without CUDA]
        # Constants up to this many elements carry their real value (known.py).
        self.known_limit = known_limit
        # The innermost module running when an exception left the mode ("" at
        # top level); None when none did.  md.check's report names it.
        self.stopped_in: str | None = None
        # The GPU whose answers a rule gives where torch's depend on the
        # hardware; None: torch's own meta answers.  Part of the cache key
        # (cache.context); a ``gpu=`` option will set it.
        self.device_profile = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {}, self)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo,
        # which costs more per call than our whole cache hit.  Nothing in a
        # MetaMode is meant to be compiled.
        return False

    def from_tensor(self, t: torch.Tensor, **fake_options) -> MetaTensor:
        """The MetaTensor standing in for real tensor ``t`` (always the same one)."""
        check_from_tensor_options(fake_options)
        meta = self._converter(t)
        if meta is not t:
            self._recorder.real_of[id(meta)] = t
        return meta

    def from_scope(self, t: torch.Tensor) -> MetaTensor:
        """The stand-in for a real tensor that reached an op from the user's
        scope (a closure, a global, an index): :meth:`from_tensor`, knowing
        its value while small, as a constant's (Note [Known values])."""
        meta = self.from_tensor(t)
        if (meta is not t and not t.requires_grad and t.device.type != "meta"
                and "_md_known" not in meta.__dict__ and "_md_name" not in meta.__dict__):
            known.know(meta, t, self)
        return meta

    def __enter__(self):
        outer = _compat.unset_infra_mode(_compat.mode_key)
        if outer is not None and not isinstance(outer, MetaMode):
            _compat.set_infra_mode(outer)
            raise MetaDispatchError(
                f"MetaMode cannot be entered inside {type(outer).__name__}: both take torch's "
                "FAKE dispatch-mode slot; leave that mode first")
        if self.trace.rng_state is None:
            self.trace.rng_state = torch.get_rng_state()
        tracker = ModuleStack() if self.record else None
        heap = _compat.frozen_heap().__enter__() if self.record else None
        lift = _compat.only_lift_cpu_tensors()
        # torch.tensor(..., device="cuda") builds on CPU first and then moves,
        # so that no CUDA is needed; FakeTensorMode does the same.
        _compat.set_only_lift_cpu_tensors(True)
        composites.acquire()  # Note [Composite overrides]
        try:
            if tracker is not None:
                tracker.__enter__()
            result = super().__enter__()
        except BaseException:
            composites.release()
            if heap is not None:
                heap.__exit__(None, None, None)
            _compat.set_only_lift_cpu_tensors(lift)
            if tracker is not None:
                tracker.__exit__(None, None, None)
            if outer is not None:
                _compat.set_infra_mode(outer)
            raise
        # The device C++ composites' factories fall back on (Note [Meta from
        # options] in dispatch.py) starts afresh with each mode: a device left
        # by an earlier mode must not leak into this one's answers.
        ambient, STATE.ambient = STATE.ambient, self.device or _CPU
        self._saved.append((tracker, self._recorder.modules, lift, outer, heap, ambient))
        if tracker is not None:
            self._recorder.modules = tracker
        return result

    def __exit__(self, exc_type, exc, tb):
        tracker, modules, lift, outer, heap, ambient = self._saved.pop()
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            STATE.ambient = ambient
            composites.release()
            if heap is not None:
                heap.__exit__(None, None, None)  # Note [Garbage collection during tracing]
            _compat.set_only_lift_cpu_tensors(lift)
            self._recorder.modules = modules
            if tracker is not None:
                if exc_type is not None:
                    # A forward that raised never ran its post-hook: the
                    # modules it was in are still the tracker's parents.
                    self.stopped_in = tracker.current()
                tracker.__exit__(None, None, None)
                self.trace.modules.update(tracker.classes)
            if outer is not None:
                # A nested MetaMode replaces the outer one while it is active.
                _compat.set_infra_mode(outer)


class _Scratch(threading.local):
    mode = None


_SCRATCH = _Scratch()


def scratch_mode() -> MetaMode:
    """A non-recording mode for running rules on MetaTensors outside any mode."""
    if _SCRATCH.mode is None:
        _SCRATCH.mode = MetaMode(record=False)
    return _SCRATCH.mode


# Note [Wiring] in tensor.py: MetaTensor reaches the dispatcher and the scratch mode through these.
WIRING.dispatch = dispatch
WIRING.scratch_mode = scratch_mode
