"""Real tensors for a trace's leaves: supplied, reused, or made up.

Replay needs a real tensor for every :class:`~metadispatch.ir.trace.Leaf`.  In
order of preference: the caller's (``args``/``kwargs`` by the name recorded
at trace time, parameters, buffers and pre-existing ``.grad`` by qualified
name), the constant kept in the trace, or one made up from ``seed`` -- and
then listed in ``Replay.made_up``, which makes the replay not ok unless the
caller allows it (docs/replay.md).

Made-up tensors must be *valid* for the ops that read them: token ids fed to
an embedding must be below the vocabulary size, labels below the number of
classes.  :func:`index_bounds` finds such limits by walking the trace
backwards from each consumer through value-preserving ops (views, copies,
padding), so ``labels[..., 1:].reshape(-1)`` reaching ``nll_loss`` still
bounds ``labels``.  Made-up values come from their own ``torch.Generator``:
drawing them must not shift the random sequence the replayed ops consume.

Limits: an integer leaf that no known op bounds is filled with ones (a safe
choice for attention masks); floats are standard normal, buffers uniform in
``[0, 1)`` so that variances and counts stay non-negative.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import ReplayInputError
from ..ir.records import TensorMeta
from ..ir.trace import Trace
from .devices import keeps_cpu, target
from .inputs import given_tensors
from .streams import MadeUp
from .writes import written_leaves

__all__ = ["bind_leaves", "caller_tensors", "leaf_bytes", "index_bounds", "make_tensor"]


def bind_leaves(
    trace: Trace, args, kwargs, module, device, seed: int, made_up: list | None = None, given: dict | None = None
) -> dict:
    """id -> real tensor on ``device`` for every leaf; see the module docstring.

    The trace's constants are copies (replay may hand one out as an output),
    leaves the trace may write are, and so is every leaf whose real tensor
    shares a storage with one of them (Note [Replay never writes its
    inputs] in execution/replay.py, writes.py); aliasing between them is kept.  Each
    leaf filled without data is appended to ``made_up`` as a
    :class:`~metadispatch.binding.streams.MadeUp`.  ``given`` is
    :func:`~metadispatch.binding.inputs.given_tensors` of the inputs, when
    the caller has it already (so do the functions below).
    """
    given = given_tensors(args, kwargs, module) if given is None else given
    written = written_leaves(trace)
    copies: dict = {}  # storage key of a given tensor -> its copy's storage
    shared: dict = {}  # storage key of a caller's tensor -> ids of the leaves bound to it
    out, missing = {}, []
    on = _on(device)
    keep_cpu = keeps_cpu(trace, device)  # Note [Devices in replay]
    for tid, leaf in trace.leaves.items():
        t = _real(leaf, given)
        if t is None:
            missing.append(leaf.meta)
            continue
        if made_up is not None and leaf.kind == "const" and leaf.name:
            made_up += _changed_constant(trace, leaf, given.get(("const", leaf.name)))
        m = leaf.meta
        if t.shape != m.shape or t.dtype is not m.dtype:
            raise ReplayInputError(
                f"replay: {leaf.kind} {leaf.name or f'${tid}'} is {t.dtype}{list(t.shape)}, "
                f"the trace recorded {m.dtype}{list(m.shape)}"
            )
        if keep_cpu and m.device.type == "cpu":
            moved = t.detach().cpu()  # the tensor itself when it is on the CPU
        else:
            moved = t.detach() if on(t) else t.detach().to(device)
        if (
            (leaf.kind == "const" or leaf.value is not None)
            and moved.layout == torch.strided
            and moved.data_ptr() == t.data_ptr()
        ):
            # The trace's own tensor: replay may hand it out as an output, and
            # a caller writing that output must not change the next replay.
            moved = _copy_keeping_aliases(moved, copies)
        elif written and moved.layout == torch.strided and _compat.storage_key(moved) == _compat.storage_key(t):
            shared.setdefault(_compat.storage_key(t), []).append(tid)
        out[tid] = moved
    for tids in shared.values():  # empty when the trace writes no leaf
        if not written.isdisjoint(tids):
            for tid in tids:
                out[tid] = _copy_keeping_aliases(out[tid], copies)
    out.update(_made_up(trace, missing, device, seed, keep_cpu))
    if made_up is not None and missing:
        made_up += _listed(trace, missing)
    return out


def _on(device):
    """``on(t)``: ``t`` is on ``device`` already, so ``.to(device)`` would return it (a cheap test on CPU)."""
    if device.type == "cpu":
        return lambda t: t.is_cpu
    return lambda t: t.device == device


def _changed_constant(trace: Trace, leaf, now) -> list:
    """Note [Values fixed into a trace] in execution/matching.py: a module attribute the
    trace holds the value of, which the module given to replay holds another of."""
    fixed = leaf.value
    if now is None or fixed is None:
        return []
    with _compat.no_torch_function():
        same = now.shape == fixed.shape and now.dtype == fixed.dtype and torch.equal(now.detach().cpu(), fixed)
    if same:
        return []
    first = next((c.index for c in trace.calls if any(i.id == leaf.meta.id for i in c.inputs)), None)
    return [
        MadeUp(
            f"const {leaf.name}",
            first,
            f"the trace holds its value when traced ({_shown(fixed)}); the module given holds "
            f"{_shown(now)}, which eager would read",
        )
    ]


def _shown(t: torch.Tensor) -> str:
    return str(t.tolist()) if t.numel() <= 8 else f"{t.dtype} {list(t.shape)}"


def _real(leaf, given: dict) -> torch.Tensor | None:
    """The real tensor for ``leaf``, or None: not given (Note [Views of leaves] in core/record.py)."""
    if leaf.kind == "const":
        # A module attribute above the constant limit is bound from the module given.
        return leaf.value if leaf.value is not None or not leaf.name else given.get(("const", leaf.name))
    if leaf.kind == "state" and leaf.value is not None:
        return leaf.value  # Note [Known state across a cut] in ir/cut.py
    if leaf.kind != "view":
        return given.get((leaf.kind, leaf.name))
    base = given.get(tuple(leaf.name.split(" ", 1)))
    if base is None or base.layout != torch.strided:
        return None
    m = leaf.meta
    try:
        return base.detach().as_strided(m.shape, m.stride, m.storage_offset)
    except RuntimeError as e:  # out of the base's storage: the trace and the base disagree
        raise ReplayInputError(f"replay: view of {leaf.name} ${m.id}: {e}") from None


def leaf_bytes(trace: Trace, args, kwargs, module, given: dict | None = None) -> int:
    """Bytes ``bind_leaves`` will allocate: made-up leaves, and copies of written ones."""
    given = given_tensors(args, kwargs, module) if given is None else given
    written = written_leaves(trace)
    total = 0
    for tid, leaf in trace.leaves.items():
        t = _real(leaf, given)
        if t is None:
            total += _extent(leaf.meta) * leaf.meta.dtype.itemsize
        elif tid in written or leaf.kind == "const":
            total += t.untyped_storage().nbytes() if t.layout == torch.strided else 0
    return total


def caller_tensors(trace: Trace, args, kwargs, module, given: dict | None = None) -> list:
    """The tensors replay must not write: the caller's and the trace's constants."""
    consts = [leaf.value for leaf in trace.leaves.values() if leaf.value is not None]
    given = given_tensors(args, kwargs, module) if given is None else given
    return list(given.values()) + consts


def _copy_keeping_aliases(t: torch.Tensor, copies: dict) -> torch.Tensor:
    key = _compat.storage_key(t)
    storage = copies.get(key)
    if storage is None:
        storage = copies[key] = t.untyped_storage().clone()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


# -- made-up leaves

_WHY = {
    "arg": "no argument of that name was given; filled with made-up values",
    "param": "no module was given; filled with made-up values",
    "buffer": "no module was given; filled with made-up values",
    "grad": "no module was given; its .grad filled with made-up values",
    "view": "a view of a tensor that was not given; filled with made-up values",
    "state": "made by a step before the traced one (md.tracer(warmup=N), md.memory(since=)), whose calls "
    "the trace does not hold; filled with made-up values",
    "input": "the trace recorded no source for this tensor (it reached the traced code from "
    "outside any recorded call, without a name); filled with made-up values",
}


def _listed(trace: Trace, missing: list) -> list:
    first: dict = {}
    ids = {m.id for m in missing}
    for call in trace.calls:
        for m in call.inputs:
            if m.id in ids:
                first.setdefault(m.id, call.index)
        if len(first) == len(ids):
            break
    out = []
    for m in missing:
        leaf = trace.leaves[m.id]
        name = f"{leaf.kind} {leaf.name}" if leaf.name else f"{leaf.kind} ${m.id}"
        out.append(MadeUp(name, first.get(m.id), _WHY.get(leaf.kind, _WHY["input"])))
    return out


def _made_up(trace: Trace, missing: list, device, seed: int, keep_cpu: bool) -> dict:
    if not missing:
        return {}
    gen = torch.Generator().manual_seed(seed)
    bounds = index_bounds(trace)
    by_storage: dict = {}
    for m in missing:
        by_storage.setdefault((m.storage, m.dtype), []).append(m)
    out = {}
    for (_, dtype), metas in sorted(by_storage.items(), key=lambda kv: kv[1][0].id):
        extent = max(_extent(m) for m in metas)
        bound = min((bounds[m.id] for m in metas if m.id in bounds), default=None)
        buffer = trace.leaves[metas[0].id].kind == "buffer"
        flat = _fill(extent, dtype, bound, buffer, gen).to(target(metas[0].device, device, keep_cpu))
        for m in metas:
            out[m.id] = flat.as_strided(m.shape, m.stride, m.storage_offset)
    return out


def _extent(m: TensorMeta) -> int:
    if 0 in m.shape:
        return m.storage_offset
    return m.storage_offset + sum((s - 1) * st for s, st in zip(m.shape, m.stride)) + 1


def _fill(n: int, dtype, bound, buffer: bool, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.ones(n, dtype=dtype)
    if dtype.is_floating_point or dtype.is_complex:
        draw = torch.rand if buffer else torch.randn
        return draw(n, generator=gen).to(dtype)
    if bound is None:
        return torch.ones(n, dtype=dtype)
    return torch.randint(0, max(bound, 1), (n,), generator=gen).to(dtype)


def make_tensor(shape, dtype, stride, offset=0, device="cpu", gen=None) -> torch.Tensor:
    """A real tensor with exactly this layout, filled like an unbounded leaf.

    >>> make_tensor((2, 3), torch.float32, (1, 2)).stride()
    (1, 2)
    """
    m = TensorMeta(0, tuple(shape), dtype, tuple(stride), offset, torch.device(device), False, 0)
    flat = _fill(_extent(m), dtype, None, False, gen or torch.Generator().manual_seed(0))
    return flat.to(device).as_strided(m.shape, m.stride, m.storage_offset)


# -- valid index values


def _dim_size(t: TensorMeta, dim: int) -> int:
    return t.shape[dim] if t.shape else 1


def _nll_classes(inp: TensorMeta) -> int:
    return inp.shape[1] if len(inp.shape) >= 2 else _dim_size(inp, 0)


# op -> function(args) yielding (index TensorMeta, exclusive upper bound)
_CONSUMERS = {
    "aten.embedding.default": lambda a: [(a[1], a[0].shape[0])],
    "aten.index_select.default": lambda a: [(a[2], _dim_size(a[0], a[1]))],
    "aten.gather.default": lambda a: [(a[2], _dim_size(a[0], a[1]))],
    "aten.scatter.src": lambda a: [(a[2], _dim_size(a[0], a[1]))],
    "aten.scatter_add.default": lambda a: [(a[2], _dim_size(a[0], a[1]))],
    "aten.index.Tensor": lambda a: [(i, a[0].shape[k]) for k, i in enumerate(a[1]) if isinstance(i, TensorMeta)],
    "aten.nll_loss_forward.default": lambda a: [(a[1], _nll_classes(a[0]))],
    "aten.nll_loss2d_forward.default": lambda a: [(a[1], _nll_classes(a[0]))],
}

# Ops whose outputs hold only values of their inputs: a bound on the output
# is a bound on the inputs.
_PASS_THROUGH = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.clone.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.expand.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.squeeze.default",
    "aten.constant_pad_nd.default",
    "aten._to_copy.default",
    "aten.lift_fresh.default",
    "aten.lift_fresh_copy.default",
    "aten.cat.default",
    "aten.stack.default",
    "aten.narrow.default",
    "aten.contiguous.default",
    "aten.copy_.default",
    "aten.flatten.using_ints",
}


def index_bounds(trace: Trace) -> dict:
    """Tensor id -> exclusive upper bound its values must respect.

    >>> import torch, metadispatch as md
    >>> emb = torch.nn.Embedding(10, 4)
    >>> t = md.trace(lambda ids: emb(ids[:, 1:]), torch.zeros(2, 5, dtype=torch.long))
    >>> index_bounds(t)[0]
    10
    """
    bounds: dict = {}
    for call in reversed(trace.calls):
        consumer = _CONSUMERS.get(call.op)
        if consumer is not None:
            for m, limit in consumer(call.args):
                bounds[m.id] = min(bounds.get(m.id, limit), limit)
        elif call.op in _PASS_THROUGH:
            outs = [bounds[o.id] for o in call.output_metas if o.id in bounds]
            if outs:
                limit = min(outs)
                for m in call.inputs:
                    bounds[m.id] = min(bounds.get(m.id, limit), limit)
    return bounds
