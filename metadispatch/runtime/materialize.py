"""Deferred initialisation: give a module built on meta its real weights.

Build a module under a recording :class:`~metadispatch.MetaMode` and every
construction op -- ``torch.empty``, ``normal_``, the arithmetic that computes
a rotary ``inv_freq`` -- is in the mode's trace, and every parameter and
buffer carries the id of the tensor that trace built.  ``md.materialize``
replays that trace on a real device, starting the CPU generator from the
state it had when the mode was entered, and swaps each MetaTensor for its
real value.  So a module built with seed *s* on meta equals, bit for bit, one
built eagerly with seed *s* -- non-persistent buffers included, which is
where ``module.to_empty()`` leaves garbage.

Limits: bit-exactness needs the same kernels, so materialise on the CPU (a
CUDA generator draws different numbers); construction must not read tensors
from outside the mode other than small constants, which the trace keeps.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import MetaDispatchError
from .leaves import bind_leaves
from .replay import execute
from ..core.tensor import MetaTensor, normalize_device

__all__ = ["materialize"]


def materialize(module: nn.Module, device="cpu") -> nn.Module:
    """Replace every MetaTensor parameter and buffer of ``module`` by its real value.

    >>> import torch, metadispatch as md
    >>> _ = torch.manual_seed(0)
    >>> with md.MetaMode():
    ...     lin = torch.nn.Linear(3, 2)
    >>> md.materialize(lin).weight.device
    device(type='cpu')
    >>> _ = torch.manual_seed(0)
    >>> torch.equal(lin.weight, torch.nn.Linear(3, 2).weight)
    True
    """
    device = normalize_device(device)
    slots = [(mod, table, key, t) for name, mod in module.named_modules(remove_duplicate=False)
             for table in (mod._parameters, mod._buffers)
             for key, t in table.items() if isinstance(t, MetaTensor)]
    real = {}  # id(MetaTensor) -> real tensor: tied parameters stay tied
    for rec, metas in _by_recorder(module, slots).items():
        trace = rec.trace
        env, _, _ = execute(trace, lambda: bind_leaves(trace, (), None, None, device, 0), device,
                            check=False, keep_all=True)
        for t in metas:
            value = env[t.__dict__["_md"][1].id]
            real[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(
                t, nn.Parameter) or getattr(t, "_is_param", False) else value
    for mod, table, key, t in slots:
        table[key] = real[id(t)]
    return module


def _by_recorder(module: nn.Module, slots: list) -> dict:
    groups: dict = {}
    names = {id(t): n for n, t in list(module.named_parameters(remove_duplicate=False))
             + list(module.named_buffers(remove_duplicate=False))}
    for _, _, _, t in slots:
        md = t.__dict__.get("_md")
        if md is None or getattr(md[0], "trace", None) is None:
            raise MetaDispatchError(
                f"materialize: {names.get(id(t), 'a tensor')} was not built under a recording "
                "MetaMode, so there is no construction to replay (md.to_meta copies hold "
                "no values; use load_state_dict instead)")
        group = groups.setdefault(md[0], [])
        if all(x is not t for x in group):
            group.append(t)
    return groups
