"""Expert parallelism for transformers' fused MoE experts: each rank holds ``experts / ep`` of them.

Note [Dropless expert parallelism on transformers' experts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' MoE blocks (Qwen3-MoE, Mixtral, ...) call an ``experts``
module with ``(hidden_states, top_k_index, top_k_weights)``, its weights
3-d parameters ``[experts, ...]``.  :func:`expert_parallel` keeps rank
``r``'s slice ``[r * local, (r + 1) * local)`` of each and replaces the
module's forward by torchtitan's dropless dispatch (its ``ExpertParallel``
style): the picks are counted per expert (``histc`` of the top-k
indices), the counts exchanged over the EP group (``all_to_all_single``)
and read (``.tolist()``) as the split sizes of the tokens' all-to-all;
the received rows, ``[source rank][local expert]``, go through the
module's own forward (its grouped-mm or eager kernel) as one pick each,
come back by the reverse all-to-all and are weighted and summed per
token.  The counts are data another rank routes, so a traced rank needs a
declared routing (``md.RoutingAssumption``, Note [Dispatching under a
declared routing] in values/routing.py); a real run reads them.

A rank no token is routed to gets no rows: transformers' eager experts
then return ``zeros_like`` of them, cut off from autograd, so without
care this rank's backward would skip the combine's and the dispatch's
all-to-alls the other ranks wait in (a real gloo job hangs, then dies).
The empty output is tied to the received rows (``+ got.sum() * 0``, ops on
empty tensors) so every rank runs them (tests/world/test_expert_parallel_gloo.py,
the ``worst`` routing).

Limits: no capacity, no token dropping; the experts are not split by TP
(under TP every TP rank routes the same whole tokens, over the EP group at its TP coordinate); every rank of the EP group holds
as many experts.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import _compat
from ..errors import MetaDispatchError

__all__ = ["expert_parallel", "expert_modules"]


def expert_modules(model: nn.Module) -> list:
    """The modules holding fused experts: a 3-d parameter per expert family and ``num_experts``."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "num_experts", None), int)
        and any(p.dim() == 3 for p in m.parameters(recurse=False))
        and all(p.shape[0] == m.num_experts for p in m.parameters(recurse=False))
    ]


def expert_parallel(experts: nn.Module, mesh) -> nn.Module:
    """Keep this rank's ``num_experts / mesh.size()`` experts of ``experts`` and dispatch to them (Note above)."""
    ep, total = mesh.size(), experts.num_experts
    if total % ep:
        raise MetaDispatchError(f"expert_parallel: ep {ep} does not divide num_experts={total}")
    local = total // ep
    lo = mesh.get_local_rank() * local
    for name, p in list(experts.named_parameters(recurse=False)):
        setattr(experts, name, nn.Parameter(p.detach()[lo : lo + local].clone(), requires_grad=p.requires_grad))
    experts.num_experts = local
    experts.forward = functools.partial(_dispatch, experts.forward, mesh.get_group(), ep, local)
    return experts


def _dispatch(local_forward, group, ep: int, local: int, hidden, top_k_index, top_k_weights):
    funcol = _compat.functional_collectives_module()
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    counts = torch.histc(flat.float(), bins=ep * local, min=0, max=ep * local - 1)
    received = funcol.all_to_all_single(counts, None, None, group)
    send = counts.view(ep, local).sum(1).long().tolist()
    recv = received.view(ep, local).sum(1).long().tolist()
    order = flat.argsort(stable=True)
    token = order // k
    got = funcol.all_to_all_single_autograd(hidden[token], recv, send, group)
    sizes = received.long().tolist()  # [source rank][local expert]
    # int64 even when this rank receives no token (an empty list would make a float tensor)
    ids = torch.tensor(
        [j % local for j, n in enumerate(sizes) for _ in range(n)], dtype=torch.long, device=hidden.device
    )
    ones = torch.ones(len(ids), 1, dtype=top_k_weights.dtype, device=hidden.device)
    out = local_forward(got, ids[:, None], ones)
    if got.requires_grad and not out.requires_grad:  # no token reached this rank's experts (Note above)
        out = out + got.sum() * 0
    back = funcol.all_to_all_single_autograd(out, send, recv, group)
    picked = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(hidden).index_add(0, token, picked.to(hidden.dtype))
