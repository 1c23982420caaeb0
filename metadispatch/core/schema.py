"""Facts about an op that follow from its schema, computed once and cached.

The dispatcher asks the same questions of every call (does it mutate an
argument, is its output a view, where is its ``device`` argument, does its
output size depend on data); answering them from ``func._schema`` each time
would cost more than the meta kernel.  ``facts(func)`` memoises the answers
per ``OpOverload``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _compat

__all__ = ["OpFacts", "facts", "op_name"]


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
    passthrough: bool  # profiler annotations: run as they are, never recorded


_CACHE: dict = {}

# index.Tensor carries the dynamic_output_shape tag for boolean masks only;
# a built-in rule decides per call (see rules/data_dependent.py).
_SHAPE_DEPENDS_ONLY_SOMETIMES = {"aten::index.Tensor", "aten::index.Tensor_out"}


def op_name(func) -> str:
    """``aten.mm.default`` style name of an OpOverload."""
    ns, _, rest = func.name().partition("::")
    base, _, overload = rest.partition(".")
    return f"{ns}.{base}.{overload or 'default'}"


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
    returns_write = []
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
            target = next((i for i, a in enumerate(args)
                           if a.alias_info is not None and not a.alias_info.is_write), None)
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
    cacheable = not data_dependent and torch.Tag.inplace_view not in tags
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
        passthrough=name.startswith("profiler::"),
    )
