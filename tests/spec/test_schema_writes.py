"""What an op writes, checked against its real CPU kernel (Note [What an op
writes and aliases] in spec/schema.py).

Replay copies a leaf only if some call writes it, and guards only the
arguments ``facts(op).writes`` names; an argument a kernel writes without
its schema saying so (batch norm's running statistics) must be listed in
``_UNANNOTATED_WRITES``, or replay writes the caller's tensor.  This test
runs every overload of the op families that keep state in their arguments
(norms, RNNs, dropout, quantization observers, AMP, set_) on CPU with
made-up inputs, and fails if one changes an argument ``writes`` leaves out.
"""

from __future__ import annotations

import re

import pytest
import torch

from metadispatch import _compat
from metadispatch.ir.decode import resolve_op
from metadispatch.spec.schema import facts

_FAMILIES = re.compile(
    r"batch_norm|instance_norm|layer_norm|group_norm|_rnn|dropout|copy_from|set_|obs_fq|fake_quant|_amp_|sobol"
    r"|rrelu|renorm|_fused_"
)
_PER_CHANNEL = re.compile(r"weight|bias|running_|save_|mean|invstd|var|scale|zero_point|noise|counts?$")
# What must run here, so that a torch that renames or stops running them
# fails this test instead of passing it with nothing checked.
_MUST_RUN = {
    "aten::batch_norm",
    "aten::native_batch_norm",
    "aten::native_batch_norm.out",
    "aten::_batch_norm_impl_index",
    "aten::instance_norm",
    "aten::batch_norm_update_stats",
    "aten::batch_norm_update_stats.out",
    "aten::_native_batch_norm_legit",
    "aten::_batch_norm_with_update",
}
# Kernels that run only on CUDA/ROCm: their statistics are listed all the same.
_GPU_ONLY = [
    "aten::cudnn_batch_norm",
    "aten::cudnn_batch_norm.out",
    "aten::miopen_batch_norm",
    "aten::miopen_batch_norm.out",
    "aten::batch_norm_gather_stats",
    "aten::batch_norm_gather_stats_with_counts.out",
]


def _op(qualified: str):
    name, _, overload = qualified.partition("::")[2].partition(".")
    return resolve_op(f"aten.{name}.{overload or 'default'}")


def _family_ops() -> list:
    names = sorted(q for q in _compat.registered_op_names() if q.startswith("aten::") and _FAMILIES.search(q))
    return [(q, f) for q in names if (f := _op(q)) is not None]


def _value(a):
    """A made-up argument for schema argument ``a``: (N=2, C=3, L=4) inputs, C-sized statistics."""
    t = str(a.type).removeprefix("Optional[").removesuffix("]")
    if "Tensor" in t and "List" in t:
        raise TypeError(t)  # list families (_foreach, _fused_adam) annotate their writes
    if t == "Tensor":
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write:
            return torch.empty(0)  # out=: resized by the kernel
        return torch.rand(3) + 0.5 if _PER_CHANNEL.search(a.name) else torch.randn(2, 3, 4)
    if t == "List[bool]":
        return [True, True, True]
    simple = {"bool": True, "float": 0.1, "number": 0.5, "int": 2 if "count" in a.name else 0}
    if t in simple:
        return simple[t]
    if a.has_default_value():
        return a.default_value
    raise TypeError(t)


def _run(func) -> set | None:
    """Names of the tensor arguments ``func``'s CPU kernel changed; None if it cannot run here."""
    schema = func._schema
    try:
        values = [_value(a) for a in schema.arguments]
    except TypeError:
        return None
    before = [v.clone() if isinstance(v, torch.Tensor) else None for v in values]
    args = [v for a, v in zip(schema.arguments, values) if not a.kwarg_only]
    kwargs = {a.name: v for a, v in zip(schema.arguments, values) if a.kwarg_only}
    try:
        func(*args, **kwargs)
    except (RuntimeError, NotImplementedError, ValueError, TypeError, IndexError):
        return None
    return {
        a.name
        for a, v, b in zip(schema.arguments, values, before)
        if b is not None and b.numel() and not (v.shape == b.shape and torch.equal(v, b))
    }


def test_schema_writes_name_every_argument_a_family_kernel_writes():
    ran, missing = set(), {}
    for name, func in _family_ops():
        changed = _run(func)
        if changed is None:
            continue
        ran.add(name)
        unlisted = changed - {n for _, n in facts(func).writes}
        if unlisted:
            missing[name] = sorted(unlisted)
    assert missing == {}
    assert _MUST_RUN <= ran


@pytest.mark.parametrize("name", _GPU_ONLY)
def test_schema_writes_name_the_statistics_of_gpu_only_batch_norms(name):
    writes = {n for _, n in facts(_op(name)).writes}
    assert {"running_mean", "running_var"} <= writes


@pytest.mark.parametrize("name", ["aten::set_.source_Tensor_storage_offset", "aten::set_.source_Tensor"])
def test_schema_writes_set_may_grow_its_source_and_then_shares_it(name):
    f = facts(_op(name))
    assert (1, "source") in f.writes
    assert f.aliases == (((1, "source"),),)
