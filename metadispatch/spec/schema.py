"""Facts about an op that follow from its schema, computed once and cached.

The dispatcher asks the same questions of every call (does it mutate an
argument, is its output a view, where is its ``device`` argument, does its
output size depend on data); answering them from ``func._schema`` each time
would cost more than the meta kernel.  ``facts(func)`` memoises the answers
per ``OpOverload``.

Note [What an op writes and aliases]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Replay must know, before it runs, which tensors a call may write and which
of its outputs share memory with which arguments (Note [Replay never writes
its inputs] in replay.py).  The schema says most of it: ``Tensor(a!)`` is
written, a ``Tensor(a)`` return aliases the argument marked ``(a)``.  Where
the schema is silent the real kernel is not: ``native_batch_norm`` updates
its running statistics, ``_unsafe_view`` returns a view, and ``set_`` makes
``self`` share ``source``'s storage from then on (and may grow that
storage).  ``writes``, ``aliases`` and ``joins`` add those; each names an
argument as ``(position, name)``, so it is found whether a call passed it by
position or by keyword.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _compat

__all__ = ["OpFacts", "facts", "op_name", "arg_value", "schema_of"]


@dataclass(frozen=True)
class OpFacts:
    name: str
    # For each return, the index of the positional argument (or the name of
    # the keyword argument, for ``out=`` variants) that it aliases and writes;
    # None for a fresh output.  In-place ops return that argument object.
    returns_write: tuple
    is_view: bool
    view_of: int | None  # positional index of the argument a view aliases
    device_arg: tuple | None  # (position, name) of the ``device`` argument
    is_factory: bool
    random: bool
    data_dependent: bool
    has_meta_kernel: bool
    mutates: bool
    cacheable: bool  # see cache.py, Note [What the key must hold]
    switches: Callable | None  # the global backend switches the answer reads (cache.context keys them)
    passthrough: bool  # profiler annotations: run as they are, recorded as markers (dispatch.py)
    # A CompositeImplicitAutograd op (linear, SDPA): Note [Composites that reach the mode] in dispatch.py.
    implicit_composite: bool
    # Note [What an op writes and aliases]; arguments as (position, name).
    writes: tuple = ()  # arguments the op writes in place
    aliases: tuple = ()  # per return, the arguments it may share memory with
    joins: tuple = ()  # (argument, argument whose memory it shares afterwards, its own let go)


def schema_of(func):
    """``func``'s FunctionSchema (an OpOverload's ``_schema``): spec/ reads schemas, nothing above it does."""
    return func._schema


_CACHE: dict = {}


def _switches_read_by(name: str) -> Callable | None:
    """What global switches C++ reads to pick the backend whose answer a rule
    gives: attention's (rules/sdp_choice.py), convolution's on a logical CPU
    (rules/convolution.py: with oneDNN off a channels-last 3-d convolution
    comes out contiguous)."""
    if "scaled_dot_product" in name or "_fused_sdp_choice" in name:
        return _compat.sdp_switches
    if "convolution" in name:
        return _compat.conv_switches
    return None


# index.Tensor carries the dynamic_output_shape tag for boolean masks only;
# a built-in rule decides per call (see rules/data_dependent.py).
_SHAPE_DEPENDS_ONLY_SOMETIMES = {"aten::index.Tensor", "aten::index.Tensor_out"}


def op_name(func) -> str:
    """``aten.mm.default`` style name of an OpOverload."""
    ns, _, rest = func.name().partition("::")
    base, _, overload = rest.partition(".")
    return f"{ns}.{base}.{overload or 'default'}"


def arg_value(call, arg: tuple):
    """The value ``call`` passed for ``arg`` (``(position, name)``), by position or keyword."""
    pos, name = arg
    return call.args[pos] if pos < len(call.args) else call.kwargs.get(name)


# Note [What an op writes and aliases]: what the schemas leave out, by op
# packet (every overload: ``native_batch_norm.out`` writes its statistics as
# the default does) and argument name.  tests/spec/test_schema_writes.py runs each
# family's CPU kernels and checks that nothing they write is missing here.
_UNANNOTATED_WRITES = {
    # Batch norm in training updates the running statistics in place (hence
    # torch's later ``_native_batch_norm_legit`` with ``Tensor(a!)``);
    # instance norm averages its per-instance statistics into them.
    **dict.fromkeys(
        (
            "aten::batch_norm",
            "aten::_batch_norm_impl_index",
            "aten::native_batch_norm",
            "aten::cudnn_batch_norm",
            "aten::miopen_batch_norm",
            "aten::instance_norm",
            "aten::batch_norm_update_stats",
            "aten::batch_norm_gather_stats",  # SyncBatchNorm (CUDA)
            "aten::batch_norm_gather_stats_with_counts",
        ),
        ("running_mean", "running_var"),
    ),
    # cuDNN and MIOpen advance the dropout generator state they are handed.
    **dict.fromkeys(
        ("aten::_cudnn_rnn", "aten::_cudnn_rnn_backward", "aten::miopen_rnn", "aten::miopen_rnn_backward"),
        ("dropout_state",),
    ),
    # Backend copies (XLA, MPS) write ``dst`` and return it.
    "aten::_copy_from": ("dst",),
    "aten::_copy_from_and_resize": ("dst",),
    # With an explicit size, ``set_`` resizes ``source``'s storage to fit:
    # the caller's storage would grow and move.
    "aten::set_": ("source",),
}
_UNANNOTATED_VIEWS = {"aten::_unsafe_view": 0, "aten::_reshape_alias": 0, "aten::_copy_from": 1}
# ``self`` shares the second argument's memory afterwards (``set_`` returns
# it; ``set_data``, ``.data = ...``, returns nothing) and lets its own go.
_JOINS = {"aten::set_": "source", "aten::set_data": "new_data"}


def _writes_and_aliases(func) -> tuple:
    schema = func._schema
    args = schema.arguments
    ref = [(i, a.name) for i, a in enumerate(args)]
    packet = func.name().partition(".")[0]
    unannotated = _UNANNOTATED_WRITES.get(packet, ())
    writes = [ref[i] for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    writes += [ref[i] for i, a in enumerate(args) if a.name in unannotated and "Tensor" in str(a.type)]
    by_set: dict = {}
    for i, a in enumerate(args):
        for s in a.alias_info.before_set if a.alias_info is not None else ():
            by_set.setdefault(s, []).append(ref[i])
    marked = [ref[i] for i, a in enumerate(args) if a.alias_info is not None]
    aliases: list = []
    for r in schema.returns:
        if r.alias_info is None:
            aliases.append(())
        else:  # ``Tensor(a)[]`` returns show an empty set: any marked argument
            found = [x for s in r.alias_info.before_set for x in by_set.get(s, ())]
            aliases.append(tuple(found or marked))
    view_of = _UNANNOTATED_VIEWS.get(packet)
    if view_of is not None and not func.name().endswith(".out"):
        aliases = [(ref[view_of],)] * len(schema.returns)
    joins: tuple = ()
    source = next((x for x in ref if x[1] == _JOINS.get(packet) and "Tensor" in str(args[x[0]].type)), None)
    if source is not None:
        joins = ((ref[0], source),)
        aliases = [(source,)] * len(schema.returns)
    return tuple(writes), tuple(aliases), joins


# Namespaces whose ops do what their schema does not say: collectives return
# a Work and talk to a process group, ``inductor::resize_storage_bytes_``
# resizes its argument's storage yet marks nothing written.  Their answers
# are never served from the cache.
_ACTS_BEYOND_SCHEMA = {"c10d", "_c10d_functional", "inductor"}
# Ops that read or mark a storage's state, which the metadata does not hold:
# ``_pin_memory`` pins its new storage, ``is_pinned`` asks (Note [Pinned
# memory on a logical host] in rules/pinned.py).
_STORAGE_STATE = {"aten::is_pinned", "aten::_pin_memory"}


def facts(func) -> OpFacts:
    try:
        return _CACHE[func]
    except KeyError:
        pass
    f = _compute(func)
    _CACHE[func] = f
    return f


def _compute(func) -> OpFacts:
    schema = func._schema
    args = schema.arguments
    by_alias: dict = {}
    for i, a in enumerate(args):
        if a.alias_info is not None:
            for s in a.alias_info.before_set:
                by_alias[s] = i if not a.kwarg_only else a.name
    returns_write: list = []
    is_view = False
    view_of = None
    for r in schema.returns:
        info = r.alias_info
        if info is None:
            returns_write.append(None)
            continue
        target = next((by_alias[s] for s in info.before_set if s in by_alias), None)
        if target is None and not info.is_write:
            # ``Tensor(a)[]`` returns (unbind, split) show an empty alias set
            # from Python; they alias the one argument marked ``(a -> *)``.
            target = next(
                (i for i, a in enumerate(args) if a.alias_info is not None and not a.alias_info.is_write), None
            )
        if info.is_write:
            returns_write.append(target)
        else:
            is_view = True
            view_of = target if isinstance(target, int) else view_of
            returns_write.append(None)
    device_arg = None
    for i, a in enumerate(args):
        if a.name == "device" and "Device" in str(a.type):
            device_arg = (i, a.name)
    tensor_like = ("Tensor",)
    is_factory = not any(any(t in str(a.type) for t in tensor_like) for a in args)
    tags = set(func.tags)
    name = func.name()
    data_dependent = torch.Tag.data_dependent_output in tags or (
        torch.Tag.dynamic_output_shape in tags and name not in _SHAPE_DEPENDS_ONLY_SOMETIMES
    )
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in args)
    cacheable = (
        not data_dependent
        and torch.Tag.inplace_view not in tags
        and name.partition("::")[0] not in _ACTS_BEYOND_SCHEMA
        and name not in _STORAGE_STATE
    )
    writes, aliases, joins = _writes_and_aliases(func)
    return OpFacts(
        name=op_name(func),
        returns_write=tuple(returns_write),
        is_view=is_view,
        view_of=view_of,
        device_arg=device_arg,
        is_factory=is_factory,
        random=torch.Tag.nondeterministic_seeded in tags,
        data_dependent=data_dependent,
        has_meta_kernel=_compat.has_meta_kernel(name),
        mutates=mutates,
        cacheable=cacheable,
        switches=_switches_read_by(name),
        passthrough=name.startswith("profiler::"),
        implicit_composite=_compat.has_implicit_composite(name),
        writes=writes,
        aliases=aliases,
        joins=joins,
    )
