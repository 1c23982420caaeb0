"""Process-wide state: counted claims, the garbage collector's thresholds, dynamo's stance, RNG states, locks.

Part of ``metadispatch._compat`` (its docstring says why private torch APIs live here alone).
"""

from __future__ import annotations

import gc
import importlib
import sys
import threading

import torch
import torch.utils.checkpoint

# torch's C module, for the ledger's patches of functions on it (mode/ledger.py).
torch_c = torch._C


# Note [Garbage collection during tracing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A trace allocates a few small records per call, all long-lived, so CPython's
# full collections come due while tracing -- and each one walks every object
# in the process (torch, transformers, the model): 200-300 ms each with a
# 32-layer LLaMA loaded, more than the trace itself.  While a MetaMode is
# entered the oldest generation's threshold is raised out of reach, so only
# the young generations are collected (what the trace made lately); on exit
# the threshold is put back and a full collection comes due as it would have.
# An earlier version moved the heap into the permanent generation instead
# (``gc.freeze``), but ``gc.unfreeze`` returns everything to the oldest
# generation without counting it as pending: objects alive at entry that died
# later (the previous mode's trace) were never collected, and a loop of mode
# entries grew ~6 KB an entry without bound.  A threshold the user changed
# while the mode was entered is left as they set it.
#
# The youngest generation's threshold is raised too (700 -> 10,000
# allocations): every young collection moves what is alive at that moment --
# the trace's records, the tensors and autograd nodes in flight -- one
# generation up, and what reaches the oldest counts towards the next full
# collection.  At CPython's 700 a GPT-2 fw+bw trace (2,124 calls) ran ~24
# young collections and one full collection every seven traces (14% of its
# time); at 10,000 it runs about one young collection and none full, and what
# a trace drops is mostly freed by reference counting before any collection
# sees it.  Cyclic garbage is still collected, every 10,000 allocations.
# ``md.trace`` holds the same claim from before it saves the user's modules
# to after it restores them, so those walks do not set off the full
# collection the trace itself made due.
def call_locked(lock, fn, *args):
    """``fn(*args)`` holding ``lock``, released whatever line an interrupt hits.

    ``with lock:`` is not: Python reports the ``with`` line again before
    calling ``__exit__``, and an interrupt raised there skips the release
    (Note [Interrupts in mode entry and exit] in mode.py).
    """
    return call_inside(lock.acquire, lock.release, fn, args)


def call_inside(enter, leave, fn, args):
    enter()
    # fmt: off
    try: result = fn(*args); leave()  # noqa: E701,E702
    except BaseException: leave(); raise  # noqa: E701,E702
    # fmt: on
    return result


class CountedClaim:
    """A process-wide change held while at least one claim is entered.

    Each subclass counts its claims across threads under its own lock: the
    first entry calls ``_first()``, the last exit ``_last()``.  Each instance
    counts once, however often its ``__exit__`` runs, and every line leaves
    the counters consistent (Note [Interrupts in mode entry and exit] in
    mode.py): a retried exit finishes what an interrupted one began.
    """

    _lock: threading.Lock
    _users: int

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._lock = threading.Lock()
        cls._users = 0

    def __init__(self) -> None:
        self._in = False

    def __enter__(self):
        call_locked(type(self)._lock, self._enter)
        return self

    def __exit__(self, *exc):
        call_locked(type(self)._lock, self._exit)

    def _enter(self) -> None:
        cls = type(self)
        if cls._users == 0:
            self._first()
        if not self._in:
            # fmt: off
            cls._users += 1; self._in = True  # noqa: E702
            # fmt: on

    def _exit(self) -> None:
        cls = type(self)
        if self._in:
            # fmt: off
            cls._users -= 1; self._in = False  # noqa: E702
            # fmt: on
        if cls._users == 0:
            self._last()

    def _first(self) -> None:
        raise NotImplementedError

    def _last(self) -> None:
        raise NotImplementedError


class deferred_full_gc(CountedClaim):
    """The first entry raises the youngest and oldest generations' thresholds,
    the last exit restores them (Note [Garbage collection during tracing])."""

    OUT_OF_REACH = 1 << 30
    YOUNG = 10_000
    _saved: tuple | None = None
    _set: tuple | None = None

    def _first(self) -> None:
        cls = deferred_full_gc
        if cls._saved is None:
            t = gc.get_threshold()
            # fmt: off
            cls._saved = t; cls._set = (t[0] and max(t[0], cls.YOUNG), t[1], cls.OUT_OF_REACH); gc.set_threshold(*cls._set)  # noqa: E702,E501 (0: collection off, left off)
            # fmt: on

    def _last(self) -> None:
        cls = deferred_full_gc
        if cls._saved is not None:
            if gc.get_threshold() == cls._set:
                gc.set_threshold(*cls._saved)
            cls._saved = None


# Note [Compiled code runs eagerly under a mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A ``torch.compile``d module called under a MetaMode made dynamo compile it
# again for MetaTensors (a graph per input it had not seen, 20 s cold for a
# two-layer MLP), and the trace then held what AOT autograd's runtime
# wrapper ran -- its own views of the parameters, made outside any mode --
# rather than the program the user wrote.  While a MetaMode is entered,
# dynamo's stance is ``force_eager`` (``torch.compiler.set_stance``): compiled
# functions and modules run their Python eagerly, so the trace is the eager
# program the module compiles, in the eager module's time.  The stance is
# process-wide in torch; it is set by the first entry anywhere and put back
# by the last exit, through the ledger (another thread's compiled code runs
# eagerly meanwhile: same values, eager speed).  Nothing is done when dynamo was never imported
# (then nothing is compiled) or when the mode is entered inside a region
# dynamo is compiling (torch refuses a stance change there).
def _dynamo_frames():
    return sys.modules.get("torch._dynamo.eval_frame")  # None: dynamo never imported, nothing compiled


def _force_eager(below):
    frames = _dynamo_frames()
    callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
    if callback is not False and callback is not None:
        return below  # inside a torch.compile region: torch refuses a stance change there
    return frames.DynamoStance("force_eager")


# The ledger's row (mode/ledger.py, mode/patches.py): a process-wide value.
EAGER_COMPILED = [
    (
        _dynamo_frames,
        "_stance",
        _force_eager,
        "dynamo's stance: force_eager (Note [Compiled code runs eagerly under a mode])",
    )
]


# Note [Foreach paths for MetaTensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Optimizers (``_default_to_fused_or_foreach``) and ``clip_grad_norm_``
# (``_has_foreach_support``) take their ``foreach`` path only for tensors
# whose type is in a list torch keeps, and a MetaTensor's was not: on a
# logical GPU AdamW took the single-tensor path a real GPU does not take
# (peak 13.9% low on a 168M LLaMA), and on a logical CPU
# ``clip_grad_norm_`` did the same.  The device still decides, as for a
# real tensor: the optimizers' foreach devices are CUDA's kind, so a
# logical CPU keeps the single-tensor path eager takes.  While a MetaMode
# is entered anywhere the type is in both lists (as DTensor puts itself
# there for good); the last exit takes it out.  Real tensors' answers are
# unchanged, in every thread.
class foreach_types(CountedClaim):
    """Note [Foreach paths for MetaTensors]; ``cls`` is the MetaTensor type."""

    _type: type | None = None

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def _lists(self) -> list:
        # (torch.optim's __init__ deletes the name of its ``optimizer`` module.)
        names = ("torch.optim.optimizer", "torch.utils._foreach_utils")
        return [importlib.import_module(name)._foreach_supported_types for name in names]

    def _first(self) -> None:
        foreach_types._type = self.cls
        for types_ in self._lists():
            if self.cls not in types_:
                types_.append(self.cls)

    def _last(self) -> None:
        cls, foreach_types._type = foreach_types._type, None
        for types_ in self._lists():
            while cls is not None and cls in types_:
                types_.remove(cls)


def rng_states() -> tuple:
    """The CPU generator's state, and each CUDA generator's once CUDA is initialised."""
    # The generator's own methods, not torch.get_rng_state: a recording mode
    # patches those (core/rngstate.py), and these reads are not the user's.
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.default_generator.get_state(), cuda


def set_rng_states(states: tuple) -> None:
    cpu, cuda = states
    torch.default_generator.set_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def generator_key(g: torch.Generator) -> int:
    """The C++ generator behind a ``torch.Generator``: the dispatcher hands
    Python code a new wrapper object for the same generator on each call."""
    return g._cdata  # type: ignore[attr-defined]  # not in torch's stubs


def module_global_hooks() -> tuple:
    """torch's process-global module and optimizer hook tables, for tests of leaks."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (
        module._global_forward_pre_hooks,
        module._global_forward_hooks,
        module._global_backward_pre_hooks,
        module._global_backward_hooks,
        optimizer._global_optimizer_pre_hooks,
        optimizer._global_optimizer_post_hooks,
    )


# torch.nn.init's truncated-normal body, which every trunc_normal_ caller
# reaches by module attribute (Note [Data-dependent initialisers] in spec/ownops.py).
def trunc_normal_body():
    return torch.nn.init._no_grad_trunc_normal_


# The attribute of torch.nn.init the ledger replaces (values/initializers.py).
TRUNC_NORMAL_BODY_NAME = "_no_grad_trunc_normal_"


def default_device_type() -> str:
    """The type of torch's default device (``torch.set_default_device``, a
    ``torch.device`` context), read without making a tensor: the index
    ``torch.get_default_device`` asks for needs one, and on a host without
    CUDA that initialises CUDA and fails."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return torch.device(mode.device).type
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return torch.device(context.device).type if context is not None else "cpu"


def host_cuda_available() -> bool:
    """Whether this host has a CUDA device, asked of the C++ runtime.

    Not ``torch.cuda.is_available``: with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``
    (Lightning sets it on import) that calls ``torch.cuda.device_count`` by
    its module global, which a logical GPU answers (gpu/cuda_answers.py), so
    inside a mode it said True on a host without CUDA.  The count is asked
    once and kept: a process's CUDA devices do not come and go."""
    global _HOST_CUDA
    if _HOST_CUDA is None:
        compiled = hasattr(torch._C, "_cuda_getDeviceCount")
        _HOST_CUDA = bool(compiled and torch._C._cuda_getDeviceCount() > 0)
    return _HOST_CUDA


_HOST_CUDA: bool | None = None
