"""The built-in model ``metadispatch trace`` runs with no argument: LLaMA.

A plain-PyTorch LLaMA (RMSNorm, rotary embeddings, grouped-query attention
through ``scaled_dot_product_attention``, SwiGLU MLP), written here so the
default trace needs neither ``transformers`` nor a download.  The default
config is LLaMA-7B's; built under ``md.MetaMode`` it allocates nothing.

>>> import torch, metadispatch as md
>>> from metadispatch.cli.llama import Llama, LlamaConfig
>>> with md.MetaMode(device="cuda"):
...     model = Llama(LlamaConfig.tiny())
>>> sum(p.numel() for p in model.parameters())
19616
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "LlamaStage", "loss", "example", "build"]


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    hidden_dim: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def tiny(cls) -> LlamaConfig:
        return cls(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(q, k, v):
    """Causal attention, as a GPU runs it.

    ``F.scaled_dot_product_attention`` picks its kernel from the C++ device,
    which under MetaMode is ``meta``, so it would fall back to the math path
    (attention matrices in memory); on CUDA torch picks flash attention, so
    ask for that kernel directly when the (logical) device is CUDA.
    """
    if k.shape[1] != q.shape[1]:  # grouped-query attention: share k, v heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        # The flash op is on autocast's lower-precision list: C++ autocast
        # casts its inputs (right to left) even when called through
        # torch.ops, which the MetaMode's autocast policy does not see.
        low = torch.get_autocast_dtype("cuda")
        v, k, q = v.to(low), k.to(low), q.to(low)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0]
    # Elsewhere spell the math out, so that a real run and a trace agree
    # on the ops (on CPU, F.scaled_dot_product_attention would pick a fused
    # kernel for real but the math path under MetaMode).
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.n_heads, c.n_kv_heads, c.dim // c.n_heads
        self.q_proj = nn.Linear(c.dim, c.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * self.head_dim, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = attention(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.down_proj = nn.Linear(c.hidden_dim, c.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(c.dim, c.norm_eps)
        self.attn = Attention(c)
        self.post_norm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)

    def rope(self, seq: int, device, dtype):
        return _rope(self.config, seq, device, dtype)

    def forward(self, ids, labels=None):
        x = self.embed(ids)
        cos, sin = self.rope(ids.shape[1], ids.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return loss(logits, labels)


def loss(logits, labels):
    """The built-in LLaMA's training loss (also a pipeline's last stage's ``loss_fn``)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _rope(c: LlamaConfig, seq: int, device, dtype):
    head_dim = c.dim // c.n_heads
    inv = 1.0 / c.rope_theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaStage(nn.Module):
    """Blocks ``[lo, hi)`` of a :class:`Llama` as one pipeline stage, as
    torchtitan splits its models: the first stage embeds the token ids, the
    last applies the final norm and the head and returns logits; the others
    take and return hidden states.  It holds only its own modules (the rest
    of the model can be dropped)."""

    def __init__(self, model: Llama, lo: int, hi: int) -> None:
        super().__init__()
        self.config = model.config
        self.first, self.last = lo == 0, hi == len(model.layers)
        self.embed = model.embed if self.first else None
        self.layers = nn.ModuleList(model.layers[lo:hi])
        self.norm = model.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        cos, sin = _rope(self.config, h.shape[1], h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h)) if self.lm_head is not None and self.norm is not None else h


def example(config: LlamaConfig | None = None, batch: int = 1, seq: int = 2048, dtype=torch.bfloat16, device="cuda"):
    """(model, (ids, labels)) built under a MetaMode: nothing is allocated."""
    from ..mode.mode import MetaMode

    with MetaMode(device=device, record=False):
        return build(config, batch, seq, dtype)


def build(config: LlamaConfig | None = None, batch: int = 1, seq: int = 2048, dtype=torch.bfloat16):
    """(model, (ids, labels)) made in ``dtype`` by whatever mode is active
    (``metadispatch trace --world-size`` builds it inside the traced rank)."""
    config = config or LlamaConfig()
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in dtype: no float32 copy first
    try:
        model = Llama(config)
    finally:
        torch.set_default_dtype(before)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, (ids, ids)
