"""What replay checks while it runs a trace from a file: the fences around each call.

Note [Fences]
~~~~~~~~~~~~~
Some aten kernels trust their arguments more than a trace file deserves:
``_reshape_alias`` sets any sizes and strides without looking at the
storage, so a view can reach past its memory and the next ``fill_`` writes
the heap; a sparse tensor's indices go unchecked until a kernel follows them
(``_sparse_coo_tensor_with_dims_and_tensors`` into ``add_`` writes wherever
the index says); ``bincount`` allocates as much as its input's largest value
asks.  The budget (budget.py) catches most of this before anything runs, from
meta kernels; what it cannot see, replay of an untrusted trace checks as it
goes, in the generated program (execution/program.py), before a later call can use
the result:

- ``fit(n, result, may_alias)`` after call ``n`` where the schema lets an
  output alias an argument (a view) or the budget sized the call from its
  record (``Costs.unchecked``): every tensor it returned is dense and
  strided (not sparse, nested, MKL-DNN or quantized -- a trace records no
  others), a view lies inside its storage, and an unchecked call returned
  the recorded shapes and dtypes, so that the sizes the budget worked out
  for the calls after it hold.  Other calls need no fence: the budget ran
  them on meta, which showed their outputs' layout, and their kernels
  allocate their fresh outputs to fit;
- ``pre(n, *args, **kwargs)`` before a call whose kernel follows its
  inputs' values or shapes unchecked (Note [Checking values before the
  call] in index_checks.py), or of an op with no memory class, and before
  one whose output size is read from its inputs' values (``value_sized`` in
  sizes.py): those values stay inside what the kernel may index, and ask
  for no more bytes than the trace records.

A trace recorded in this process runs without fences: it is trusted as the
code that recorded it is.
"""

from __future__ import annotations

import torch

from ..errors import ReplayError
from ..ir.records import TensorMeta, tensor_metas
from ..spec.schema import facts, schema_of
from . import shape_checks, value_checks  # noqa: F401 -- their checks register themselves (index_checks.CHECKS)
from .costs import OUTPUT_BYTES
from .index_checks import Refusal, index_check, unclassified
from .positions import CHECKED, position
from .sizes import bind, value_sized
from .work import extent_bytes

__all__ = ["fences", "no_fence"]


def no_fence(n: int, *args, **kwargs) -> None:
    return None


def fences(calls: list, unchecked: frozenset):
    """``(fit, pre)`` for the program of an untrusted trace (Note [Fences]).

    The program passes ``fit`` a third argument, true for a call whose
    schema lets an output alias an argument: only those are bounds-checked.
    ``fit`` runs after every view, so the common case -- one plain tensor --
    is kept to a few attribute reads.  ``pre`` runs the call's value check
    (index_checks.py), or the default deny of an op with no memory class.
    """
    checked = [_checks_of(c.func) for c in calls]

    def fit(n: int, result, may_alias: int) -> None:
        for t in (result,) if result.__class__ is torch.Tensor else _tensors(result):
            if t.layout is not _STRIDED or t.is_nested or t.is_quantized:
                _refuse(calls[n], f"returned a {str(t.layout).removeprefix('torch.')} tensor that is not plain strided")
            if may_alias and not _inside(t):
                _refuse(calls[n], f"returned a view {list(t.shape)} with strides {list(t.stride())} beyond its storage")
        if n in unchecked:
            _as_recorded(calls[n], result)

    def pre(n: int, *args, **kwargs) -> None:
        call = calls[n]
        a = bind(call.func, args, kwargs)
        checks = checked[n]
        if checks is not None:
            try:
                checks(a)
            except Refusal as e:
                _refuse(call, f"refused before running: its argument {e.arg!r} {e.what}")
            except Exception as e:  # noqa: BLE001 -- a check that cannot decide refuses (default deny)
                _refuse(call, f"could not be checked before running ({type(e).__name__}: {str(e)[:200]})")
        sized = value_sized(call.func)
        if sized is None:
            return
        try:
            need = sized(a)
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError, OverflowError):
            return  # arguments the kernel will refuse itself
        recorded = _recorded_bytes(call)
        if need > recorded:
            _refuse(call, f"would allocate {need} bytes from its inputs' values; the trace records {recorded}")

    return fit, pre


_STRIDED = torch.strided


def _checks_of(func):
    """The check ``pre`` runs before a call of ``func``: its registered one, the
    default deny of an unclassified op, or None (Note [Values that become positions])."""
    p = position(func)
    if p is None:
        return unclassified
    if p.kind != CHECKED:
        return None
    found = index_check(func)
    return found if found is not None else _no_check


def _no_check(a: dict) -> None:
    raise Refusal("*", "has no value check registered although its op is classed checked")


def _refuse(call, what: str):
    raise ReplayError(f"replay refused: call #{call.index} {call.op} {what}", call=call.index)


def _tensors(r):
    if isinstance(r, torch.Tensor):
        yield r
    elif isinstance(r, (tuple, list)):
        for x in r:
            yield from _tensors(x)


def _inside(t: torch.Tensor) -> bool:
    """``t`` reaches no byte past its storage (extent_bytes, without its checks of the type)."""
    shape = t.shape
    if 0 in shape:
        return True
    if t.is_contiguous():
        last = t.storage_offset() + t.numel()
    else:
        last = t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(shape, t.stride()))
    return last * t.element_size() <= t.untyped_storage().nbytes()


def _as_recorded(call, result) -> None:
    """A call sized from its record returned tensors of the recorded shapes and dtypes."""
    results = (result,) if len(schema_of(call.func).returns) == 1 else tuple(result or ())
    for o, r in zip(call.outputs, results):
        pairs = zip(o, r) if type(o) is tuple and isinstance(r, (tuple, list)) else [(o, r)]
        for m, t in pairs:
            if type(m) is not TensorMeta:
                continue
            if t is None and m.numel == 0:  # Note [Undefined outputs] in execution/matching.py
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != m.shape or t.dtype != m.dtype:
                got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                _refuse(
                    call,
                    f"returned {got} where the trace records {m.dtype}{list(m.shape)}; replay sized the "
                    "calls after it from that record",
                )


def _recorded_bytes(call) -> int:
    """Bytes the record says the call allocates: its fresh outputs, and an object per output."""
    f = facts(call.func)
    total = 0
    for k, o in enumerate(call.outputs):
        metas = list(tensor_metas(o))
        total += OUTPUT_BYTES * len(metas)
        if not (f.aliases[k] if k < len(f.aliases) else ()):
            total += sum(extent_bytes(m) for m in metas)
    return total
