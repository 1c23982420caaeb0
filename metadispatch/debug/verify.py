"""``md.verify_rule``: check what metadispatch answers for an op against its real kernel.

For each sample input, the op runs twice: on real CPU tensors (the
reference) and on MetaTensors with the same metadata (whatever the router
answers: a user rule, a built-in rule, the meta kernel).  Every output is
compared in shape, dtype, significant strides, storage offset, and which
input it aliases.  Works for any op with a CPU kernel, ``torch.library``
custom ops included.

Samples are given (``[(args, kwargs), ...]`` or ``[args, ...]``), or built
from the op's schema: tensors of shape ``(3, 4)``, once contiguous and once
transposed, and the schema's defaults (or small plausible values) for the
rest.  A sample the real kernel rejects is listed as unusable, not as a
disagreement.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _compat
from .._compat import pytree
from ..core.registry import resolve_ops, rule_for
from ..ir.compare import explain
from ..spec.schema import op_name, schema_of
from ..tensor.convert import Converter
from ..values.realrun import alias_pattern

__all__ = ["verify_rule", "RuleCheck", "schema_samples"]


class Disagreement(NamedTuple):
    op: str
    sample: int
    problems: tuple  # "strides (1, 3) != (4, 1)": ours != real


class RuleCheck:
    """The outcome of :func:`verify_rule`; ``ok`` when nothing disagreed.

    Its truth value is ``ok``, so ``assert md.verify_rule(op)`` fails, and
    prints the disagreements, when the rule is wrong.
    """

    def __init__(self, op: str, stages: dict, tried: int, disagreements: list, unusable: list):
        self.op, self.stages, self.tried = op, stages, tried
        self.disagreements, self.unusable = disagreements, unusable

    @property
    def ok(self) -> bool:
        return not self.disagreements and self.tried > len(self.unusable)

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return (
            f"<RuleCheck {self.op}: {self.tried} samples, {len(self.disagreements)} "
            f"disagreements, {len(self.unusable)} unusable>"
        )

    def __str__(self) -> str:
        lines = [repr(self)[1:-1]]
        lines += [f"  {d.op} sample {d.sample}: {p}" for d in self.disagreements for p in d.problems]
        lines += [f"  {op} sample {i}: unusable ({why})" for op, i, why in self.unusable]
        return "\n".join(lines)


def verify_rule(op, samples=None) -> RuleCheck:
    """Compare metadispatch's answer for ``op`` with the real CPU kernel.

    >>> import torch, metadispatch as md
    >>> @md.register_meta(torch.ops.aten.tril.default, override=True)
    ... def bad_tril(x, diagonal=0):
    ...     return torch.empty_like(x).t()   # wrong: transposed
    >>> print(md.verify_rule(torch.ops.aten.tril.default))
    RuleCheck aten.tril.default: 2 samples, 2 disagreements, 0 unusable
      aten.tril.default sample 0: shape (4, 3) != (3, 4)
      aten.tril.default sample 1: shape (4, 3) != (3, 4)
    >>> md.unregister_meta(torch.ops.aten.tril.default)
    """
    ops = resolve_ops(op)
    stages, disagreements, unusable, tried = {}, [], [], 0
    for func in ops:
        name = op_name(func)
        stages[name] = rule_for(func)[1] or "router"
        for i, (args, kwargs) in enumerate(_normalise(samples, func)):
            tried += 1
            try:
                problems = _compare(func, args, kwargs)
            except _Unusable as e:
                unusable.append((name, i, str(e)))
                continue
            if problems:
                disagreements.append(Disagreement(name, i, tuple(problems)))
    label = op_name(ops[0]) if len(ops) == 1 else str(op)
    return RuleCheck(label, stages, tried, disagreements, unusable)


class _Unusable(Exception):
    pass


def _normalise(samples, func):
    if samples is None:
        return schema_samples(func)
    return [(s[0], s[1]) if _is_pair(s) else (tuple(s) if isinstance(s, (list, tuple)) else (s,), {}) for s in samples]


def _is_pair(s) -> bool:
    return isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], (list, tuple)) and isinstance(s[1], dict)


def _clone(x):
    if not isinstance(x, torch.Tensor):
        return x
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
    return out.copy_(x)


def _compare(func, args, kwargs) -> list[str]:
    convert = Converter()
    meta_args, meta_kwargs = pytree.tree_map(lambda x: convert(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    real_args, real_kwargs = pytree.tree_map(_clone, (args, kwargs))
    try:
        with torch.no_grad():
            real = func(*real_args, **real_kwargs)
    except Exception as e:
        raise _Unusable(f"the real kernel raised {type(e).__name__}: {str(e).splitlines()[0][:100]}") from e
    try:
        with torch.no_grad():
            ours = func(*meta_args, **meta_kwargs)
    except Exception as e:
        return [f"raised {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"]
    real_outs = [o for o in pytree.tree_leaves(real) if isinstance(o, torch.Tensor)]
    our_outs = [o for o in pytree.tree_leaves(ours) if isinstance(o, torch.Tensor)]
    if len(real_outs) != len(our_outs):
        return [f"{len(our_outs)} tensor outputs != {len(real_outs)}"]
    problems = []
    for i, (r, m) in enumerate(zip(real_outs, our_outs)):
        where = f"output {i}: " if len(real_outs) > 1 else ""
        problems += [where + p for p in explain(m, r, torch.device("cpu"))]
    key = _compat.storage_key
    ins = pytree.tree_leaves((real_args, real_kwargs))
    want = alias_pattern(real_outs, ins, key)
    got = alias_pattern(our_outs, pytree.tree_leaves((meta_args, meta_kwargs)), key)
    if want != got:
        problems.append(f"aliasing (output -> input index) {got} != {want}")
    return problems


def schema_samples(func) -> list:
    """Two ``(args, kwargs)`` samples built from ``func``'s schema; see the module docstring."""
    return [_sample(func, transposed) for transposed in (False, True)]


def _sample(func, transposed: bool):
    def tensor():
        return torch.randn(4, 3).t() if transposed else torch.randn(3, 4)

    args: list = []
    kwargs: dict = {}
    for a in schema_of(func).arguments:
        t = str(a.type)
        if a.has_default_value():
            value = a.default_value
        elif "Tensor" in t:
            value = [tensor(), tensor()] if t.startswith("List") else tensor()
        else:
            value = _plain(t)
        (kwargs.__setitem__(a.name, value) if a.kwarg_only else args.append(value))
    return tuple(args), kwargs


def _plain(t: str):
    if t.startswith("Optional"):
        return None
    if "int" in t.lower():
        return [3, 4] if t.startswith("List") else 1
    return {"float": 0.5, "bool": False, "Scalar": 2, "str": "none", "Device": "cpu", "ScalarType": torch.float32}.get(
        t
    )
