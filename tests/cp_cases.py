"""Context-parallel attention run twice: for real over ``gloo`` and traced.

Note [A GPU's attention kernel on a CPU rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``context_parallel`` cannot run on a CPU job: torch's CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``) has no CP rule.  Its ring
attention handles the GPU kernels' ops only, so the real ranks here are
given one: ``aten._scaled_dot_product_cudnn_attention`` (what an H100
picks for bf16 attention in torch 2.13) and its backward get a CPU kernel
-- registered in the spawned ranks alone, by :func:`real_rank` -- whose
outputs have the meta kernel's shapes, strides and dtypes and the math
attention's values.  ``gpu_attention`` stands in for the C++ composite's
choice on such a GPU, calling that op; the rest -- CP's sharding of the
buffers, its DTensor handler, the ring, the collectives -- is torch's own
code, run for real over gloo.  A logical CPU world traces the same case
code; a logical H100 world traces the model without the stand-in (its
SDPA choice is the mode's, rules/sdp_choice.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

import metadispatch as md
from metadispatch import _compat
from metadispatch._compat import pytree
from metadispatch.tensor.tensor import is_wrapper_subclass
from tests.distributed_cases import comparable

aten = torch.ops.aten
DIM, HEADS, BATCH = 64, 4, 2
ATTENTION_OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    assert attn_mask is None and dropout_p == 0.0 and not enable_gqa
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return aten._scaled_dot_product_cudnn_attention(query, key, value, None, grad, 0.0, is_causal, False, scale=scale)[
        0
    ]


@contextlib.contextmanager
def gpu_attention():
    """``F.scaled_dot_product_attention`` as the composite runs it on an H100 (bf16): the cuDNN op."""
    saved = F.scaled_dot_product_attention
    # By its name: context_parallel wraps F's attribute named as the function it finds there.
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved


def cp_step(world_size: int, gpu: bool = False, dtype=torch.bfloat16) -> nn.Module:
    """One AdamW step of an attention block under ``context_parallel`` (the input sharded on dim 1)."""
    device = "cuda" if gpu else "cpu"
    mesh = init_device_mesh(device, (world_size,))
    model = Attention().to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(BATCH, 16 * world_size, DIM, device=device, dtype=dtype)
    stand_in = contextlib.nullcontext() if gpu else gpu_attention()
    with stand_in, context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        model(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    return model


# -- the stand-in kernels (Note [A GPU's attention kernel on a CPU rank])
def _like_meta(meta_out, values: dict):
    """Real CPU outputs with the meta kernel's metadata; ``values[i]`` fills output ``i``."""
    outs = []
    for i, m in enumerate(meta_out):
        if isinstance(m, torch.Tensor):
            t = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype)
            if i in values:
                t.copy_(values[i].reshape(m.shape))
            outs.append(t)
        else:
            outs.append(m)
    return tuple(outs)


def _scores(q, k, is_causal, scale):
    s = (q.float() @ k.float().transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return s


def _forward_kernel(q, k, v, bias, lse, dropout=0.0, is_causal=False, debug=False, *, scale=None):
    meta = aten._scaled_dot_product_cudnn_attention(
        *(t.to("meta") for t in (q, k, v)), None, lse, dropout, is_causal, debug, scale=scale
    )
    s = _scores(q, k, is_causal, scale)
    out = torch.softmax(s, -1) @ v.float()
    return _like_meta(meta, {0: out, 1: torch.logsumexp(s, -1)})


def _backward_kernel(dout, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, dropout, is_causal, *, scale=None):
    # By hand: below autograd (a backend kernel) no graph is recorded.
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    p = torch.softmax(_scores(q, k, is_causal, scale), -1)
    dy = dout.float()
    dp = dy @ v.float().transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    grads = (ds @ k.float() * scale, ds.transpose(-2, -1) @ q.float() * scale, p.transpose(-2, -1) @ dy)
    # The meta kernel's outputs (``empty_like``: contiguous for q, k, v that are strided views of
    # the qkv projection), not the inputs' strides, which reach over the whole projection.
    args = (dout, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, dropout, is_causal)
    meta = aten._scaled_dot_product_cudnn_attention_backward(
        *(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args), scale=scale
    )
    return _like_meta(meta, dict(enumerate(grads)))


_KERNELS: list = []


def _register_kernels() -> None:
    if not _KERNELS:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl(ATTENTION_OPS[0], _forward_kernel, "CPU")
        lib.impl(ATTENTION_OPS[1], _backward_kernel, "CPU")
        _KERNELS.append(lib)


def kept(op: str) -> bool:
    """Whether the op-order comparison keeps ``op`` (a trace's op name): attention kernels, collectives."""
    # (a trace holds no ``wait_tensor``: a logical world's collectives are done when issued)
    return op.split(".")[1] in ATTENTION_OPS or (op.startswith("_c10d_functional.") and "wait_tensor" not in op)


class _AttentionLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The attention kernels and collectives a rank calls, in order (op names)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_wrapper_subclass(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            return NotImplemented  # DTensor's dispatch runs next, and its local calls come here
        name = f"{func.namespace}.{func.__name__}"
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if kept(name) and not any(_compat.is_fake(t) for t in tensors):  # not DTensor's sharding propagation
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def real_rank(rank: int, world_size: int, out_dir: str) -> None:
    """Run :func:`cp_step` for real over gloo; write ``out_dir/<rank>.json``."""
    _register_kernels()
    store = f"file://{os.path.join(out_dir, 'rendezvous')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        with (
            md.testing.CollectiveLog() as log,
            md.LiveStorages(count_untracked=False) as live,
            _AttentionLog() as ops,
        ):  # Note [Storages made out of sight] in analysis/live.py
            cp_step(world_size)
        result = {"peak": live.peak, "collectives": comparable(log.calls), "ops": ops.ops}
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
