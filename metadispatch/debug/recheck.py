"""Re-running every recorded call on CPU and comparing its metadata.

For each call of a trace: materialise its recorded inputs (tensors that
shared a storage share one again), run the real CPU kernel, and compare every
output with what was recorded -- shape, dtype, significant strides, storage
offset, and which input storage it aliases.  ``md.check`` uses it; a fuller
replay (chains of calls on real values) is ``md.replay``'s job.

Skipped, and listed as such: calls answered by the real kernel already,
data-dependent ops (their outputs depend on made-up data), calls whose
outputs live on a device other than CPU (the CPU kernel is not their
reference; ``meta`` counts as CPU, see ``_common_device`` in dispatch.py),
third-party ops answered by their own meta kernel (their kernels need not
check indices, and made-up ones could crash the process), and calls the real
kernel refuses on made-up data.  A call the real kernel refuses on its
recorded constant indices is a mismatch (Note [Indices the device refuses]).
"""

from __future__ import annotations

import torch

from .. import _compat
from .._compat import pytree
from ..ir.compare import Mismatch, describe, differences
from ..ir.rng import is_generator
from ..ir.trace import TensorMeta
from ..spec.schema import facts
from ..values.realrun import materialize, run_real

__all__ = ["recheck", "Mismatch"]

# Kernels that check their index arguments.  Others (torchvision's
# ``_roi_align_backward`` reading a made-up batch index from ``rois``) may
# write out of bounds on made-up data and take the process down; their meta
# kernels come with the library, ours (user rules) are still re-checked.
_CHECKED_NAMESPACES = ("aten.", "prims.")
_UNCHECKED = "a third-party kernel, not run on made-up data"


def recheck(trace, limit) -> tuple[list, list]:
    """(mismatches, skipped) for every call of ``trace``; see the module docstring."""
    consts = {leaf.meta: leaf.value for leaf in trace.leaves.values() if leaf.value is not None}
    mismatches, skipped = [], []
    for call in trace.calls:
        if call.rule == "real" or facts(call.func).data_dependent or not call.output_metas:
            continue
        if any(m.device.type not in ("cpu", "meta") for m in call.output_metas):
            skipped.append((call.index, call.op, f"on {call.output_metas[0].device}"))
            continue
        if call.rule != "user" and not call.op.startswith(_CHECKED_NAMESPACES):
            skipped.append((call.index, call.op, _UNCHECKED))
            continue
        try:
            found = _check_call(call, consts, limit)
        except IndexError as e:
            first = str(e).strip().splitlines()[0][:120]
            if not _indices_are_constants(call, consts):
                skipped.append((call.index, call.op, first))
                continue
            # Note [Indices the device refuses]
            found = [("raises", "nothing", f"IndexError: {first}")]
        except Exception as e:  # made-up data the kernel refuses, inputs over the limit
            skipped.append((call.index, call.op, str(e).strip().splitlines()[0][:120]))
            continue
        if found:
            # One Mismatch per call, its fields prefixed with the output where
            # the call has several ("output 1: stride").
            fields = tuple(f for f, _, _ in found)
            mismatches.append(
                Mismatch(
                    call.index,
                    call.op,
                    call.module,
                    call.rule,
                    None,
                    fields,
                    {f: want for f, want, _ in found},
                    {f: got for f, _, got in found},
                    tuple(_words(f, want, got) for f, want, got in found),
                )
            )
    return mismatches, skipped


# Note [Indices the device refuses]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A meta kernel checks shapes, not index values: ``x[torch.tensor([0, 5])]``
# on a 3-row ``x`` is answered ``f32[2, ...]`` where every device raises
# IndexError.  When the re-check's real kernel raises IndexError and every
# integer tensor the call reads is a recorded constant (its real value, not
# made-up data), the indices really are out of range: that is a mismatch
# (the trace describes a program that cannot run), not a call "not
# re-checked".  An IndexError with a made-up index stays a skip.
def _indices_are_constants(call, consts) -> bool:
    ints = [m for m in call.inputs if not m.dtype.is_floating_point and not m.dtype.is_complex]
    return bool(ints) and all(consts.get(m) is not None for m in ints)


def _words(field: str, recorded, real) -> str:
    where, _, name = field.rpartition(": ")
    if name == "raises":
        text = f"the real kernel raises {real}"
    elif name == "aliasing":
        text = f"aliases {recorded} != {real}"
    elif name == "outputs":
        text = f"{recorded} tensor outputs != {real}"
    else:
        text = describe(name, recorded, real)
    return f"{where}: {text}" if where else text


def _check_call(call, consts, limit) -> list[tuple]:
    """``(field, recorded, real)`` for each difference of ``call``'s outputs."""
    args, kwargs = pytree.tree_map(
        lambda x: None if is_generator(x) else x,
        (call.args, dict(call.kwargs)),
        is_leaf=lambda x: isinstance(x, TensorMeta),
    )
    real_args, real_kwargs = materialize(args, kwargs, limit=limit, ints=0, value_of=lambda m: consts.get(m))
    storage_of = {
        _compat.storage_key(r): m.storage for m, r in zip(_metas((args, kwargs)), _metas((real_args, real_kwargs)))
    }
    input_storages = {m.storage for m in call.inputs}
    real_outs = [
        o for o in pytree.tree_leaves(run_real(call.func, real_args, real_kwargs)) if isinstance(o, torch.Tensor)
    ]
    recorded = call.output_metas
    if len(real_outs) != len(recorded):
        return [("outputs", len(recorded), len(real_outs))]
    found = []
    for i, (m, r) in enumerate(zip(recorded, real_outs)):
        where = f"output {i}: " if len(recorded) > 1 else ""
        found += [(where + field, want, got) for field, want, got in differences(m, r)]
        got_alias = m.storage if m.storage in input_storages else None
        want_alias = storage_of.get(_compat.storage_key(r))
        if got_alias != want_alias:
            found.append((where + "aliasing", _alias(got_alias), _alias(want_alias)))
    return found


def _metas(tree) -> list:
    return [
        x
        for x in pytree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, TensorMeta))
        if isinstance(x, (TensorMeta, torch.Tensor))
    ]


def _alias(storage) -> str:
    return "nothing" if storage is None else f"input storage #{storage}"
