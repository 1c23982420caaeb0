"""Standing in for a user's real module and optimizer state while ``md.trace`` runs.

Note [Swap above autograd]
~~~~~~~~~~~~~~~~~~~~~~~~~~
If a real parameter reached the dispatch mode and were converted there --
below autograd -- autograd would already have recorded the *real* parameter
as a leaf, and backward would try to accumulate a meta gradient into its
``.grad``.  So every real tensor is replaced by its stand-in, a MetaTensor,
*above* autograd: the mode's torch-function mode (``SwapReal`` in mode/swap.py)
hands torch the stand-in wherever the real tensor is passed, read
(``p.grad``, ``p.device``) or written (``p.grad = None``).  Autograd then
only ever sees stand-ins; gradients, buffer updates (batch-norm statistics)
and optimizer steps land on them.  Stand-ins are made and named (``param
0.weight``) when a module is first reached, and carry the real tensor's
``.grad`` and attributes as they were then.

Note [Other threads see the real model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Stand-ins are never written into the user's modules or optimizers: their
tables keep the real tensors, and only the tracing thread, whose
torch-function mode swaps them, computes with stand-ins.  Another thread
running the same model meanwhile has no such mode: it sees the real
parameters, gets eager's results and its own ``.grad`` (issue 27).  An
optimizer's ``state`` is read per thread (Note [An optimizer's state, per
thread]).  What the step itself writes into a module or an optimizer --
an attribute, a cache, ``group["lr"]`` -- is visible to other threads
until the trace ends and is put back then (Note [Everything a forward can
change] in snapshot.py).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _compat
from ..ir.records import attribute_tensors
from ..tensor.state import state_of
from ..tensor.tensor import MetaTensor, is_wrapper_subclass
from ..values import known
from .snapshot import Contents, ModuleState, made_in, uninitialized

__all__ = ["StandIns", "PATCHES"]

_MISSING = object()


class _Active(threading.local):
    standins = None


_ACTIVE = _Active()


class StandIns:
    def __init__(self, mode) -> None:
        self.mode = mode
        self.roots: list[nn.Module] = []
        self._made_roots: list = []  # weak: Note [A module the step makes]
        self._swapped: set = set()  # ids of modules already handled
        self._states: list = []  # a ModuleState per module touched, restored on exit
        self._depth = 0
        self._thread = threading.get_ident()
        self._handles: list = []
        self._stand_of: dict = {}  # id(real tensor) -> its stand-in
        # id(optimizer) -> _Overlay: its state as this thread's step sees it
        # (Note [An optimizer's state, per thread])
        self._overlays: dict = {}
        self._born: weakref.WeakSet = weakref.WeakSet()  # optimizers made inside the trace
        self._undo: list = []  # the ledger's release steps
        # Held from before md.trace saves the modules to after they are put
        # back (Note [Garbage collection during tracing] in _compat/process.py).
        self._heap = _compat.deferred_full_gc()

    def __enter__(self):
        # One set of stand-ins per thread: a MetaMode entered by md.trace uses
        # md.trace's (which saved the modules the function reaches first).
        if _ACTIVE.standins is not None:
            return self
        try:
            _ACTIVE.standins = self
            if self.mode.record:
                self._heap.__enter__()
            self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._pre))
            self._handles.append(nn.modules.module.register_module_forward_hook(self._post, always_call=True))
            self._handles.append(register_optimizer_step_pre_hook(self._step_pre))
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        """Put everything back; idempotent, so a retry finishes an interrupted exit."""
        while self._handles:
            # fmt: off
            self._handles[-1].remove(); self._handles.pop()  # noqa: E702 (Note [Interrupts in mode entry and exit])
            # fmt: on
        while self._undo:
            # fmt: off
            self._undo[-1](); self._undo.pop()  # noqa: E702
            # fmt: on
        if _ACTIVE.standins is self:
            _ACTIVE.standins = None
        _compat.call_without_torch_function(self._restore)
        self._stand_of.clear()
        self._heap.__exit__(None, None, None)

    def _restore(self) -> None:
        while self._states:
            # fmt: off
            self._states[-1].restore(); self._states.pop()  # noqa: E702
            # fmt: on
        self._overlays.clear()

    def _step_pre(self, opt, args, kwargs) -> None:
        """An optimizer stepped in the trace is saved (its attributes, its
        groups' ``lr``), as md.trace saves those it reaches up front."""
        if threading.get_ident() == self._thread and opt not in self._born:
            self.save_object(opt)

    def optimizer_state(self, opt):
        """Note [An optimizer's state, per thread]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        An optimizer made before the trace holds the real parameters, and
        its ``state`` their real moments (after real steps), keyed by them.
        Its ``step`` in the trace must read and write MetaTensor copies of
        that state, and another thread stepping or saving it meanwhile must
        see the real one.  So while a trace is entered, ``Optimizer.state``
        is a property (a ledger patch): in the tracing thread it is an
        overlay -- the real dict's keys, each entry's tensors replaced by
        MetaTensor copies (recorded as inputs ``optimizer state
        <param>.<key>``) -- made on first read; everywhere else, and for an
        optimizer made inside the trace, the optimizer's own dict.  The
        user's dict is never written, and the overlay goes with the trace.
        """
        real = opt.__dict__.get("state", _MISSING)
        if real is _MISSING:
            raise AttributeError("state")
        if opt in self._born:
            return real
        entry = self._overlays.get(id(opt))
        if entry is None or entry.opt is not opt or entry.source is not real:
            entry = self._overlays[id(opt)] = _Overlay(opt, real, self._copy_state(real))
        return entry.state

    def set_optimizer_state(self, opt, value) -> None:
        if "state" not in opt.__dict__:
            self._born.add(opt)  # Optimizer.__init__ sets it first: made in the trace
        if opt in self._born:
            opt.__dict__["state"] = value
        else:
            self._overlays[id(opt)] = _Overlay(opt, opt.__dict__.get("state"), value)

    def save_object(self, obj) -> None:
        """Save an object's attributes (an optimizer, a scheduler, a grad
        scaler, the user's own), restored on exit."""
        if id(obj) not in self._swapped:
            self._swapped.add(id(obj))
            self._states.append(ModuleState(obj, self.mode._recorder.token))

    def save_container(self, container) -> None:
        """Note [The user's containers]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A step stores what it computes in lists and dicts the user keeps: a
        hook that appends activations or gradients, ``losses.append(loss)``,
        ``saved["model"] = model.state_dict()``.  Under a trace those values
        are MetaTensors, left behind in the user's list after the trace.  So
        every list, dict and set ``md.trace`` reaches from the function and
        its arguments is copied (shallowly) before any stand-in goes in, and
        refilled on exit with what it held, by identity.
        """
        if id(container) not in self._swapped:
            self._swapped.add(id(container))
            self._states.append(Contents(container))

    def _copy_state(self, real: dict) -> defaultdict:
        with _compat.no_torch_function():
            state: defaultdict = defaultdict(dict)
            for p, entry in real.items():
                stand = self._stand_of.get(id(p))
                if stand is None and isinstance(p, torch.Tensor) and not isinstance(p, MetaTensor):
                    stand = self.mode.from_tensor(p)
                owner = (stand._md.name or ("", "?"))[1] if stand is not None else "?"
                state[p] = {k: self._state_copy(v, f"{owner}.{k}") for k, v in entry.items()}
            return state

    def _state_copy(self, v, name: str):
        if not isinstance(v, torch.Tensor) or isinstance(v, MetaTensor):
            return v  # a MetaTensor: state the step itself loaded (``opt.load_state_dict``)
        meta = self.mode.from_tensor(v)
        meta._md.name = ("input", f"optimizer state {name}")
        # Recorded as a constant (its value kept up to the mode's limit, for
        # replay), and a step count read with .item() (Adam without
        # capturable) is a known value, as it would be had the optimizer been
        # made in the trace.
        self.mode._recorder.note_real(meta, v)
        known.know(meta, v, self.mode)
        return meta

    def _pre(self, mod, args):
        if threading.get_ident() != self._thread:
            return
        if self._depth == 0:
            with _compat.no_torch_function():
                self.add_root(mod)
        self._depth += 1

    def _post(self, mod, args, output):
        if threading.get_ident() == self._thread:
            self._depth = max(0, self._depth - 1)

    def add_root(self, root: nn.Module) -> None:
        """A module that runs: its gradients are the trace's; see :meth:`save`.  One the step made is held
        weakly (Note [A module the step makes] in snapshot.py)."""
        if any(r() is root for r in self._made_roots):
            return
        if id(root) not in self._swapped and made_in(root, self.mode._recorder.token):  # a saved root: not made
            self._made_roots.append(weakref.ref(root))
            return
        if all(r is not root for r in self.roots):
            self.roots.append(root)
        self.save(root)

    def save(self, root: nn.Module) -> None:
        """Save the state of ``root``'s tree and swap its tensors for stand-ins."""
        if id(root) in self._swapped:
            return
        names: dict = {}
        tables = (("param", root.named_parameters), ("buffer", root.named_buffers))
        for kind, named in tables:
            for name, t in named(remove_duplicate=False):
                first = names.setdefault(id(t), (kind, name))
                if first != (kind, name):  # tied: the trace reads it by its first name
                    self.mode.trace.aliases.setdefault(f"{kind} {name}", f"{first[0]} {first[1]}")
        for name, t in attribute_tensors(root):  # Note [Values fixed into a trace] in execution/matching.py
            self.mode._recorder.const_names.setdefault(id(t), name)
        for mod in root.modules():
            if id(mod) not in self._swapped:
                self._swapped.add(id(mod))
                self._states.append(ModuleState(mod, self.mode._recorder.token))
                self._swap(mod, names)

    def _swap(self, mod: nn.Module, names: dict) -> None:
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if t is None:
                    continue
                if uninitialized(t):
                    table[key] = self._lazy_stand_in(t, table, key)
                    continue
                if isinstance(t, MetaTensor):
                    if t._md.name is None and id(t) in names:
                        t._md.name = names[id(t)]
                    continue
                if _compat.is_functorch_wrapped(t) or is_wrapper_subclass(t):
                    # swapped in by functional_call under grad/vmap: a value
                    # of the traced program, not a parameter to stand in for;
                    # a DTensor's own dispatch reaches its local tensor
                    # (Note [Wrapper subclasses dispatch first] in core/dispatch.py)
                    continue
                stand = self.mode.from_tensor(t)
                if id(t) in names and stand._md.name is None:
                    stand._md.name = names[id(t)]
                self._stand_grad(t, stand, names.get(id(t)))
                if table is mod._buffers and _counter(t):
                    known.know(stand, t, self.mode)  # Note [Counters in buffers]
                self._stand_of[id(t)] = stand  # the table keeps t (Note [Other threads see the real model])

    def _lazy_stand_in(self, t, table: dict, key: str):
        """Note [Lazy modules under a trace]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A lazy module's first forward materialises its uninitialised
        parameters in place: ``self.data = torch.empty(shape)``, then a class
        change.  Under a mode that ``torch.empty`` is a MetaTensor, which
        ``set_data`` refuses (its dispatch keys differ), so tracing a lazy
        module failed.  The stand-in is a fresh uninitialised tensor (on meta:
        no memory) whose ``materialize`` instead puts a new MetaTensor in the
        module's table -- the ``torch.empty`` eager would run, recorded -- and
        the user's uninitialised parameter is never touched; the table, the
        module's class and its attributes are put back on exit.
        """
        own = self.mode.device or t.device
        with _compat.no_python_dispatch(), _compat.no_torch_function():
            fresh = type(t)(t.requires_grad, device="meta", dtype=t.dtype)

        def materialize(shape, device=None, dtype=None) -> None:
            device, dtype = own if device is None else device, t.dtype if dtype is None else dtype
            value = torch.empty(shape, device=device, dtype=dtype)
            table[key] = nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else value

        fresh.materialize = materialize
        return fresh

    def _stand_grad(self, t: torch.Tensor, stand: MetaTensor, named) -> None:
        """A real ``.grad`` is a leaf named for its parameter: backward
        accumulates into it, as eager does (the real one is never written)."""
        grad = t.grad
        if grad is None or type(grad) is not torch.Tensor or stand.grad is not None:
            return
        meta = self.mode.from_tensor(grad)
        if named is not None and named[0] == "param" and meta._md.name is None:
            meta._md.name = ("grad", named[1])
            # A leaf now, read or not: that the step began with a .grad is a
            # fact replay checks (a zero_grad() first makes it unread).
            self.mode._recorder.meta_of(meta)
        stand.grad = meta

    def stand_ins(self) -> list:
        """The stand-ins made so far, in the order they were made."""
        return list(self._stand_of.values())

    def grads(self, meta_of) -> dict:
        """Parameter name -> TensorMeta of its gradient, for every root that ran.

        Each parameter once, under the name the trace gave it (its name in
        the first module saved): a block run on its own as well -- passed to
        ``torch.utils.checkpoint``, say -- named its parameters a second
        time by their names within the block.
        """
        out: dict = {}
        seen: set = set()
        made = [m for m in (r() for r in self._made_roots) if m is not None]
        for root in (*self.roots, *made):
            for name, p in root.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                # A DTensor's gradient (tensor parallelism, FSDP2) is this
                # rank's shard of it: what lives here and what replay checks.
                g = _compat.local_shard(self._stand_of.get(id(p), p).grad)
                if isinstance(g, torch.Tensor):
                    named = p._md.name if state_of(p) is not None else None
                    out.setdefault(named[1] if named is not None and named[0] == "param" else name, meta_of(g))
        return out


def _counter(t: torch.Tensor) -> bool:
    """Note [Counters in buffers]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A one-element integer buffer counts steps, not data: batch norm's
    ``num_batches_tracked`` (``momentum=None`` divides by it),
    ``AveragedModel``'s ``n_averaged`` (``if n_averaged == 0`` picks the
    first copy).  Like an optimizer's step count, its stand-in knows its
    value (Note [Known values]), so the step traces as eager runs it where it
    stopped with a DataDependentError; ``+= 1`` on it stays known.
    """
    return t.numel() == 1 and not t.is_floating_point() and not t.is_complex() and not t.requires_grad


class _Overlay:
    """An optimizer's state as the tracing thread sees it (Note [An optimizer's state, per thread])."""

    __slots__ = ("opt", "source", "state")

    def __init__(self, opt, source, state) -> None:
        self.opt = opt
        self.source = source  # the optimizer's own dict it was copied from
        self.state = state


def _state_property(original) -> property:
    # Only threads claiming the group reach this (ledger.py); an optimizer
    # read outside md.trace's stand-ins (a bare MetaMode's thread has them
    # too) keeps its own dict.
    def get(opt):
        standins = _ACTIVE.standins
        if standins is None:
            return opt.__dict__["state"]
        return standins.optimizer_state(opt)

    def set_(opt, value) -> None:
        standins = _ACTIVE.standins
        if standins is None:
            opt.__dict__["state"] = value
        else:
            standins.set_optimizer_state(opt, value)

    return property(get, set_)


def _group_by_device_and_dtype(original):
    """Note [Real tensors a C function is handed]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``torch._C._group_tensors_by_device_and_dtype`` takes no torch function:
    the foreach paths of every optimizer, ``clip_grad_norm_`` and
    ``AveragedModel`` hand it the lists they collected -- an optimizer's
    real parameters among them (Note [Other threads see the real model] in
    standins.py) -- and it would group them with their stand-ins' gradients
    and state on other devices.  In the tracing thread it is given the
    stand-ins, as ``_SwapReal`` (mode.py) gives every torch function.

    Note [Foreach groups on a logical GPU]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    C++ groups by the C++ tensor's device, and a logical GPU's MetaTensor is
    a plain meta tensor there (Note [Logical device] in tensor/tensor.py): every
    group came back keyed ``meta``, which has no foreach kernels, so
    ``clip_grad_norm_`` took its per-tensor path where a real GPU takes
    foreach.  In a thread under a mode each meta group is split by its
    tensors' logical devices (the first list's, which C++ requires to be
    set), keeping C++'s order, so the keys are those a real run gets; an
    empty list stays empty."""

    def group(tensorlistlist, with_indices):
        standins = _ACTIVE.standins
        if standins is not None:
            stand_in = standins.mode.stand_in
            tensorlistlist = [[stand_in(t) if t is not None else t for t in ts] for ts in tensorlistlist]
        return _logical_keys(original(tensorlistlist, with_indices), with_indices)

    return group


def _logical_keys(groups: dict, with_indices: bool) -> dict:
    if all(device.type != "meta" for device, _ in groups):
        return groups
    out: dict = {}
    for (device, dtype), (lists, indices) in groups.items():
        if device.type != "meta":
            out[(device, dtype)] = (lists, indices)
            continue
        for i, t in enumerate(lists[0]):
            sub, where = out.setdefault((t.device, dtype), ([[] for _ in lists], []))
            for kept, ts in zip(sub, lists):
                if ts:  # an empty list stays empty, as C++ keeps it (AdamW's max_exp_avg_sqs)
                    kept.append(ts[i])
            if with_indices:
                where.append(indices[i])
    return out


# (owner, attribute, make, why): the ledger's rows (mode/ledger.py, claimed in mode/patches.py).
PATCHES = [
    (
        torch.optim.Optimizer,
        "state",
        _state_property,
        "an optimizer's state: MetaTensor copies in the tracing thread (Note [An optimizer's state, per thread])",
    ),
    (
        _compat.torch_c,
        "_group_tensors_by_device_and_dtype",
        _group_by_device_and_dtype,
        "the foreach paths' grouping, given stand-ins (Note [Real tensors a C function is handed])",
    ),
]
