"""Every private torch API metadispatch touches, in one place.

A torch upgrade that renames one of these should need a change here only.
"""

from __future__ import annotations

import gc
import importlib
import sys
import threading
import types
from collections.abc import Mapping
from types import FrameType

import torch
import torch.distributed as dist
import torch.utils._python_dispatch as _python_dispatch
import torch.utils.checkpoint
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed import distributed_c10d
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "torch_c",
    "default_device_type",
    "dist",
    "distributed_c10d",
    "dtensor_class",
    "tensor_experimental_module",
    "FakeTensor",
    "FakeTensorMode",
    "CountedClaim",
    "EAGER_COMPILED",
    "OpOverload",
    "OpOverloadPacket",
    "pytree",
    "parse_to",
    "variable_functions",
    "python_bindings",
    "sdpa_entry",
    "TorchDispatchMode",
    "TorchFunctionMode",
    "WeakIdKeyDictionary",
    "make_subclass",
    "no_python_dispatch",
    "no_torch_function",
    "push_mode",
    "pop_mode",
    "dispatch_mode_stack",
    "has_meta_kernel",
    "runs_on",
    "decomposition_table",
    "python_meta_kernel",
    "suggest_memory_format",
    "library",
    "in_backward",
    "in_checkpoint_recompute",
    "disabled_torch_function",
    "no_torch_function_subclass",
    "only_lift_cpu_tensors",
    "set_only_lift_cpu_tensors",
    "storage_key",
    "op_callable",
    "data_dependent_errors",
    "registered_op_names",
    "autocast_state",
    "any_autocast",
    "sdp_switches",
    "conv_switches",
    "cpu_conv_switches",
    "set_cpu_conv_switches",
]

# torch's C module, for the ledger's patches of functions on it (mode/ledger.py).
torch_c = torch._C

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
        return _make_subclass(cls, elem, requires_grad, dispatch_device=True, device_for_backend_keys=_CPU)
    return _make_subclass(cls, elem, requires_grad)


meta_in_tls_dispatch_include = torch._C._meta_in_tls_dispatch_include
set_meta_in_tls_dispatch_include = torch._C._set_meta_in_tls_dispatch_include
# Excludes the Python dispatch keys for the duration: kernels called inside
# run on the meta backend directly and never re-enter a mode or subclass.
no_python_dispatch = torch._C._DisableTorchDispatch
# Tensor.to's argument parser: (device, dtype, non_blocking, memory_format).
parse_to = torch._C._nn._parse_to
# torch's C++ functions (torch.tensor_split, torch._VF.lstm, ...): what a
# torch-function mode sees as ``func`` for them.
variable_functions = torch._C._VariableFunctions
# Where torch's generated Python bindings live, searched in this order for an
# op's name (Note [Calling ops through their Python bindings] in execution/bindings.py).
python_bindings = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)
# F.scaled_dot_product_attention's C++ entry (rules/attention.py calls it plainly).
sdpa_entry = torch._C._nn.scaled_dot_product_attention
# Turns torch-function modes off for the duration: code that reads a real
# tensor under a MetaMode (conversion, hooks) sees it, not its stand-in.
no_torch_function = torch._C.DisableTorchFunction
no_torch_function_subclass = torch._C.DisableTorchFunctionSubclass
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


def select_conv_backend(x, weight, bias, bias_sizes, stride, padding, dilation, transposed, output_padding, groups):
    """The backend C++'s ``convolution`` would run for these arguments."""
    if bias_sizes is None:
        return torch._C._select_conv_backend(
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
    return torch._C._select_conv_backend(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, bias_sizes
    )


def conv_switches() -> tuple:
    """``(oneDNN enabled, NNPACK enabled, cuDNN enabled)``: the switches the
    convolution backend choice reads on CPU (``_select_conv_backend``) and on
    a logical GPU (Note [Convolution layouts on a logical GPU])."""
    return (torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled(), torch._C._get_cudnn_enabled())


def cpu_conv_switches() -> tuple:
    """``(oneDNN enabled, NNPACK enabled)``: the switches a CPU convolution picks its kernel by."""
    return (torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled())


def set_cpu_conv_switches(switches: tuple) -> None:
    """Set what :func:`cpu_conv_switches` reads."""
    torch._C._set_mkldnn_enabled(switches[0])
    torch._C._set_nnpack_enabled(switches[1])


def conv_backend_memory_format(x, weight, backend) -> torch.memory_format:
    """The memory format ``backend`` gives a convolution's outputs."""
    return torch._C._conv_determine_backend_memory_format(x, weight, backend)


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


# FA3 and the priority order are newer than torch 2.5: absent, FA3 is off and
# the order is at::Context's initial one (flash, efficient, math, cuDNN, overrideable).
_FA3_ENABLED = getattr(torch._C, "_get_fa3_sdp_enabled", lambda: False)
_SDP_PRIORITY = getattr(torch._C, "_get_sdp_priority_order", lambda: (1, 2, 0, 3, 4))


def sdp_switches() -> tuple:
    """``(flash, mem_efficient, math, cudnn, fa3, priority order, deterministic, warn only)``:
    every switch C++'s attention backend choice reads."""
    return (
        torch._C._get_flash_sdp_enabled(),
        torch._C._get_mem_efficient_sdp_enabled(),
        torch._C._get_math_sdp_enabled(),
        torch._C._get_cudnn_sdp_enabled(),
        _FA3_ENABLED(),
        tuple(_SDP_PRIORITY()),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


any_autocast = torch._C._is_any_autocast_enabled


def autocast_state() -> tuple | None:
    """None outside autocast (the common case, one C call); else, per device
    type, whether autocast is on and its dtype, and whether casts are cached."""
    if not torch._C._is_any_autocast_enabled():
        return None
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES) + (
        torch.is_autocast_cache_enabled(),
    )


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``Tensor::suggest_memory_format()``: the layout C++ kernels keep."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(t)


def python_meta_kernel(func):
    """torch's Python meta function for ``func`` (``torch._meta_registrations``), or None."""
    from torch._decomp import global_decomposition_table

    return global_decomposition_table["meta"].get(func)


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass."""
    return torch._C._current_graph_task_id() != -1


# Note [Checkpoint recompute]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.utils.checkpoint re-runs the forward during backward, with grad mode
# on (plain backward runs with it off unless ``create_graph``): reentrant
# checkpoint from ``CheckpointFunction.backward``, non-reentrant from a
# closure ``recompute_fn``.  Neither leaves a mark we could read cheaply, so
# for backward calls under grad mode we look for those frames.
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
_RECOMPUTE_FRAMES = ("backward", "recompute_fn")


def in_checkpoint_recompute() -> bool:
    """True while torch.utils.checkpoint recomputes a forward in backward."""
    if not torch.is_grad_enabled() or not in_backward():
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _RECOMPUTE_FRAMES and code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False


def op_callable(func):
    """The C++ callable behind an OpOverload, minus one Python frame per call."""
    return getattr(func, "_op", func)


next_sequence_nr = torch._C._autograd._get_sequence_nr
current_autograd_node = torch._C._current_autograd_node


def registered_op_names() -> frozenset:
    """``ns::op.overload`` (``ns::op`` for a default overload) of every operator
    the dispatcher knows now: a lookup that creates nothing and imports nothing."""
    return frozenset(torch._C._dispatch_get_all_op_names())


def storage_key(t: torch.Tensor) -> int:
    """An integer that is equal for tensors sharing one storage."""
    return t.untyped_storage()._cdata


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
    return _call_inside(lock.acquire, lock.release, fn, args)


def call_without_torch_function(fn, *args):
    """``fn(*args)`` with torch-function modes off, back on whatever line an interrupt hits."""
    guard = no_torch_function()
    return _call_inside(guard.__enter__, lambda: guard.__exit__(None, None, None), fn, args)


def torch_function_enabled() -> bool:
    return torch._C._is_torch_function_enabled()


def _call_inside(enter, leave, fn, args):
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


def function_mode_stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


# Note [Backward under the function mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch pops a torch-function mode off the stack while its handler runs, so
# ``loss.backward()`` reaching the MetaMode's function mode ran the autograd
# engine with no function mode: the engine captures the thread's state when
# it starts, and code it calls back into -- a checkpointed block recomputing
# its forward -- saw none of the mode's composite overrides.  On a logical
# GPU the recomputed attention then took the math kernel where the forward
# took the profile's fused one, and torch.utils.checkpoint refused the
# differing saved tensors.  So backward is run as ``torch.autograd.backward``
# runs it, from below its torch-function check, with the mode back on the
# stack (``engine_backward``), and ``torch.autograd.grad`` likewise
# (``engine_grad``: a gradient penalty through a checkpointed block failed
# the same way).  The calls the engine dispatches take the mode
# off again while the MetaMode answers them (``MetaMode.__torch_dispatch__``):
# rules, known values and md.check's real runs call torch functions, which
# must not be swapped or overridden there, as in a forward.
def engine_backward(mode, tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None) -> None:
    """``torch.autograd.backward``'s body below its torch-function check, with
    ``mode`` on the function-mode stack for the engine's run."""
    inputs_tuple = () if inputs is None else _roots(inputs)
    if inputs is not None and not inputs_tuple:
        raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    _run_engine(mode, _roots(tensors), grad_tensors, retain_graph, create_graph, inputs_tuple, True, True)


def _roots(x) -> tuple:
    """A tensor or gradient edge as a 1-tuple, a sequence of them as a tuple."""
    return (x,) if isinstance(x, (torch.Tensor, torch.autograd.graph.GradientEdge)) else tuple(x)


def _run_engine(mode, roots: tuple, grad_tensors, retain_graph, create_graph, inputs: tuple, unreachable, accumulate):
    """The engine's run ``backward`` and ``grad`` share: the roots'
    gradients made as torch makes them, then ``mode`` on the function-mode
    stack for the run."""
    autograd = torch.autograd
    grads = autograd._make_grads(
        roots, autograd._tensor_or_tensors_to_tuple(grad_tensors, len(roots)), is_grads_batched=False
    )
    push_function_mode(mode)
    try:
        return autograd.graph._engine_run_backward(
            roots,
            grads,
            create_graph if retain_graph is None else retain_graph,
            create_graph,
            inputs,
            allow_unreachable=unreachable,
            accumulate_grad=accumulate,
        )
    finally:
        remove_function_mode(mode)


def engine_grad(
    mode,
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph=None,
    create_graph=False,
    only_inputs=True,
    allow_unused=None,
    is_grads_batched=False,
    materialize_grads=False,
):
    """``torch.autograd.grad``'s body below its torch-function check, with
    ``mode`` on the function-mode stack for the engine's run (Note [Backward
    under the function mode]).  Batched gradients (``is_grads_batched``) and
    the arguments torch warns about or refuses go to torch's own ``grad``."""
    autograd = torch.autograd
    if is_grads_batched or not only_inputs or (isinstance(inputs, Mapping) and type(inputs) is not dict):
        # vmap's machinery, a deprecation warning, a TypeError: torch's own.
        return autograd.grad(
            outputs,
            inputs,
            grad_outputs,
            retain_graph,
            create_graph,
            only_inputs,
            allow_unused,
            True,
            materialize_grads,
        )
    if materialize_grads and allow_unused is False:
        raise ValueError(
            "Expected allow_unused to be True or not passed when materialize_grads=True, but got: allow_unused=False."
        )
    if allow_unused is None:
        allow_unused = materialize_grads
    inputs_tuple = tuple(inputs.values()) if type(inputs) is dict else _roots(inputs)
    if not inputs_tuple:
        raise RuntimeError("`inputs` argument to `grad()` cannot be empty.")
    result = _run_engine(
        mode, _roots(outputs), grad_outputs, retain_graph, create_graph, inputs_tuple, allow_unused, False
    )
    if materialize_grads:
        if any(r is None and not isinstance(i, torch.Tensor) for r, i in zip(result, inputs_tuple)):
            raise RuntimeError("materialize_grads cannot be used when the given input is a GradientEdge")
        result = tuple(
            r if r is not None else torch.zeros_like(i, requires_grad=create_graph)
            for r, i in zip(result, inputs_tuple)
        )
    return dict(zip(inputs.keys(), result)) if type(inputs) is dict else result


function_stack_len = torch._C._len_torch_function_stack


def top_function_mode():
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def call_without_function_mode(mode, fn, *args):
    """``fn(*args)`` with ``mode`` (the top of the function-mode stack) off it
    for the duration, as torch takes a mode off while its handler runs."""
    torch._C._pop_torch_function_stack()
    try:
        return fn(*args)
    finally:
        torch._C._push_on_torch_function_stack(mode)


def call_with_function_mode(mode, fn, args, kwargs):
    """``fn(*args, **kwargs)`` with ``mode`` pushed back on the function-mode
    stack for the duration (from inside its own handler, where torch took it off)."""
    torch._C._push_on_torch_function_stack(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        remove_function_mode(mode)


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


# torch.nn.functional's C bindings (``nll_loss_nd``, ``nll_loss``)
nn_functions = torch._C._nn


def push_function_mode(mode) -> None:
    torch._C._push_on_torch_function_stack(mode)


def remove_function_mode(mode) -> None:
    """Take ``mode`` off torch's function-mode stack, wherever it is (idempotent)."""
    stack = function_mode_stack()
    if all(m is not mode for m in stack):
        return
    above = []
    while True:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


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


def set_version(t: torch.Tensor, version: int) -> None:
    """Put back a tensor's version counter (autograd's in-place check reads it)."""
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


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


def data_dependent_errors() -> tuple:
    """The exceptions torch's fake machinery raises for a size that depends on data."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


# torch.nn.init's truncated-normal body, which every trunc_normal_ caller
# reaches by module attribute (Note [Data-dependent initialisers] in spec/ownops.py).
def trunc_normal_body():
    return torch.nn.init._no_grad_trunc_normal_


# The attribute of torch.nn.init the ledger replaces (values/initializers.py).
TRUNC_NORMAL_BODY_NAME = "_no_grad_trunc_normal_"


# -- torch.distributed (the logical world: world/world.py)
def fake_process_group_store():
    """A store for torch's ``fake`` backend, registering that backend first.

    The backend's creator is registered by importing torch's testing module;
    importing it here, on the first logical world, keeps that (and its second
    of import time) away from users who never ask for one.
    """
    from torch.testing._internal.distributed import fake_pg

    return fake_pg.FakeStore()


def process_group_of(obj):
    """The ProcessGroup a c10d op's boxed ``process_group`` argument holds."""
    return dist.ProcessGroup.unbox(obj)


def reduce_op_name(obj) -> str:
    """``"SUM"``, ``"AVG"``, ...: the op a c10d op's boxed ``reduce_op`` argument holds."""
    return dist.ReduceOp.RedOpType(obj.op()).name


def reduce_op(name: str):
    """The ``ReduceOp`` called ``name`` (the inverse of :func:`reduce_op_name`)."""
    return dist.ReduceOp.RedOpType.__members__[name]


def allgather_base(pg, output: torch.Tensor, input: torch.Tensor):
    """``pg``'s all-gather into one tensor (the method behind ``c10d._allgather_base_``); a Work."""
    return pg._allgather_base(output, input)


def reduce_scatter_base(pg, output: torch.Tensor, input: torch.Tensor, op):
    """``pg``'s reduce-scatter of one tensor (behind ``c10d._reduce_scatter_base_``); a Work."""
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = op
    return pg._reduce_scatter_base(output, input, opts)


def new_c10d_world():
    """A fresh registry of process groups, as torch.distributed starts with
    (a logical world's, in its thread: world/world.py)."""
    return distributed_c10d._World()


def named_process_groups() -> dict:
    """Every live process group -> its name (torch's registry of groups)."""
    return dict(distributed_c10d._world.pg_names)


def resolve_process_group(name: str):
    return distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]  # GroupName is a str


def is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor: DTensor's sharding propagation runs ops on them, under
    FakeTensorMode, inside whatever mode watches a real run."""
    return isinstance(t, FakeTensor)


def fsdp_param_module():
    """FSDP2's ``_fsdp_param`` module, whose ``free_storage``/``alloc_storage`` world/fsdp_storage.py wraps."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return _fsdp_param


resize_storage_bytes = torch.ops.inductor.resize_storage_bytes_.default

# A finished c10d Work around a future (rules/collectives.py).
work_from_future = torch._C._distributed_c10d._create_work_from_future  # type: ignore[attr-defined]


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding and redistribution plans (Note [One world at a time] in world/world.py)."""
    from torch.distributed.tensor import _redistribute, _sharding_prop
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()


def functional_collectives_module():
    """``torch.distributed._functional_collectives``, whose ``_are_we_tracing`` world/world.py answers."""
    from torch.distributed import _functional_collectives

    return _functional_collectives


# torch.distributed.tensor costs ~0.5 s to import (it pulls in sympy): only a
# logical world (world/world.py) needs it, so it is imported on first use.
def dtensor_class():
    from torch.distributed.tensor import DTensor

    return DTensor


def tensor_experimental_module():
    from torch.distributed.tensor import experimental

    return experimental


# Note [Reference kernels without dynamo in the command line]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch 2.13 answers many ops on meta tensors with Python reference kernels
# (``torch._refs.div``, ``exp``, ``cat``, ...) and wraps them, and
# ``Optimizer.zero_grad``, in ``torch._disable_dynamo``, whose first call
# imports ``torch._dynamo`` (~0.85 s of CPU, a quarter of ``metadispatch
# trace``) only to build a wrapper that matters while dynamo is tracing.
# The wrapper caches its answer in the function's ``__dynamo_disable``
# attribute; the command line, which owns its process,
# fills that cache with the function itself.  The functions are found by
# walking, from the modules that define them, every function's
# ``__wrapped__`` and closure (a reference's outer ``functools.wraps`` points
# ``__wrapped__`` at the prim, not at the wrapper).  One that the walk misses
# just imports dynamo as before.  The library never does this: it would
# change torch for the rest of the user's process.
_REFERENCE_MODULES = ("torch._refs", "torch._prims", "torch._decomp", "torch._meta_registrations", "torch.optim")


def skip_dynamo_in_reference_kernels() -> int:
    """For the command line's process only; returns how many wrappers were filled."""
    if "torch._dynamo" in sys.modules:
        return 0
    filled = 0
    for f in functions_behind_dynamo_wrappers():
        if not hasattr(f, "__dynamo_disable"):
            setattr(f, "__dynamo_disable", f)  # noqa: B010 (no name mangling wanted)
            filled += 1
    return filled


def functions_behind_dynamo_wrappers() -> list:
    """What ``torch._disable_dynamo`` wraps in torch's reference kernels and optimizers."""
    from torch._compile import _disable_dynamo
    from torch._decomp import global_decomposition_table

    code = _disable_dynamo(lambda: None).__code__
    cell = code.co_freevars.index("fn")
    seen: set = set()
    found = []
    stack: list = [
        v
        for m in list(sys.modules.values())
        if getattr(m, "__name__", "").startswith(_REFERENCE_MODULES)
        for v in vars(m).values()
    ]
    stack += [f for v in list(stack) if isinstance(v, type) for f in vars(v).values()]
    stack += [f for table in global_decomposition_table.values() for f in table.values()]
    while stack:
        f = stack.pop()
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            continue
        seen.add(id(f))
        if f.__code__ is code and f.__closure__:
            found.append(f.__closure__[cell].cell_contents)
        stack += [getattr(f, "__wrapped__", None)] + [c.cell_contents for c in f.__closure__ or () if _filled_cell(c)]
    return found


def _filled_cell(c) -> bool:
    try:
        c.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


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
