"""``trace[i].repro()``: one call as a standalone snippet for a bug report.

The snippet imports only torch.  It rebuilds each tensor input with the
recorded shape, dtype, strides and storage offset (values are made up:
normal floats, zero integers -- always valid indices -- and true booleans),
runs the op on a real device, and compares every tensor output with the
metadata the trace recorded, printing what differs.

Nothing from the trace is pasted as text (the trace may come from a file
anyone wrote): the op is written from its registry name, keyword names must
be parameters of its schema, values are ``repr``-escaped literals, and the
comment quoting the call has every non-printable character escaped.

Limits: inputs that shared a storage in the trace are rebuilt separately
(the same id is the same tensor), and values are not the traced ones.
"""

from __future__ import annotations

import math

import torch

from ..errors import MetaDispatchError
from ..spec.schema import schema_of
from .records import Group, TensorMeta, tensor_metas
from .rng import is_generator
from .text import printable

__all__ = ["repro"]

_HEADER = '''\
import torch

device = {device!r}


def make(shape, dtype, stride, offset):
    """A tensor with exactly this layout; made-up values."""
    size = offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else offset
    if dtype.is_floating_point or dtype.is_complex:
        flat = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(dtype)
    else:
        flat = torch.ones(size, dtype=dtype) if dtype == torch.bool else torch.zeros(size, dtype=dtype)
    return flat.to(device).as_strided(shape, stride, offset)


def tensors(r):
    if isinstance(r, torch.Tensor):
        return [r]
    return [t for x in r for t in tensors(x)] if isinstance(r, (list, tuple)) else []

'''

_FOOTER = """
for i, (o, (shape, dtype, stride, offset)) in enumerate(zip(outputs, expected)):
    got = (tuple(o.shape), o.dtype, o.stride(), o.storage_offset())
    if got != (shape, dtype, stride, offset):
        print(f"output {{i}}: recorded {{(shape, dtype, stride, offset)}}, real {{got}}")
    else:
        print(f"output {{i}}: ok {{got}}")
"""


def repro(call, device="cpu") -> str:
    """A runnable snippet reproducing ``call`` on ``device``.

    >>> import torch, metadispatch as md
    >>> t = md.trace(lambda x: x.t() @ x, torch.ones(3, 2))
    >>> exec(t[1].repro(), {})
    output 0: ok ((2, 2), torch.float32, (2, 1), 0)
    """
    lines = [_HEADER.format(device=str(device))]
    where = f" in {call.module}" if call.module else ""
    lines.append(printable(f"# call #{call.index}{where} ({call.phase}), metadata from rule {call.rule!r}:"))
    lines.append(printable(f"#   {call.format()}"))
    seen = set()
    for m in call.inputs:
        if m.id not in seen:
            seen.add(m.id)
            lines.append(f"t{m.id} = make({m.shape!r}, {m.dtype}, {m.stride!r}, {m.storage_offset})")
    sources = [_src(a) for a in call.args]
    params = {a.name for a in schema_of(call.func).arguments}
    for k in call.kwargs:
        if k not in params or not k.isidentifier():
            raise MetaDispatchError(f"repro: call #{call.index} {call.op} has no parameter {k!r}")
    args = ", ".join(sources + [f"{k}={_src(v)}" for k, v in call.kwargs.items()])
    ns, _, rest = call.func.name().partition("::")
    name, _, overload = rest.partition(".")
    lines.append(f"result = torch.ops.{ns}.{name}.{overload or 'default'}({args})")
    outs = list(tensor_metas(call.outputs))
    lines.append("outputs = tensors(result)")
    lines.append(
        "expected = [" + ", ".join(f"({m.shape!r}, {m.dtype}, {m.stride!r}, {m.storage_offset})" for m in outs) + "]"
    )
    lines.append(_FOOTER.format())
    return "\n".join(lines)


def _src(a) -> str:
    """Python source for one recorded argument: literals only, nested ones too."""
    if isinstance(a, TensorMeta):
        return f"t{a.id}"
    if isinstance(a, (tuple, list)):
        return "[" + ", ".join(_src(x) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{_src(k)}: {_src(v)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.device):
        return "device"
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if is_generator(a):
        return "None"
    if isinstance(a, Group):  # c10d's functional ops name a group by its name
        return repr(a.name)
    if isinstance(a, bool) or a is None:
        return repr(a)
    if isinstance(a, float):
        # repr(nan) is ``nan``, which is no Python literal
        return repr(a) if math.isfinite(a) else f"float({str(a)!r})"
    if isinstance(a, complex):
        return f"complex({_src(a.real)}, {_src(a.imag)})"
    return repr(a)
