"""``md.serve_plan``: what serving a model on a GPU holds, from traces of its prefill and decode.

Note [Serving figures from the cache the model writes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The figure a serving plan turns on is the KV cache's bytes per sequence, and
it is read from the cache object the model's own attention writes, layer by
layer (``kv.py``, Note [KV layout from three prompt lengths]): full layers
grow with the sequence, sliding-window layers up to their window, MLA layers
by their latent, state-space and linear-attention layers not at all.  The
capacity figures follow from that layout: the largest ``max_model_len`` one
sequence can have, and how many sequences of ``max_model_len`` fit at once.
``kv_tokens`` is the tokens the cache holds at the rate a sequence's first
tokens take (every layer growing) -- the figure vLLM's log prints -- and for
a model with windows or states it understates what long sequences fit, which
``longest`` and ``max_concurrency`` count exactly.

The rest is traced, not guessed: the prefill of ``max_num_batched_tokens``
(one sequence, under ``torch.inference_mode``) gives the activation peak
above the weights (``md.memory``) and the time to first token
(``md.runtime``); a decode step of ``batch`` sequences after their prefill of
``max_model_len - 1`` tokens gives the time per output token as the
difference of the two traces' times, one row per batch size asked for.
``md.runtime`` prices each call by the profile's roofline, so no figure is
faster than it.  With ``tp > 1`` every trace is of rank 0 of a logical
world of ``tp`` GPUs whose attention and MLP are split as vLLM splits them
(tp.py, Note [Serving one rank of a tensor-parallel model]): the weights,
the KV layout, the activation peak and the times are that rank's, and the
times include the all-reduces of the hidden state, priced on the
profile's links (``md.runtime``, ``md.comms``).  Not counted: CUDA graphs' memory,
NCCL's buffers, the CUDA context and the serving runtime's own allocations
(vLLM's ``gpu_memory_utilization`` leaves them in the remainder).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..analysis.memory import memory
from ..errors import MetaDispatchError
from ..mode.mode import MetaMode
from ..planning.tp import COLWISE, ROWWISE, local_tensors, shard
from ..spec.profiles import GPUProfile, gpu_profile
from ..timing.comms import comms
from ..timing.runtime import runtime
from ..tracing.tracer import tracer
from .kv import KVLayout, cache_kwarg, cache_of, kv_layout, no_grad_for, storage_bytes

__all__ = ["serve_plan", "ServePlan", "DecodeRow"]

_GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """Decoding ``batch`` sequences at ``max_model_len`` context: one output token each per ``tpot`` seconds."""

    batch: int
    tpot: float
    tokens_per_s: float  # batch / tpot, per GPU
    fits: bool  # the batch's KV cache at max_model_len fits beside the weights and the prefill peak


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """What serving ``model`` on one GPU (one rank of ``tp``) holds and how fast it answers (Note [Serving figures from the cache the model writes])."""

    gpu: str
    tp: int
    weights: int  # bytes of parameters and buffers, per GPU
    prefill_peak: int  # activation bytes above the weights during a prefill of max_num_batched_tokens
    kv_per_token: float  # bytes of cache per token while every layer grows, per GPU
    kv_fixed: int  # bytes of cache per sequence that do not grow with its length
    kv_tokens: int  # tokens the cache can hold at gpu_memory_utilization, at kv_per_token
    blocks: int  # of block_size tokens
    max_concurrency: int  # sequences of max_model_len at once
    longest: int  # the largest max_model_len one sequence can have
    ttft: float  # seconds, prefill of max_num_batched_tokens
    tpot: float  # seconds per output token at max_model_len context, batch 1
    assumptions: tuple
    layout: KVLayout | None = None  # per cache layer, of one rank
    collectives: tuple[int, int] = (0, 0)  # calls in one rank's prefill and its decode step (the first batch size)
    collective_s: tuple[float, float] = (0.0, 0.0)  # their seconds on the profile's links, within ttft and tpot
    decode: tuple[DecodeRow, ...] = ()  # one row per batch size asked for

    def __str__(self) -> str:
        lines = [
            f"serving on {self.gpu} (tp={self.tp}), per GPU:",
            f"  weights        {self.weights / _GiB:8.2f} GiB",
            f"  prefill peak   {self.prefill_peak / _GiB:8.2f} GiB of activations above the weights",
            f"  KV cache       {self.kv_per_token:,.0f} B per token (+{self.kv_fixed:,} B per sequence)",
        ]
        if self.layout is not None:
            lines += [f"    {k}" for k in self.layout.kinds()]
        lines += [
            f"  KV capacity    {self.kv_tokens:,} tokens = {self.blocks:,} blocks",
            f"  concurrency    {self.max_concurrency:,} sequences at max_model_len; longest {self.longest:,} tokens",
            f"  TTFT {self.ttft * 1e3:.2f} ms, TPOT {self.tpot * 1e3:.3f} ms",
        ]
        if self.tp > 1:
            lines.append(
                f"  collectives    {self.collectives[0]} in a prefill ({self.collective_s[0] * 1e3:.3f} ms), "
                f"{self.collectives[1]} in a decode step ({self.collective_s[1] * 1e3:.3f} ms), within TTFT and TPOT"
            )
        if self.decode:
            lines.append("  batch      TPOT ms   tokens/s  fits")
            lines += [
                f"  {r.batch:5d}  {r.tpot * 1e3:10.3f}  {r.tokens_per_s:9,.0f}  {'yes' if r.fits else 'no'}"
                for r in self.decode
            ]
        lines.append("  not counted: CUDA graphs, NCCL buffers, the CUDA context, the serving runtime's own memory")
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
    batches: tuple[int, ...] = (1,),
    lengths: tuple[int, int] | None = None,
) -> ServePlan:
    """Plan serving a causal LM on ``gpu``: weights, KV layout, capacity, concurrency, TTFT and TPOT.

    ``model``: a module built under ``md.MetaMode(device="cuda")`` (no weights
    needed) or a transformers config, built here.  ``batches``: the batch
    sizes whose decode step is traced (``.decode``; the first also gives
    ``.tpot``).  Every figure comes from the model's own calls (Note [Serving
    figures from the cache the model writes]).
    """
    profile = gpu_profile(gpu)
    if type(tp) is not int or tp < 1:
        raise MetaDispatchError(f"serve_plan: tp={tp!r}, a number of GPUs >= 1")
    if not isinstance(model, nn.Module):
        model = _build(model, profile)
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 32000))
    world = tp if tp > 1 else None
    if world:
        model = shard(model, tp, profile.name)
    layout = kv_layout(model, profile.name, lengths, world_size=world)
    weights = storage_bytes(local_tensors([*model.parameters(), *model.buffers()]))

    def prefill(ids):
        with no_grad_for(world):
            return model(ids, use_cache=True).logits

    def prefill_and_decode(ids, nxt):
        with no_grad_for(world):
            out = model(ids, use_cache=True)
            return model(nxt, **{cache_kwarg(model): cache_of(out)}, use_cache=True).logits

    trace = tracer(device="cuda", gpu=profile.name, world_size=world)
    t_prefill = trace(prefill, torch.randint(0, vocab, (1, max_num_batched_tokens)))
    peak = memory(t_prefill).peak - weights
    usable = int(profile.memory * gpu_memory_utilization) - weights - peak
    per_sequence = layout.bytes_at(max_model_len)
    rows, decode = [], []
    for batch in batches:
        ctx = torch.randint(0, vocab, (batch, max_model_len - 1))
        t_pd = trace(prefill_and_decode, ctx, torch.randint(0, vocab, (batch, 1)))
        t_ctx = trace(prefill, ctx)
        tpot = max(runtime(t_pd).total - runtime(t_ctx).total, 0.0)
        rows.append(DecodeRow(batch, tpot, batch / tpot if tpot else 0.0, batch * per_sequence <= usable))
        decode.append(_collectives(t_pd, profile, since=_collectives(t_ctx, profile)))
    kv = layout.per_token
    tokens = max(int(usable // kv), 0) if kv > 0 else 0
    limit = int(getattr(config, "max_position_embeddings", 0) or 2**31)
    assumptions = [
        f"KV layout measured at prompts of {', '.join(map(str, layout.lengths))} tokens",
        "activation peak of one sequence's prefill",
        f"longest: at most max_position_embeddings ({limit:,})",
    ]
    if world:
        assumptions += [
            f"rank 0 of {tp}: {', '.join(COLWISE)} colwise, {', '.join(ROWWISE)} rowwise (as vLLM splits them)",
            "embedding and LM head whole on every rank (vLLM splits their vocabulary: an upper bound)",
        ]
    return ServePlan(
        gpu=profile.name,
        tp=tp,
        weights=weights,
        prefill_peak=peak,
        kv_per_token=kv,
        kv_fixed=layout.fixed,
        kv_tokens=tokens,
        blocks=tokens // block_size,
        max_concurrency=max(int(usable // per_sequence), 0) if per_sequence > 0 else 0,
        longest=layout.longest(usable, limit),
        ttft=runtime(t_prefill).total,
        tpot=rows[0].tpot if rows else 0.0,
        assumptions=tuple(assumptions),
        layout=layout,
        decode=tuple(rows),
        **_collective_fields(_collectives(t_prefill, profile), decode[0] if decode else (0, 0.0)),
    )


def _collectives(trace, profile: GPUProfile, since: tuple[int, float] = (0, 0.0)) -> tuple[int, float]:
    """The collectives of ``trace``, less those of ``since`` (a prefix trace): their count and seconds."""
    c = comms(trace, gpu=profile)
    return len(c.calls) - since[0], (c.seconds or 0.0) - since[1]


def _collective_fields(prefill: tuple[int, float], decode: tuple[int, float]) -> dict:
    return {"collectives": (prefill[0], decode[0]), "collective_s": (prefill[1], decode[1])}


def _build(config, profile: GPUProfile) -> nn.Module:
    import transformers

    with MetaMode(device="cuda", gpu=profile.name):
        return transformers.AutoModelForCausalLM.from_config(config)
