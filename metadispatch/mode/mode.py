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
from collections.abc import Callable

import torch
from torch import nn

from .. import _compat
from ..core import rngstate
from ..core.cache import MetaCache
from ..core.dispatch import dispatch
from ..core.record import Recorder
from ..errors import MetaDispatchError
from ..gpu import (
    cuda_answers,
    gpu_composites,  # noqa: F401  (registers its overrides)
    logical_cuda,
)
from ..ir.trace import Trace
from ..spec.profiles import GPUProfile, gpu_profile, gpu_profiles
from ..standins.standins import StandIns
from ..tensor.convert import Converter
from ..tensor.tensor import STATE, WIRING, MetaTensor, normalize_device
from ..values import composites, known
from ..world.world import World
from . import patches, realcode, unseen
from .entry import Entry, activate, deactivate
from .fakecompat import check_from_tensor_options, check_mode_options
from .modules import ModuleStack
from .swap import SWAP
from .swap import WIRING as SWAP_WIRING

__all__ = ["MetaMode", "scratch_mode"]

_CPU = torch.device("cpu")


_PRIM_DEVICE = torch.ops.prim.device.default
_FUNCTION_STACK_LEN = _compat.function_stack_len
_FUNCTION_STACK_AT = _compat.function_stack_at


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
    ``assume`` declares values the trace cannot compute, as
    ``md.GenerateAssumptions(token_id=0)`` does for ``model.generate()``
    (Note [Generating under declared assumptions] in values/assume.py).
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
        assume=None,
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
        self._saved: list = []  # per __enter__, an Entry: what __exit__ undoes
        self.fallback: Callable | None = None  # set by md.check: answers ops no stage can
        # Set by md.check: the value of a tensor read outside any op (``tolist``).
        self.read_fallback: Callable | None = None
        # A declared assumption policy's state (``md.tracer(assume=...)``,
        # values/assume.py): answers token ops and the reads it names.
        self.assume = assume.start(self) if assume is not None else None
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
        n = _FUNCTION_STACK_LEN()
        if n and _FUNCTION_STACK_AT(n - 1) is SWAP:
            # A backward's engine runs with the function mode pushed (Note
            # [Backward under the function mode] in _compat/autograd.py); the call and
            # its rules run without it, as every call in a forward does.
            return _compat.call_without_function_mode(SWAP, dispatch, func, args, kwargs or {}, self)
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
            and meta._md.known is None
            and meta._md.name is None
        ):
            known.know(meta, t, self)
            if meta._md.device != t.device:
                # Note [Where the user's tensor is] in composites.py
                meta._md.user_device = t.device
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
        entry = Entry()
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

    def _install(self, entry: Entry) -> None:
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
        standins = StandIns(self)  # Note [Everything a forward can change] in standins/snapshot.py
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
        entry.steps.append(functools.partial(deactivate, entry))
        activate(self, entry)

    def _note_stop(self, entry: Entry, exc_type) -> None:
        if exc_type is not None and entry.tracker is not None:
            # A forward that raised never ran its post-hook: the modules it
            # was in are still the tracker's parents.
            self.stopped_in = entry.tracker.current()

    def _leave(self, entry: Entry) -> None:
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


def active_profile() -> GPUProfile:
    """The GPU profile a logical GPU answers as in this thread: the active
    MetaMode's, or the default where none is active (rules that choose what a
    GPU would run: attention, convolution layouts)."""
    mode = _compat.get_infra_mode(_compat.mode_key)
    profile = mode.device_profile if isinstance(mode, MetaMode) else None
    return profile if profile is not None else gpu_profile()


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
    off, outputs unwrapped.  Inside a mode, ``SwapReal`` answers first and
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
SWAP_WIRING.mode_type = MetaMode
WIRING.dispatch = dispatch
WIRING.scratch_mode = scratch_mode
WIRING.function = _function
rngstate.WIRING.current = _current_rng_log
unseen.WIRING.active = lambda: isinstance(_compat.get_infra_mode(_compat.mode_key), MetaMode)
realcode.WIRING.active = lambda: (lambda m: m if isinstance(m, MetaMode) else None)(
    _compat.get_infra_mode(_compat.mode_key)
)
