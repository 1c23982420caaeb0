"""``md.serve_plan``: what serving a model on a GPU holds, from traces of its prefill and decode.

Note [Serving figures from the cache the model writes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The figure a serving plan turns on is the KV cache's bytes per token, and a
formula from the config (``2 * layers * kv_heads * head_dim * dtype``) is
wrong for every model that is not plain multi-head attention: sliding-window
layers stop growing at their window, MLA caches a latent, state-space layers
hold a fixed state.  So the model is run under a logical GPU at two prompt
lengths and the bytes of every tensor its cache object holds afterwards are
summed (each storage once): the growth between the two lengths, divided by
the tokens added, is the bytes per token; what does not grow is fixed per
sequence.  Both lengths are below any sliding window the config declares,
so a sliding layer counts as growing; the figure is then an upper bound,
and the plan says so.

The rest is traced, not guessed: the prefill of ``max_num_batched_tokens``
(one sequence, under ``torch.inference_mode``) gives the activation peak
above the weights (``md.memory``) and the time to first token
(``md.runtime``); a decode step after a prefill gives the time per output
token as the difference of the two traces' times.  With ``tp > 1`` weights
and KV are divided by ``tp`` -- the heads and the linear layers split
evenly, as vLLM's tensor parallelism does -- which the plan states as an
assumption; the activation peak is the unsplit one (an upper bound).
Not counted: CUDA graphs' memory, NCCL's buffers, the CUDA context and
the serving runtime's own allocations (vLLM's ``gpu_memory_utilization``
leaves them in the remainder).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import _compat
from ..analysis.memory import memory
from ..mode.mode import MetaMode
from ..spec.profiles import GPUProfile, gpu_profile
from ..timing.runtime import runtime
from ..tracing.tracer import tracer

__all__ = ["serve_plan", "ServePlan"]

_GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """What serving ``model`` on one GPU holds and how fast it answers (Note [Serving figures from the cache the model writes])."""

    gpu: str
    tp: int
    weights: int  # bytes of parameters and buffers, per GPU
    prefill_peak: int  # activation bytes above the weights during a prefill of max_num_batched_tokens
    kv_per_token: float  # bytes of cache per token, per GPU
    kv_fixed: int  # bytes of cache per sequence that do not grow with its length
    kv_tokens: int  # tokens the cache can hold at gpu_memory_utilization
    blocks: int  # of block_size tokens
    max_concurrency: int  # sequences of max_model_len at once
    longest: int  # the largest max_model_len one sequence can have
    ttft: float  # seconds, prefill of max_num_batched_tokens
    tpot: float  # seconds per output token at max_model_len context, batch 1
    assumptions: tuple

    def __str__(self) -> str:
        lines = [
            f"serving on {self.gpu} (tp={self.tp}), per GPU:",
            f"  weights        {self.weights / _GiB:8.2f} GiB",
            f"  prefill peak   {self.prefill_peak / _GiB:8.2f} GiB of activations above the weights",
            f"  KV cache       {self.kv_per_token:,.0f} B per token (+{self.kv_fixed:,} B per sequence)",
            f"  KV capacity    {self.kv_tokens:,} tokens = {self.blocks:,} blocks",
            f"  concurrency    {self.max_concurrency:,} sequences at max_model_len; longest {self.longest:,} tokens",
            f"  TTFT {self.ttft * 1e3:.2f} ms, TPOT {self.tpot * 1e3:.3f} ms",
            "  not counted: CUDA graphs, NCCL buffers, the CUDA context, the serving runtime's own memory",
        ]
        lines += [f"  assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)


def serve_plan(
    model,
    gpu: str | GPUProfile = "h100",
    *,
    tp: int = 1,
    max_model_len: int = 4096,
    max_num_batched_tokens: int = 2048,
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    lengths: tuple = (16, 32),
) -> ServePlan:
    """Plan serving a causal LM on ``gpu``: weights, KV bytes per token, capacity, concurrency, TTFT and TPOT.

    ``model``: a module built under ``md.MetaMode(device="cuda")`` (no weights
    needed) or a transformers config, built here.  Every figure comes from
    the model's own calls (Note [Serving figures from the cache the model
    writes]).
    """
    profile = gpu_profile(gpu)
    if not isinstance(model, nn.Module):
        model = _build(model, profile)
    vocab = _vocab(model)
    per_token, fixed = _kv_growth(model, profile, lengths, vocab)
    weights = _bytes(list(model.parameters()) + list(model.buffers()))

    def prefill(ids):
        with torch.inference_mode():
            return model(ids, use_cache=True).logits

    def prefill_and_decode(ids, nxt):
        with torch.inference_mode():
            out = model(ids, use_cache=True)
            return model(nxt, past_key_values=out.past_key_values, use_cache=True).logits

    trace = tracer(device="cuda", gpu=profile.name)
    ids = torch.randint(0, vocab, (1, max_num_batched_tokens))
    t_prefill = trace(prefill, ids)
    ctx = torch.randint(0, vocab, (1, max_model_len - 1))
    t_pd = trace(prefill_and_decode, ctx, torch.randint(0, vocab, (1, 1)))
    t_ctx = trace(prefill, ctx)
    peak = memory(t_prefill).peak - weights
    ttft = runtime(t_prefill).total
    tpot = max(runtime(t_pd).total - runtime(t_ctx).total, 0.0)
    usable = int(profile.memory * gpu_memory_utilization) - weights // tp - peak
    kv = per_token / tp
    tokens = max(int(usable // kv), 0) if kv > 0 else 0
    assumptions = [
        f"KV bytes per token measured between prompts of {lengths[0]} and {lengths[1]} tokens",
        "activation peak of one sequence's prefill, unsplit by tp",
    ]
    if tp > 1:
        assumptions.append(f"weights and KV split evenly over {tp} GPUs")
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if window:
        assumptions.append(f"sliding-window layers (window {window}) counted as growing: an upper bound")
    return ServePlan(
        gpu=profile.name,
        tp=tp,
        weights=weights // tp,
        prefill_peak=peak,
        kv_per_token=kv,
        kv_fixed=fixed // tp,
        kv_tokens=tokens,
        blocks=tokens // block_size,
        max_concurrency=int(tokens // (max_model_len + (fixed // tp) / kv)) if kv else 0,
        longest=tokens,
        ttft=ttft,
        tpot=tpot,
        assumptions=tuple(assumptions),
    )


def _build(config, profile: GPUProfile) -> nn.Module:
    import transformers

    with MetaMode(device="cuda", gpu=profile.name):
        return transformers.AutoModelForCausalLM.from_config(config)


def _vocab(model) -> int:
    return int(getattr(getattr(model, "config", None), "vocab_size", 32000))


def _kv_growth(model, profile: GPUProfile, lengths: tuple, vocab: int) -> tuple:
    """(bytes per token, fixed bytes) of the cache the model writes, from two prompt lengths."""
    held = []
    for n in lengths:
        with MetaMode(device="cuda", gpu=profile.name), torch.inference_mode():
            out = model(torch.randint(0, vocab, (1, n)), use_cache=True)
            held.append(_bytes(list(_tensors(out.past_key_values))))
    per_token = (held[1] - held[0]) / (lengths[1] - lengths[0])
    return per_token, max(int(held[0] - per_token * lengths[0]), 0)


def _tensors(obj, depth: int = 0, seen: set | None = None):
    """Every tensor a cache object holds: its attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module)):
        for x in vars(obj).values():
            yield from _tensors(x, depth + 1, seen)


def _bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    seen: dict = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[_compat.storage_id(s)] = s.nbytes()
    return sum(seen.values())
