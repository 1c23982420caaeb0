"""The recorder: turns dispatched calls into :class:`~metadispatch.ir.trace.OpCall`.

Each MetaTensor that takes part in a trace has, in its state ``t._md``
(Note [A MetaTensor's state] in tensor/state.py), the recorder that
numbered it, its current :class:`TensorMeta`, and the index of the call
that last wrote it (None for a leaf).  An input
without this recorder's token came from outside and becomes a named leaf.
Outputs get fresh ids; in-place outputs keep the id of the tensor they
mutated, with new metadata.

Autograd sets ``requires_grad`` (and ``grad_fn``) on an output after
``__torch_dispatch__`` returns, so the output record is made too early to
see it.  The next use of the tensor sees it, and replaces the record of the
call that produced it with a corrected one (a recorded call is never changed).

Note [Storage numbers and deaths]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Storage numbers follow the (meta) storage itself, not the schema: ops such
as ``_unsafe_view`` alias their input without saying so, and a view shares
its base's storage either way.  A weak reference to each numbered storage
records, in ``trace.deaths``, the index of the first call after it was
freed.  Storage objects keep their Python object while the C++ storage
lives, so the reference dies exactly when the last tensor using the
storage does -- the same moment as in an eager run of the same code, since
the traced code holds the same references.  This is what ``md.memory``
builds its timeline from.

Note [Storages larger than their tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A tensor record says how far a tensor reaches into its storage, not how
large the storage is, and the allocator holds the storage: an input sliced
from a larger tensor (transformers' Whisper decoder ids, a ``[2, 4]`` slice
of ``[2, 12]``: 64 B past its last element), or a kernel that allocates more
than it returns (``_embedding_bag``'s CPU kernel makes ``offset2bag`` one
element longer and shrinks it; rules/embedding.py mirrors that).  Each
storage's bytes are noted when it is numbered -- a stand-in's meta storage
is the size of the real one, a rule's output's what the rule allocated --
in ``trace.storage_bytes``, and ``md.memory`` counts the larger of that and
the furthest any tensor reaches.  A saved trace keeps only the entries
larger than that reach.
"""

from __future__ import annotations

import weakref

import torch

from .. import _compat
from ..errors import UnsupportedFeatureError, mark_call
from ..ir.records import PLAIN_TYPES
from ..ir.rng import GeneratorRef
from ..ir.trace import Leaf, OpCall, TensorMeta, Trace
from ..source import user_frame
from ..tensor.state import state_of
from ..tensor.tensor import MetaTensor
from ..world import world
from .backward_modules import BackwardModules
from .rngstate import RngLog

__all__ = ["Recorder", "is_leaf_named"]


def is_leaf_named(trace: Trace, tid: int, kind: str, name: str) -> bool:
    leaf = trace.leaves.get(tid)
    return leaf is not None and leaf.kind == kind and leaf.name == name


class Recorder:
    def __init__(self, trace: Trace, *, stack: bool = False, const_limit: int = 4096) -> None:
        self._trace = lambda: trace  # weak once released (Note [Dropping a trace frees it])
        self._recording: Trace | None = trace  # the same, None once released: read per call without a frame
        self.stack = stack
        self.const_limit = const_limit
        self.keep_known = False  # note known values as calls write them: a trace to be cut (md.tracer(warmup=))
        # Tensors carry this recorder in their state (``t._md.recorder``):
        # through it the trace that numbered them is found, e.g. so md.materialize can find
        # how a parameter was built.
        self.token = self
        self.modules = None  # a ModuleStack while a mode is entered
        self._next_id = 0
        self._next_storage = 0
        self._live: dict = {}  # storage key -> (number, weakref), storages alive now
        self._refs: dict = {}  # weakref -> (storage key, number)
        trace.deaths = {}  # Note [Storage numbers and deaths]
        self._real_of: dict = {}  # id(meta) -> weakref to the real tensor, for constants
        self._kept: dict = {}  # id(real) -> weakref: constants kept whatever their size (keep_values)
        self.const_names: dict = {}  # id(real tensor) -> its attribute's name in a traced module
        self.backward_modules = BackwardModules()
        # storage number -> the first bound leaf or call output on it (Note [Views of leaves])
        self.bases: dict = {}
        self.rng = RngLog(trace)  # Note [RNG state as slots] in rngstate.py

    # -- the real tensors stood in for (Note [No real tensor outlives the recording])
    def note_real(self, meta: MetaTensor, real: torch.Tensor) -> None:
        self._real_of[id(meta)] = weakref.ref(real)

    def real_of(self, meta: MetaTensor) -> torch.Tensor | None:
        ref = self._real_of.get(id(meta))
        return ref() if ref is not None else None

    def keep_values(self, reals) -> None:
        """Keep the values of ``reals`` as constants whatever ``const_limit`` says.

        A checkpoint loaded in the mode (Note [torch.load inside a MetaMode]
        in mode/realcode.py) is the data the trace is built from, not a
        constant of the step's code: without its values, md.materialize and
        replay would make the model's weights up.
        """
        for t in reals:
            self._kept[id(t)] = weakref.ref(t)

    def _keeps(self, real: torch.Tensor) -> bool:
        ref = self._kept.get(id(real))
        return ref is not None and ref() is real

    def forget_reals(self) -> None:
        self._real_of.clear()
        self._kept.clear()
        self.const_names.clear()
        self.rng.forget()

    @property
    def trace(self) -> Trace:
        return self._trace()

    def release_trace(self) -> None:
        """Refer to the trace weakly from now on: recording is done.

        Note [Dropping a trace frees it]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        ``md.trace`` keeps its result's MetaTensors in ``trace.output``.  Their
        autograd graph holds the stand-ins and intermediates it saved, each
        carrying ``_md`` -- this recorder -- which held the trace: a cycle
        through C++ autograd nodes, which Python's collector cannot see, so
        a dropped trace lived (and its MetaTensors with it) for the rest of
        the process.  Once ``md.trace`` is done the recorder (and its RNG log)
        hold the trace weakly; ``md.materialize`` still finds it while the
        user holds it.  A bare ``MetaMode`` keeps it strongly: its trace holds
        no MetaTensor, and a module built in it needs the trace to materialise.
        """
        self._trace = weakref.ref(self._trace())
        self._recording = None
        self.rng.release_trace()

    # -- tensor metadata
    def _meta(self, t: torch.Tensor, tid: int, storage: int) -> TensorMeta:
        return TensorMeta(
            tid, tuple(t.shape), t.dtype, t.stride(), t.storage_offset(), t._md.device, t.requires_grad, storage
        )

    def producer_of(self, t: MetaTensor) -> int | None:
        """The index of the recorded call that made ``t``, or None (a leaf, or not recorded here)."""
        st = t._md
        return st.call if st.recorder is self.token else None

    def meta_of(self, t: MetaTensor) -> TensorMeta:
        """The current TensorMeta of an input, registering it as a leaf if new."""
        # Outside a call (md.trace reads its leaves and grads after the step)
        # each getter below would be a MetaTensor.__torch_function__ call.
        if _compat.torch_function_enabled():
            with _compat.no_torch_function_subclass():
                return self.meta_of(t)
        st = t._md
        if st.recorder is self.token:
            m = st.meta
            if m.requires_grad != t.requires_grad:  # (not NamedTuple._replace: a Python loop over the fields)
                old, m = m, _TUPLE_NEW(TensorMeta, (*m[:6], t.requires_grad, m[7]))
                st.meta = m
                # set by autograd, not the user (``grad_fn`` read directly: torch function is off here, above)
                if st.call is not None and t.grad_fn is not None:
                    calls = self._trace().calls  # a new record in its place (OpCall is immutable)
                    calls[st.call] = calls[st.call].with_outputs(_swap(calls[st.call].outputs, old, m))
            if self.keep_known and st.known is not None:  # read by the call about to be recorded
                self._note_known(st, m.id, len(self.trace.calls))
            return m
        return self._leaf(t)

    def _note_known(self, st, tid: int, before: int) -> None:
        """Note [Known state across a cut] in ir/cut.py: ``tid``'s known value as of call ``before``."""
        kv = st.known
        if kv[1].valid and kv[0].numel() <= _KNOWN_KEPT:
            self.trace.known_writes.setdefault(tid, []).append((before, kv[0].clone()))

    def before_data_swap(self, target: torch.Tensor, value: MetaTensor) -> None:
        """Note [Data swapped into a named tensor]: ``target.data = value`` is about to run.

        Note [Data swapped into a named tensor]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        ``p.data = v`` is no dispatched op: the parameter's C++ tensor becomes
        ``v``'s and MetaTensor's setter hands ``p`` ``v``'s record, so a later
        call reading ``p`` reads ``v``'s id.  A ``v`` no call had read yet (an
        argument, a tensor from the user's scope) had no record to hand over,
        and ``p``'s first read then made ``p`` a leaf -- ``param weight``
        holding ``v``'s shape and storage: replay refused the module's own
        weight as the wrong shape or, where the shapes agree, bound the
        module's weight where eager read ``v``, and said ok.  So ``v`` gets
        its record (a leaf of its own kind) first, and ``tracing/leafviews.bind_views``
        takes no tensor whose data was swapped as the base of the leaves on
        its storage.

        A buffer the step has already read is refused: ``Replay.buffers``
        gives each buffer's leaf after the calls that wrote it, and the
        buffer would no longer be that tensor (eager's module holds ``v``).
        Parameters are not in a replay's result, and a buffer swapped before
        its first read never becomes a buffer leaf.
        """
        st = state_of(target)
        named = st.name if st is not None else None
        if st is not None and named is not None and named[0] == "buffer" and st.recorder is self.token:
            if st.meta is not None and is_leaf_named(self.trace, st.meta.id, *named):
                error = UnsupportedFeatureError(
                    f"buffer {named[1]}.data = <{value.dtype} {list(value.shape)}>: the step assigns a "
                    "buffer's .data after reading it, and replay's buffers would report the tensor it "
                    "read, not the one assigned (Note [Data swapped into a named tensor]). Write it in "
                    f"place ({named[1]}.copy_(new) where the shapes agree), or assign it before the step "
                    "first reads it"
                )
                mark_call(error, "Tensor.data.__set__", user_frame())
                raise error
        self.meta_of(value)

    def _leaf(self, t: MetaTensor) -> TensorMeta:
        storage = self.storage_number(t)
        st = t._md
        named = st.name
        base = self.bases.get(storage)
        if base is not None and named is None:
            return self._view_of(t, base)
        m = self._meta(t, self.new_id(), storage)
        st.recorder, st.meta, st.call = self.token, m, None
        kind, name = named or ("input", "")
        value = None
        real = self.real_of(t)
        # A tensor C++ built on meta from a MetaTensor's options (a list index,
        # x[:, [0, 3]]) reaches us as a plain meta tensor: no value to keep.
        if real is not None and kind == "input" and real.device.type != "meta":
            kind, name = "const", name or self.const_names.get(id(real), "")
            if real.numel() <= self.const_limit or self._keeps(real):
                with _compat.no_torch_function():  # the real value, not its stand-in
                    value = real.detach().clone()
        self.trace.leaves[m.id] = Leaf(m, kind, name, value)
        if kind != "input":
            self.bases.setdefault(storage, m)
        return m

    def _view_of(self, t: MetaTensor, base: TensorMeta) -> TensorMeta:
        """Note [Views of leaves]: record ``t`` as ``as_strided`` of ``base``.

        Note [Views of leaves]
        ~~~~~~~~~~~~~~~~~~~~~~
        A tensor can reach the mode without a recorded producer and without a
        name yet share storage with a leaf or a recorded output:
        ``torch.compile``'s runtime wrapper hands the compiled graph
        ``weight.t()`` made outside any mode, and between graphs it re-wraps
        the previous graph's outputs.  As an anonymous leaf, replay would fill
        it with made-up values; it is that tensor's data, so it is recorded as
        the view it is, and replay takes the same view of the real tensor.
        """
        m = self._meta(t, self.new_id(), base.storage)
        st = t._md
        st.recorder, st.meta, st.call = self.token, m, len(self.trace.calls)
        self.trace.calls.append(
            OpCall(
                len(self.trace.calls),
                _AS_STRIDED,
                "aten.as_strided.default",
                (base, m.shape, m.stride, m.storage_offset),
                None,
                (m,),
                self.modules.current() if self.modules is not None else "",
                "backward" if _compat.in_backward() else "forward",
                "meta",
                None,
                "untraced view",
            )
        )
        return m

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def storage_number(self, t: torch.Tensor) -> int:
        try:
            storage = t.untyped_storage()
        except NotImplementedError:
            # A trace's tensors are strided storages (TensorMeta, memory,
            # replay); a sparse gradient (``nn.Embedding(sparse=True)``) has
            # none.  (Asked here, not up front: ``t.layout`` on a MetaTensor
            # is a torch-function call, ~3 us on every recorded output.)
            raise UnsupportedFeatureError(
                f"a {str(t.layout).replace('torch.', '')} tensor: traces hold strided tensors only "
                "(nn.Embedding and nn.EmbeddingBag with sparse=True make sparse gradients; trace them "
                "with sparse=False, whose dense gradient a real run with sparse=True does not allocate)"
            ) from None
        key = _compat.storage_id(storage)
        hit = self._live.get(key)
        if hit is not None:
            return hit[0]
        n = self._next_storage
        self._next_storage += 1
        trace = self._recording if self._recording is not None else self._trace()
        trace.storage_bytes[n] = storage.nbytes()  # Note [Storages larger than their tensors]
        ref = weakref.ref(storage, self._died)
        self._live[key] = (n, ref)
        self._refs[ref] = (key, n)
        return n

    def _died(self, ref) -> None:
        key, n = self._refs.pop(ref)
        if self._live.get(key, (None,))[0] == n:
            del self._live[key]
        trace = self._trace()
        if trace is not None:  # None: a released trace that was dropped
            trace.deaths[n] = len(trace.calls)

    # -- calls
    def encode(self, x):
        """Arguments with tensors replaced by their TensorMeta."""
        t = type(x)
        if t is MetaTensor:  # the common cases first
            return self.meta_of(x)
        if t in _PLAIN:  # (torch.Generator's isinstance runs Python)
            return x
        if isinstance(x, torch.Tensor):
            return self.meta_of(x)
        if t is list or t is tuple:
            return tuple([self.encode(y) for y in x])
        if isinstance(x, torch.Generator):
            return self.rng.generator(x)
        if isinstance(x, torch.ScriptObject):
            return world.describe(x)  # a process group, a c10d Work
        return x

    def encode_inputs(self, args: tuple, kwargs: dict):
        encode = self.encode
        enc_args = tuple([encode(a) for a in args])
        enc_kwargs = {k: encode(v) for k, v in kwargs.items()} if kwargs else None
        return enc_args, enc_kwargs

    def calls_now(self) -> list:
        """The recording trace's ``calls`` (read per call without a frame through ``_recording``)."""
        return (self._recording if self._recording is not None else self._trace()).calls

    def out(self, o, moved: bool = False):
        """The record of output ``o`` of the call about to be appended (numbering
        it if new); ``moved``: the call may have put ``o`` on another storage."""
        if isinstance(o, torch.Tensor):
            st = o._md
            if st.recorder is self.token:
                # In-place or out=: same object, same id, maybe new metadata.
                old = st.meta
                if moved:  # (asked only then: in-place calls keep their storage)
                    m = self._meta(o, old.id, self.storage_number(o))
                    self.bases.setdefault(m.storage, m)
                else:
                    m = self._meta(o, old.id, old.storage)
            else:
                m = self._meta(o, self.new_id(), self.storage_number(o))
                self.bases.setdefault(m.storage, m)
                st.recorder = self.token
            st.meta, st.call = m, len(self._trace().calls)  # the index record() gives
            if self.keep_known and st.known is not None:
                self._note_known(st, m.id, st.call + 1)
            return m
        if type(o) in (list, tuple):
            return tuple(self.out(x) for x in o)
        if isinstance(o, torch.ScriptObject):
            return world.describe(o)
        return o

    def record(self, func, f, pending, result, stage: str, note: str | None = None) -> OpCall:
        enc_args, enc_kwargs = pending
        if len(f.returns_write) == 1:
            outputs = (self.out(result, f.name in _MOVES_STORAGE),)
        elif f.returns_write:
            outputs = tuple(self.out(o) for o in result)
        else:
            outputs = ()
        trace = self._recording if self._recording is not None else self._trace()
        return self.append(func, f, enc_args, enc_kwargs, outputs, stage, note, trace.calls)

    def append(self, func, f, enc_args, enc_kwargs, outputs, stage: str, note: str | None, calls: list) -> OpCall:
        """The call's record, with its module and phase, appended to the trace's ``calls``
        (``calls``: :meth:`calls_now`)."""
        module, phase = ("", "forward")
        modules = self.modules
        if modules is not None:
            module = modules.current()
            if modules.in_optimizer:
                phase = "optimizer"
        if _GRAPH_TASK_ID() != -1 or _OUTSIDE_THE_ENGINE.depth:  # in backward (_compat.in_backward)
            # an optimizer stepped from a post-accumulate-grad hook is the optimizer's
            phase = "optimizer" if phase == "optimizer" else "backward"
            if _compat.in_checkpoint_recompute():
                note = "recompute"  # Note [Checkpoint recompute] in _compat
            else:
                module = self.backward_modules.module_of_current_node(module)
        else:
            self.backward_modules.note(module)
        source = user_frame() if self.stack else None
        call = OpCall(len(calls), func, f.name, enc_args, enc_kwargs, outputs, module, phase, stage, source, note)
        if f.random:
            self._before_draw(call)
        calls.append(call)
        return call

    def _before_draw(self, call: OpCall) -> None:
        """Note [States that change unseen] in rngstate.py, for a random op about to be appended."""
        gen = next((a for a in (*call.args, *call.kwargs.values()) if type(a) is GeneratorRef), None)
        metas = call.output_metas or call.inputs
        if gen is not None or (metas and metas[0].device.type == "cpu"):
            self.rng.before_draw(gen, call.index)


_AS_STRIDED = torch.ops.aten.as_strided.default
_GRAPH_TASK_ID = _compat.graph_task_id
_OUTSIDE_THE_ENGINE = _compat.OUTSIDE_THE_ENGINE
# In-place ops that may put their tensor on another storage: ``a.set_(b)``
# (FSDP1's flat parameter, nn.utils.parametrize).  Their record names the
# storage the tensor is on after the call, as a view of it does.
_MOVES_STORAGE = frozenset(
    f"aten.set_.{overload}"
    for overload in (
        "source_Storage",
        "source_Storage_storage_offset",
        "source_Tensor",
        "source_Tensor_storage_offset",
        "default",
    )
)
_KNOWN_KEPT = 64  # elements: step counters, small flags; larger known values are not state a cut carries
_TUPLE_NEW = tuple.__new__
# Argument types encode() passes through untouched.
_PLAIN = frozenset(PLAIN_TYPES)


def _swap(x, old: TensorMeta, new: TensorMeta):
    """``x`` (an output, or a tuple of them) with ``old`` replaced by ``new``."""
    if x is old:
        return new
    if type(x) is tuple:  # (recursing only into nested tuples: this runs for a third of the calls)
        return tuple([new if y is old else _swap(y, old, new) if type(y) is tuple else y for y in x])
    return x
