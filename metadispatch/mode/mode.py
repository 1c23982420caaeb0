"""MetaMode: a dispatch mode under which every tensor op is traced on meta.

FakeTensor-style: factory functions return MetaTensors, real tensors reaching
an op are converted (memoised, never written), and every call is recorded in
``mode.trace``.  Entering installs torch's module-tracking hooks for module
attribution; leaving removes them and restores what entering changed, also
when an exception escapes.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from types import FunctionType

import torch
from torch import nn

from .. import _compat
from .._compat import pytree
from ..core import rngstate
from ..core.cache import MetaCache
from ..core.dispatch import dispatch
from ..core.record import Recorder
from ..errors import MetaDispatchError, UnsupportedFeatureError, mark_call
from ..gpu import (
    autocast,
    cuda_answers,
    gpu_composites,  # noqa: F401  (registers its overrides)
    inside,
    logical_cuda,
)
from ..ir.trace import Trace
from ..source import user_frame
from ..spec.profiles import GPUProfile, gpu_profile, gpu_profiles
from ..tensor.tensor import STATE, WIRING, Converter, MetaTensor, normalize_device, with_real_tensor
from ..values import composites, known, literals
from ..world.world import World
from . import patches, unseen
from .fakecompat import check_from_tensor_options, check_mode_options
from .modules import ModuleStack
from .standins import StandIns

__all__ = ["MetaMode", "scratch_mode"]

_CPU = torch.device("cpu")


_PRIM_DEVICE = torch.ops.prim.device.default
_FUNCTION_STACK_LEN = _compat.function_stack_len


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

    On a logical CUDA device the mode answers as a GPU of profile ``gpu``
    (default ``"h100"``, :func:`metadispatch.gpu_profile`) where torch's
    answer depends on the hardware: ``F.scaled_dot_product_attention``
    records the backend that GPU runs with the installed torch.
    """

    def __init__(
        self,
        device=None,
        *,
        stack: bool = False,
        record: bool = True,
        const_limit: int = 4096,
        cache: bool = True,
        known_limit: int = known.DEFAULT_LIMIT,
        gpu: str | GPUProfile | None = None,
        world_size: int | None = None,
        rank: int = 0,
        **fake_options,
    ) -> None:
        check_mode_options(fake_options)  # FakeTensorMode's options; see fakecompat.py
        super().__init__()
        self.device = normalize_device(device) if device is not None else None
        self.stack = stack
        self.record = record
        self.trace = Trace()
        self._recorder = Recorder(self.trace, stack=stack, const_limit=const_limit)
        self._converter = Converter(self.device, hooks=True)
        self._depth = 0  # > 0 while a rule or decomposition runs nested
        self.cache = MetaCache() if cache else None
        self._saved: list = []  # per __enter__, an _Entry: what __exit__ undoes
        self.fallback: Callable | None = None  # set by md.check: answers ops no stage can
        # Set by md.check: the value of a tensor read outside any op (``tolist``).
        self.read_fallback: Callable | None = None
        self._mode_key = _compat.mode_key  # Note [Logical CUDA without CUDA]
        # Constants up to this many elements carry their real value (known.py).
        self.known_limit = known_limit
        # The innermost module running when an exception left the mode ("" at
        # top level); None when none did.  md.check's report names it.
        self.stopped_in: str | None = None
        # The GPU whose answers a rule gives where torch's depend on the
        # hardware (SDPA's backend, rules/attention.py): ``gpu``, and on a
        # logical CUDA device without one the default (profiles.DEFAULT_GPU);
        # None: torch's own meta answers.  Part of the cache key (cache.context).
        cuda = self.device is not None and self.device.type == "cuda"
        self.device_profile = gpu_profile(gpu) if gpu is not None or cuda else None
        self._gpu_named = gpu is not None
        if self.device_profile is not None:
            # A profile the user made and did not register travels with the
            # trace, so that md.memory(trace) and md.fits(trace) answer for it
            # (a saved trace keeps its name only).
            p = self.device_profile
            registered = gpu_profiles().get(p.name)
            if registered is not None and registered != p:
                # A saved trace names its profile; a file naming "h100" with
                # other figures would load as the registered one.
                raise MetaDispatchError(
                    f"gpu=: a profile named {p.name!r} is registered with other figures; give yours its own name "
                    f"(dataclasses.replace(..., name={p.name + '-mine'!r})) or register it with override=True"
                )
            self.trace.gpu = p.name if registered is not None else p
        # ``world_size=N, rank=r``: Note [One rank of a logical world] in world.py
        self.world = World(world_size, rank) if world_size is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE:
            # C++ asking a logical-CPU MetaTensor for its device, two or three
            # times per traced call (Note [Backend keys of a logical CPU]).
            return args[0].device
        if _FUNCTION_STACK_LEN() and _compat.top_function_mode() is _SWAP:
            # A backward's engine runs with the function mode pushed (Note
            # [Backward under the function mode] in _compat/autograd.py); the call and
            # its rules run without it, as every call in a forward does.
            return _compat.call_without_function_mode(_SWAP, dispatch, func, args, kwargs or {}, self)
        return dispatch(func, args, kwargs or {}, self)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo,
        # which costs more per call than our whole cache hit.  Nothing in a
        # MetaMode is meant to be compiled.
        return False

    def stand_in(self, t: torch.Tensor) -> torch.Tensor:
        """``from_tensor`` for plain real tensors and parameters; anything else as is.

        A real ``.grad`` is mirrored on a new stand-in, so code reading or
        accumulating it sees its metadata; the real one is never replaced.
        Only once: a stand-in whose ``.grad`` the step set to None keeps it
        None (``zero_grad()`` before the forward).
        """
        if type(t) is not torch.Tensor and type(t) is not nn.Parameter or _compat.is_functorch_wrapped(t):
            return t
        new = not self._converter.has(t)
        meta = self.from_scope(t)
        grad = t.grad
        if new and grad is not None and meta.grad is None and type(grad) is torch.Tensor:
            meta.grad = self.from_tensor(grad)
        return meta

    def from_tensor(self, t: torch.Tensor, **fake_options) -> MetaTensor:
        """The MetaTensor standing in for real tensor ``t`` (always the same one)."""
        check_from_tensor_options(fake_options)
        meta = self._converter(t)
        if meta is not t:
            self._recorder.note_real(meta, t)
        return meta

    def from_scope(self, t: torch.Tensor) -> MetaTensor:
        """The stand-in for a real tensor that reached an op from the user's
        scope (a closure, a global, an index): :meth:`from_tensor`, knowing
        its value while small, as a constant's (Note [Known values])."""
        meta = self.from_tensor(t)
        if (
            meta is not t
            and not t.requires_grad
            and t.device.type != "meta"
            and "_md_known" not in meta.__dict__
            and "_md_name" not in meta.__dict__
        ):
            known.know(meta, t, self)
            if meta._md_device != t.device:
                # Note [Where the user's tensor is] in composites.py
                meta._md_user_device = t.device
        return meta

    def cpu_constant(self, t: torch.Tensor) -> MetaTensor:
        """A logical-CPU stand-in, known by value, for a small real CPU tensor
        that C++ makes for a GPU op whatever the mode's device (Note [A Python
        number written into a GPU tensor] in composites.py)."""
        return self.constant_on(t, _CPU)

    def constant_on(self, t: torch.Tensor, device: torch.device) -> MetaTensor:
        """A stand-in on ``device``, known by value, for a small real tensor
        C++ made outside the trace (Note [A literal made on a device] in literals.py)."""
        converters = self.__dict__.setdefault("_constant_converters", {})
        converter = converters.get(device)
        if converter is None:
            converter = converters[device] = Converter(device)
        meta = converter(t)
        self._recorder.note_real(meta, t)
        known.know(meta, t, self)
        return meta

    def forget_reals(self) -> None:
        """Drop every reference to the real tensors converted so far.

        Note [No real tensor outlives the recording]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        The converter and the recorder refer to real tensors only weakly, and
        stand-ins are swapped in above autograd, so a trace's outputs and
        their autograd graph never keep the user's weights alive.  ``md.trace``
        also forgets the conversions when it is done: the same real tensor
        converted later gets a new stand-in.
        """
        self._converter.forget()
        for converter in self.__dict__.get("_constant_converters", {}).values():
            converter.forget()
        self._recorder.forget_reals()

    def __enter__(self):
        entry = _Entry()
        try:
            self._saved.append(entry)
            self._install(entry)
            return self
        except BaseException:
            self._leave(entry)
            raise

    def __exit__(self, exc_type, exc, tb):
        # Note [Interrupts in mode entry and exit]: the try's body shares its
        # line; without ``entry`` an interrupt hit that line before it ran.
        # fmt: off
        try: entry = self._saved[-1]; entry.leaving = True; self._note_stop(entry, exc_type); self._leave_unfinished()  # noqa: E501,E701,E702
        finally: self._leave_unfinished() if "entry" in locals() else self._leave(self._saved[-1])  # noqa: E701
        # fmt: on

    def _install(self, entry: _Entry) -> None:
        outer = _compat.get_infra_mode(_compat.mode_key)
        if outer is not None and not isinstance(outer, MetaMode):
            raise MetaDispatchError(
                f"MetaMode cannot be entered inside {type(outer).__name__}: both take torch's "
                "FAKE dispatch-mode slot; leave that mode first"
            )
        rngstate.start_states(self.trace)
        if self.trace.threads is None:  # Note [Threads in replay] in execution/replay.py
            self.trace.threads = torch.get_num_threads()
            self.trace.conv_switches = _compat.cpu_conv_switches()
        # Random ops that run for real (known values, md.check's fallback)
        # must not move the user's generators.
        entry.steps.append(functools.partial(_compat.set_rng_states, _compat.rng_states()))
        entry.steps.append(entry.restore_generators)
        if self.record:
            tracker = entry.tracker = ModuleStack()
            entry.steps.append(functools.partial(self.trace.modules.update, tracker.classes))
            entry.steps.append(tracker.close)
            tracker.__enter__()
            entry.steps.append(functools.partial(setattr, self._recorder, "modules", self._recorder.modules))
            self._recorder.modules = tracker
        # Note [The ledger] in ledger.py: what this mode replaces in torch, in its thread
        patches.claim_for(self, entry.steps)
        foreach = _compat.foreach_types(MetaTensor)  # Note [Foreach paths for MetaTensors]
        entry.steps.append(functools.partial(foreach.__exit__, None, None, None))
        foreach.__enter__()
        entry.steps.append(functools.partial(setattr, STATE, "ambient", STATE.ambient))
        STATE.ambient = self.device or _CPU
        standins = StandIns(self)  # Note [Everything a forward can change] in standins.py
        entry.steps.append(standins.__exit__)
        standins.__enter__()
        if self.world is not None:  # Note [One rank of a logical world] in world.py
            self.world.check_free()
            without_cuda = cuda_answers.gpu_like(self.device, True) and not cuda_answers.host_has_cuda()
            if without_cuda:
                logical_cuda.install(entry.steps, gpu_profile(self.device_profile))
            patches.claim_world(entry.steps, without_cuda)
            self.world.install(entry.steps, self.trace)
        if cuda_answers.wanted(self.device, self._gpu_named, self.world is not None):
            # Note [The logical GPU answers per thread]
            cuda_answers.enter(entry.steps, self, gpu_profile(self.device_profile))
            patches.claim_gpu(entry.steps)
        entry.steps.append(functools.partial(_deactivate, entry))
        _activate(self, entry)

    def _note_stop(self, entry: _Entry, exc_type) -> None:
        if exc_type is not None and entry.tracker is not None:
            # A forward that raised never ran its post-hook: the modules it
            # was in are still the tracker's parents.
            self.stopped_in = entry.tracker.current()

    def _leave(self, entry: _Entry) -> None:
        entry.leaving = True
        self._leave_unfinished()

    def _leave_unfinished(self) -> None:
        """Finish every entry whose exit began (idempotent)."""
        for entry in [e for e in self._saved if e.leaving]:
            entry.undo()
            if entry in self._saved:
                self._saved.remove(entry)

    def keep_generator(self, generator: torch.Generator) -> None:
        """Restore ``generator`` on exit: a real kernel may draw from it."""
        entries = [e for e in self._saved if not e.leaving]
        if entries:
            entries[-1].generators.setdefault(id(generator), (generator, generator.get_state()))


# Note [Interrupts in mode entry and exit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A KeyboardInterrupt can land between any two statements of __enter__ or
# __exit__, and whatever entering installed -- the mode slot, torch's mode
# flags, the gc threshold, the lift flag, hooks, the function mode -- must not
# outlive the mode.  So each change is preceded by an undo step that is safe
# to run whether or not the change happened, and safe to run twice:
# __enter__ undoes its entry if anything escapes; __exit__ marks the entry as
# leaving and runs its steps, and its ``finally`` runs whatever an interrupt
# cut short.  The exit's ``try`` and its body share a line: Python raises an
# interrupt at a line's first instruction, and a ``try:`` line of its own is
# outside the protected range.  Statements that must not be separated share
# a line for the same reason, and locks are taken with ``_compat.call_locked``
# (a ``with lock:`` can be interrupted between its body and the release).
#
# Which MetaMode holds the slot is derived, not saved: a per-thread list of
# active entries, in entry order.  Leaving one removes it wherever it is and
# hands the slot to the newest remaining, so two modes left out of order
# (two generators) leave nothing installed, as with torch's own modes.
class _Entry:
    """What one ``__enter__`` changed, as undo steps run newest first."""

    def __init__(self) -> None:
        self.steps: list = []
        self.leaving = False
        self.tracker: ModuleStack | None = None  # the ModuleStack this entry installed
        self.generators: dict = {}  # id -> (generator, state before its first use)

    def undo(self) -> None:
        while self.steps:
            # fmt: off
            self.steps[-1](); self.steps.pop()  # noqa: E702 (one line: Note above)
            # fmt: on

    def restore_generators(self) -> None:
        for generator, state in self.generators.values():
            generator.set_state(state)


class _Active(threading.local):
    def __init__(self) -> None:
        self.entries: list = []  # (mode, entry), oldest first
        self.before: tuple | None = None  # what the first entry found: torch's flags, the lift flag, the gc threshold


_ACTIVE = _Active()


def _activate(mode: MetaMode, entry: _Entry) -> None:
    active = _ACTIVE
    if not active.entries and active.before is None:
        flags, lift, heap = _compat.dispatch_mode_flags(), _compat.only_lift_cpu_tensors(), _compat.deferred_full_gc()
        active.before = (flags, lift, heap)
        if mode.record:
            heap.__enter__()  # Note [Garbage collection during tracing]
        # torch.tensor(..., device="cuda") builds on CPU first and then moves,
        # so that no CUDA is needed; FakeTensorMode does the same.
        _compat.set_only_lift_cpu_tensors(True)
        _compat.push_function_mode(_SWAP)
    active.entries.append((mode, entry))
    _compat.set_dispatch_mode_flags(
        (
            True,
            active.before[0][1] or not mode.is_infra_mode(),
            active.before[0][2] or not mode.ignore_compile_internals(),
        )
    )
    # fmt: off
    _compat.unset_infra_mode(_compat.mode_key); _compat.set_infra_mode(mode)  # noqa: E702
    # fmt: on


def _deactivate(entry: _Entry) -> None:
    active = _ACTIVE
    active.entries[:] = [(m, e) for m, e in active.entries if e is not entry]
    if active.entries:
        # Out of order: the newest remaining entry holds the slot.
        # fmt: off
        _compat.unset_infra_mode(_compat.mode_key); _compat.set_infra_mode(active.entries[-1][0])  # noqa: E702
        # fmt: on
        return
    _compat.unset_infra_mode(_compat.mode_key)
    if active.before is not None:
        flags, lift, heap = active.before
        _compat.remove_function_mode(_SWAP)
        _compat.set_only_lift_cpu_tensors(lift)
        _compat.set_dispatch_mode_flags(flags)
        heap.__exit__(None, None, None)
        active.before = None
        autocast.clear_cache()  # Note [Autocast on a logical GPU] in autocast.py


class _SwapReal(_compat.TorchFunctionMode):
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
        kwargs = kwargs or {}
        mode = _compat.get_infra_mode(_compat.mode_key)
        if isinstance(mode, MetaMode) and func not in _BY_IDENTITY:
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
            if func in literals.LITERALS and literals.applies(func, args, kwargs):
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
                STATE.ambient = first._md_device  # Note [Meta from options] in dispatch.py
            override = composites.override_for(func, args, kwargs)  # Note [Composite overrides]
            if override is not None:
                return override(*args, **kwargs)
            if (
                type(func) is FunctionType
                and type(first) is MetaTensor
                and first._md_device.type == "cuda"
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
        if types == _META_ONLY:
            # MetaTensor's own handler would only call func again: skip it
            # (Note [Composite overrides without a mode]).
            with _compat.no_torch_function_subclass():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


_META_ONLY = (MetaTensor,)


def active_profile() -> GPUProfile:
    """The GPU profile a logical GPU answers as in this thread: the active
    MetaMode's, or the default where none is active (rules that choose what a
    GPU would run: attention, convolution layouts)."""
    mode = _compat.get_infra_mode(_compat.mode_key)
    profile = mode.device_profile if isinstance(mode, MetaMode) else None
    return profile if profile is not None else gpu_profile()


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
        if type(t) is MetaTensor and t._md_device.type in on:
            kind = t._md_device.type
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


_SWAP = _SwapReal()


class _Scratch(threading.local):
    mode: MetaMode | None = None


_SCRATCH = _Scratch()


def scratch_mode() -> MetaMode:
    """A non-recording mode for running rules on MetaTensors outside any mode."""
    mode = _SCRATCH.mode
    if mode is None:
        mode = _SCRATCH.mode = MetaMode(record=False)
    return mode


def _current_rng_log():
    mode = _compat.get_infra_mode(_compat.mode_key)
    return mode._recorder.rng if isinstance(mode, MetaMode) and mode.record else None


def _function(func, args, kwargs):
    """Note [Composite overrides without a mode]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A MetaTensor used with no MetaMode entered must answer as inside one
    (issue 15).  The C++ composites that read a tensor's values through a
    data pointer (Note [Composite overrides] in composites.py) get their
    Python versions from the mode's torch-function mode; with no mode, from
    MetaTensor's own ``__torch_function__``, which calls this.  Anything
    else runs as torch's default handler runs it: with subclass handlers
    off, outputs unwrapped.  Inside a mode, ``_SwapReal`` answers first and
    calls the function with subclass handlers off, so this never runs there
    for MetaTensor-only calls.

    Cost: an overriding ``__torch_function__`` makes
    ``torch.overrides.has_torch_function`` true for a MetaTensor, so outside
    a mode the inference fast paths of ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` are not taken (inside one, fastpath.py
    answers as eager for MetaTensors).
    """
    if _compat.get_infra_mode(_compat.mode_key) is None:
        override = composites.override_for(func, args, kwargs)
        if override is not None:
            return override(*args, **kwargs)
    with _compat.no_torch_function_subclass():
        return func(*args, **kwargs)


# Note [Wiring] in tensor.py: MetaTensor reaches the dispatcher and the scratch mode through these.
WIRING.dispatch = dispatch
WIRING.scratch_mode = scratch_mode
WIRING.function = _function
rngstate.WIRING.current = _current_rng_log
unseen.WIRING.active = lambda: isinstance(_compat.get_infra_mode(_compat.mode_key), MetaMode)
