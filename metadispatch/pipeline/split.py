"""A model split into pipeline stages (``metadispatch trace --pp``, ``md.plan``'s ``pp``).

Note [Splitting a model into pipeline stages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan cuts the repeated blocks into contiguous runs, the first stage
also embedding the token ids and the last also applying the final norm and
the head; what the model does around each block (rotary embeddings, the
causal mask) every stage does for itself.  A stage holds only its own
modules: the rest of the model can be dropped.  What a model does before
its first block and after its last is in its ``forward``, which cannot be
cut, so each family is written out: transformers LLaMA
(``LlamaForCausalLM``) and GPT-2 (``GPT2LMHeadModel``) here, the built-in
LLaMA in cli/llama.py (``LlamaStage``, which cli/stages.py adds).  The
transformers decoders built as LLaMA is (Qwen2/3, Mistral, Phi-3, Gemma,
OLMo: ``model.embed_tokens``, ``model.layers``, ``model.rotary_emb``,
``model.norm``, ``lm_head``) are split as LLaMA is (and Phi, GPT-NeoX,
GPT-J and Falcon, the same forward under other names: Note [Rotary
decoders named otherwise] in decoders.py), each block given the
mask its layer type asks for (``config.layer_types``: sliding-window or
causal; else ``config.sliding_window``); which are is read from the base
model's ``forward`` itself: one that passes its embeddings straight to
the blocks and the rotary embedding, scales nothing on the way
(Granite's ``embedding_multiplier`` would be lost) and ends in
``self.norm``, under a head whose logits are ``lm_head``'s as they are
(Cohere's ``logit_scale`` would be lost) (:func:`_llama_shaped`).  Their
MoE kin (Mixtral, Qwen2/3-MoE, OLMoE: experts inside the blocks) split
the same way, unless ``output_router_logits`` adds the routers'
load-balancing loss to the model's, which the last stage's loss would
leave out: refused.

Each stage calls its blocks as the model's own ``forward`` does (no
cache); the last stage's loss is the model's (``ForCausalLMLoss``, labels
shifted by one).  Others are refused, naming these.

Limits: tied embeddings (GPT-2's) are one parameter where one rank holds
both end stages, two unsynchronised copies where two ranks do (torchtitan
refuses them under pipelining).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedFeatureError
from . import decoders, families

__all__ = ["Split", "split", "SPLITS", "causal_lm_loss"]

SPLITS = (
    "transformers LLaMA (LlamaForCausalLM), decoders built as it is (Qwen2, Mistral, ...: "
    "model.embed_tokens, model.layers, model.rotary_emb, model.norm, lm_head), GPT-2 (GPT2LMHeadModel), "
    "Phi, GPT-NeoX, GPT-J, Falcon without ALiBi, OPT, BLOOM, GPT-Neo (their ForCausalLM), " + families.FAMILIES
)


class Split(NamedTuple):
    """A model's blocks' count, its stage of blocks ``[lo, hi)``, the sizes
    a stage sends (hidden) and the last returns (vocab), the last's loss;
    or, where the activations are not ``(batch, seq, hidden)``, ``io``: each
    stage's example input and output (:func:`families.example_io`)."""

    blocks: int
    stage: Callable[[int, int], nn.Module]
    hidden: int
    vocab: int
    loss: Callable
    io: Callable | None = None


def split(model: nn.Module, blocks: str | None = None) -> Split:
    """The :class:`Split` of ``model`` (Note [Splitting a model into pipeline stages])."""
    kind = _FAMILIES.get(type(model).__name__)
    row = decoders.decoder(model) if kind is None else None
    if row is not None:
        kind = (f"{row.base}.{row.layers}", decoders.RotaryDecoderStage)
    if kind is None and decoders.opt(model):
        kind = ("model.decoder.layers", decoders.OPTStage)
    if kind is None and decoders.bloom(model):
        kind = ("transformer.h", decoders.BloomStage)
    if kind is None and decoders.gpt_neo(model):
        kind = ("transformer.h", GPTNeoStage)
    if kind is None and _llama_shaped(model):
        kind = ("model.layers", HFLlamaStage)
    if kind is None:
        return _other(model, blocks)
    path, stage = kind
    if blocks is not None and blocks != path:
        raise UnsupportedFeatureError(f"blocks {blocks}: a {type(model).__name__} is split at its blocks in {path}")
    c: Any = model.config  # a transformers config
    n = len(list(model.get_submodule(path).children()))
    return Split(n, lambda lo, hi: stage(model, lo, hi), c.hidden_size, c.vocab_size, causal_lm_loss)


def _other(model: nn.Module, blocks: str | None) -> Split:
    """An encoder's or a vision model's :class:`Split` (Note [Pipeline stages of encoders and vision models])."""
    families.refuse_encoder_decoder(model)
    found = families.family(model)
    if found is None:
        raise UnsupportedFeatureError(f"cannot split a {type(model).__name__} into pipeline stages; {SPLITS} split")
    path, held, stage = found
    if blocks is not None and blocks != path:
        raise UnsupportedFeatureError(f"blocks {blocks}: a {type(model).__name__} is split at its blocks in {path}")

    def cut(lo: int, hi: int) -> nn.Module:
        return stage(model, lo, hi)

    io = lambda spans, x: families.example_io(cut, spans, x)  # noqa: E731
    head = families.LM_HEADS.get(type(model).__name__) if stage is families.EncoderLMStage else None
    loss = families.summed if head is None else causal_lm_loss if head[1] == "causal" else families.masked_lm_loss
    if stage is families.ImageTransformerStage:
        loss = functools.partial(families.image_classification_loss, model.config)  # the config only: no model
    return Split(len(held), cut, 0, 0, loss, io)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``: each position predicts the next token, the last one nothing."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(), ignore_index=-100)


def _positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


def _mask_and_positions(config, h: torch.Tensor) -> tuple:
    """The causal mask the model's own forward makes (None where SDPA's is_causal does it), and the positions."""
    pos = _positions(h)
    return _mask(config, h, pos, sliding=False), pos


def _mask(config, h: torch.Tensor, pos: torch.Tensor, sliding: bool):
    """The causal mask, or with ``sliding`` the sliding-window one, as the model's forward makes it."""
    masking = importlib.import_module("transformers.masking_utils")  # transformers is optional
    make = masking.create_sliding_window_causal_mask if sliding else masking.create_causal_mask
    return make(config=config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)


def _sliding(config, i: int) -> bool:
    """Whether block ``i`` attends within a sliding window, as the model's forward decides it."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return types[i] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


def _llama_shaped(model: nn.Module) -> bool:
    """A transformers decoder whose ``forward`` is LLaMA's (Note [Splitting a model into pipeline stages])."""
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "rotary_emb", "norm")
    if not isinstance(base, nn.Module) or not all(hasattr(base, a) for a in parts) or not hasattr(model, "lm_head"):
        return False
    try:
        source = inspect.getsource(type(base).forward)
        head = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    needed = (
        "hidden_states = inputs_embeds\n",
        "self.rotary_emb(hidden_states",
        "hidden_states = self.norm(hidden_states)",
    )
    # the head's logits taken as they are: Cohere's logit_scale, Gemma 2's softcapping, Granite's
    # logits_scaling rewrite them after lm_head, which the last stage would leave out
    # (the one assignment to ``logits``: an MoE's ``output_router_logits = ...`` is none; nor is its router's
    # auxiliary loss, which the model's loss adds only with output_router_logits, left out here: refused)
    plain_head = "logits = self.lm_head(" in head and len(decoders.ASSIGNS_LOGITS.findall(head)) == 1
    aux = getattr(getattr(model, "config", None), "output_router_logits", False)
    return (
        plain_head
        and not aux
        and all(n in source for n in needed)
        and not any(w in source for w in ("multiplier", "normalizer"))
    )


class HFLlamaStage(nn.Module):
    """Blocks ``[lo, hi)`` of a transformers ``LlamaForCausalLM`` (``LlamaModel.forward``, cut),
    or of a decoder built as it is (:func:`_llama_shaped`)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:  # a transformers model: untyped
        super().__init__()
        base = model.model
        self.config = model.config
        self.first, self.last = lo == 0, hi == len(base.layers)
        self.sliding = [_sliding(model.config, i) for i in range(lo, hi)]
        self.embed_tokens = base.embed_tokens if self.first else None
        self.rotary_emb = base.rotary_emb
        self.layers = nn.ModuleList(base.layers[lo:hi])
        self.norm = base.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = _positions(h)
        masks = {sliding: _mask(self.config, h, pos, sliding) for sliding in sorted(set(self.sliding))}
        rope = self.rotary_emb(h, position_ids=pos)
        for layer, sliding in zip(self.layers, self.sliding):
            h = layer(h, attention_mask=masks[sliding], position_embeddings=rope, position_ids=pos)
        return self.lm_head(self.norm(h)) if self.lm_head is not None and self.norm is not None else h


class GPT2Stage(nn.Module):
    """Blocks ``[lo, hi)`` of a transformers ``GPT2LMHeadModel`` (``GPT2Model.forward``, cut)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:  # a transformers model: untyped
        super().__init__()
        base = model.transformer
        self.config = model.config
        self.first, self.last = lo == 0, hi == len(base.h)
        self.wte: nn.Module | None = base.wte if self.first else None
        self.wpe: nn.Module | None = base.wpe if self.first else None
        self.drop: nn.Module | None = base.drop if self.first else None
        self.layers = nn.ModuleList(base.h[lo:hi])
        self.ln_f = base.ln_f if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x):
        h = x if self.wte is None or self.wpe is None or self.drop is None else self.wte(x)
        if self.wpe is not None and self.drop is not None:
            h = self.drop(h + self.wpe(_positions(h)))
        mask, pos = _mask_and_positions(self.config, h)
        for block in self.layers:
            h = block(h, None, mask, None, position_ids=pos)
        return self.lm_head(self.ln_f(h)) if self.lm_head is not None and self.ln_f is not None else h


class GPTNeoStage(GPT2Stage):
    """Blocks ``[lo, hi)`` of a transformers ``GPTNeoForCausalLM``: GPT-2's parts, called as ``GPTNeoModel.forward``
    calls them (Note [Rotary decoders named otherwise] in decoders.py)."""

    def forward(self, x):
        h = self.wte(x) if self.wte is not None else x
        mask, pos = _mask_and_positions(self.config, h)
        if self.wpe is not None and self.drop is not None:
            h = self.drop(h + self.wpe(pos))
        for layer in self.layers:
            h = layer(h, attention_mask=mask)[0]
        return self.lm_head(self.ln_f(h)) if self.lm_head is not None and self.ln_f is not None else h


# A model's class name -> where its blocks are and its stage (Note [Splitting a model into pipeline stages]).
_FAMILIES: dict[str, tuple[str, Callable]] = {
    "LlamaForCausalLM": ("model.layers", HFLlamaStage),
    "GPT2LMHeadModel": ("transformer.h", GPT2Stage),
}
