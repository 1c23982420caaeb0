"""How a call's inputs read in an error message, and the error for a call that needs their values.

Used by every stage that refuses a call (the router, composites that read
values, rules): one spelling of ``f32[2, 3]@cuda:0, i64[4]`` everywhere.
"""

from __future__ import annotations

import torch

from ..errors import DataDependentError
from ..ir.records import type_str
from .tensor import MetaTensor

__all__ = ["describe_inputs", "data_dependent_error", "data_dependent_message"]


def describe_inputs(args, kwargs) -> str:
    parts = []

    def visit(x):
        if isinstance(x, torch.Tensor):
            dev = x._md.device if isinstance(x, MetaTensor) else x.device
            parts.append(type_str(x.dtype, x.shape, device=dev, show_cpu=True))
        elif type(x) in (list, tuple):
            for y in x:
                visit(y)

    visit(tuple(args))
    visit(tuple(kwargs.values()))
    return ", ".join(parts) or "no tensors"


def data_dependent_error(name, args, kwargs) -> DataDependentError:
    return DataDependentError(data_dependent_message(name, args, kwargs), op=name)


def data_dependent_message(name, args, kwargs) -> str:
    what = name
    if name == "aten._local_scalar_dense.default":
        what = f"{name} (Tensor.item(), bool(t), int(t), float(t))"
    return (
        f"{what} needs the values of its input ({describe_inputs(args, kwargs)}); "
        "a MetaTensor holds no data. Use md.check() to answer it with the real "
        "kernel, or register a rule with @metadispatch.register_meta."
    )
