"""transformers decoders built as LLaMA is but named otherwise, split into pipeline stages.

Note [Rotary decoders named otherwise]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Phi, GPT-NeoX, GPT-J and Falcon (without ALiBi) run LLaMA's forward
(split.py's ``HFLlamaStage``): token embedding, a dropout, the rotary
embedding of the positions, every block given the causal mask, the
positions and the rotary embedding, a final norm and the head.  They
differ in names (``gpt_neox.embed_in`` ... ``final_layer_norm``) and in two
details, which each family's row says: Falcon makes its mask with no
shortcut to SDPA's ``is_causal`` (``allow_is_causal_skip=False``: the same
logits only with the same mask), and its blocks return a tuple.

Which is which is told by class name, and each row is checked against
the installed transformers: the lines of the base model's ``forward`` the
stage rests on must be there, so a release that changes the forward is
refused, naming the line, not split into stages that compute something
else.  A Falcon with ALiBi (``config.alibi``) is refused: its bias is
folded into the mask from the whole model's attention mask.

OPT (``OPTForCausalLM``) learns its positions instead: its first stage
adds them to the (projected: ``project_in``) token embeddings, computed
as its decoder's ``forward`` computes them from an all-ones mask
(``cumsum(mask) * mask - 1``, the embedding's offset of 2 inside it); the
last applies its final norm where the config has one
(``do_layer_norm_before``), ``project_out`` and the head.  Its blocks get
the causal mask and those positions.

BLOOM (``BloomForCausalLM``) biases attention by ALiBi: every stage builds
the bias as its model's ``forward`` does without a padding mask (the
heads' slopes times the key positions), the first stage embeds and
norms the embeddings (``word_embeddings_layernorm``), the last applies
``ln_f`` and the head (tied to the embeddings: two copies where the end
stages are on two ranks, as GPT-2's).

GPT-Neo (``GPTNeoForCausalLM``) is GPT-2's forward (split.py's
``GPTNeoStage``): learned positions added on the first stage, one causal
mask for every block (a local block's window is its attention's own
buffer), ``ln_f`` and the head on the last.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import UnsupportedFeatureError

__all__ = [
    "DECODERS",
    "RotaryDecoderStage",
    "OPTStage",
    "BloomStage",
    "decoder",
    "opt",
    "bloom",
    "gpt_neo",
]


class Decoder(NamedTuple):
    """Where a family's parts are: base model, embedding, dropout (or None), blocks, final norm, head."""

    base: str
    embed: str
    drop: str | None
    layers: str
    norm: str
    head: str
    mask: dict  # create_causal_mask's extra arguments, as the base model's forward passes them
    tuple_out: bool  # whether a block returns a tuple whose first item is the hidden states


ASSIGNS_LOGITS = re.compile(r"^ *(lm_)?logits = ", re.M)  # a statement that sets the logits (Falcon's lm_logits)

_PHI = Decoder("model", "embed_tokens", "embed_dropout", "layers", "final_layernorm", "lm_head", {}, False)
_NEOX = Decoder("gpt_neox", "embed_in", "emb_dropout", "layers", "final_layer_norm", "lm_head", {}, False)
_GPTJ = Decoder("transformer", "wte", "drop", "h", "ln_f", "lm_head", {}, False)
_FALCON = Decoder("transformer", "word_embeddings", None, "h", "ln_f", "lm_head", {"allow_is_causal_skip": False}, True)

# A causal LM's class name -> its row (Note [Rotary decoders named otherwise]).
DECODERS = {
    "PhiForCausalLM": _PHI,
    "GPTNeoXForCausalLM": _NEOX,
    "GPTJForCausalLM": _GPTJ,
    "FalconForCausalLM": _FALCON,
}


def decoder(model: nn.Module) -> Decoder | None:
    """``model``'s row, checked against its forward; None for a model no row names."""
    row = DECODERS.get(type(model).__name__)
    if row is None or not type(model).__module__.startswith("transformers"):
        return None
    name = type(model).__name__
    if getattr(model.config, "alibi", False):
        raise UnsupportedFeatureError(
            f"cannot split a {name} with alibi=True into pipeline stages: its ALiBi bias is folded into the "
            "attention mask from the whole model's inputs (Note [Rotary decoders named otherwise])"
        )
    needed = (
        f"self.{row.embed}(input_ids)",
        "self.rotary_emb(hidden_states, position_ids=position_ids)",
        f"self.{row.norm}(hidden_states)",
    ) + ((f"self.{row.drop}(",) if row.drop else ())
    _checked(model, name, row.base, needed, f"logits = self.{row.head}(hidden_states)")
    return row


class RotaryDecoderStage(nn.Module):
    """Blocks ``[lo, hi)`` of a decoder :data:`DECODERS` names (its base model's ``forward``, cut)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:  # a transformers model: untyped
        super().__init__()
        row = DECODERS[type(model).__name__]
        base = getattr(model, row.base)
        blocks = getattr(base, row.layers)
        self.config, self.row = model.config, row
        self.first, self.last = lo == 0, hi == len(blocks)
        self.embed = getattr(base, row.embed) if self.first else None
        self.drop = getattr(base, row.drop) if self.first and row.drop else None
        self.rotary_emb = base.rotary_emb
        self.layers = nn.ModuleList(blocks[lo:hi])
        self.norm = getattr(base, row.norm) if self.last else None
        self.head = getattr(model, row.head) if self.last else None

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masking = importlib.import_module("transformers.masking_utils")  # transformers is optional
        mask = masking.create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos, **self.row.mask
        )
        h = self.drop(h) if self.drop is not None else h
        rope = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
            h = h[0] if self.row.tuple_out else h
        return self.head(self.norm(h)) if self.head is not None and self.norm is not None else h


_OPT_LINES = (
    "position_ids = torch.cumsum(position_attention_mask, dim=1)",
    "position_ids = (position_ids * position_attention_mask - 1).long()",
    "hidden_states = inputs_embeds + pos_embeds.to(inputs_embeds.device)",
    "hidden_states = self.final_layer_norm(hidden_states)",
    "hidden_states = self.project_out(hidden_states)",
)


def opt(model: Any) -> bool:
    """Whether ``model`` is transformers' ``OPTForCausalLM`` whose forward the :class:`OPTStage` copies."""
    return _checked(
        model, "OPTForCausalLM", "model.decoder", _OPT_LINES, "logits = self.lm_head(hidden_states).contiguous()"
    )


def _checked(model: Any, name: str, base: str, lines: tuple, head: str) -> bool:
    """Whether ``model`` is transformers' ``name``; refused, naming the line, if its base model's forward or
    its own lack a line the stage copies (Note [Rotary decoders named otherwise])."""
    if type(model).__name__ != name or not type(model).__module__.startswith("transformers"):
        return False
    source = inspect.getsource(type(model.get_submodule(base)).forward)
    missing = [line for line in lines if line not in source]
    forward = inspect.getsource(type(model).forward)
    # the head's logits taken as they are (one assignment): a rescaling after it would be left out
    if head not in forward or len(ASSIGNS_LOGITS.findall(forward)) != 1:
        missing.append(f"{head} in {name}.forward, once")
    if missing:
        raise UnsupportedFeatureError(
            f"cannot split this transformers release's {name} into pipeline stages: its forward no longer "
            f"has {missing[0]!r}, which the stages rest on (Note [Rotary decoders named otherwise])"
        )
    return True


class OPTStage(nn.Module):
    """Blocks ``[lo, hi)`` of a transformers ``OPTForCausalLM`` (``OPTDecoder.forward``, cut)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:  # a transformers model: untyped
        super().__init__()
        d = model.model.decoder
        self.config = model.config
        self.first, self.last = lo == 0, hi == len(d.layers)
        self.embed_tokens = d.embed_tokens if self.first else None
        self.embed_positions = d.embed_positions if self.first else None
        self.project_in = d.project_in if self.first else None
        self.layers = nn.ModuleList(d.layers[lo:hi])
        self.final_layer_norm = d.final_layer_norm if self.last else None
        self.project_out = d.project_out if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        ones = torch.ones(h.shape[0], h.shape[1], device=h.device)
        pos = (torch.cumsum(ones, dim=1) * ones - 1).long()
        masking = importlib.import_module("transformers.masking_utils")  # transformers is optional
        mask = masking.create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None)
        if self.embed_positions is not None:  # positions, then project_in, then the sum: OPTDecoder.forward's order
            positions = self.embed_positions(ones, 0, position_ids=pos)
            h = self.project_in(h) if self.project_in is not None else h
            h = h + positions.to(h.device)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos)
        if self.lm_head is None:
            return h
        h = self.final_layer_norm(h) if self.final_layer_norm is not None else h
        h = self.project_out(h) if self.project_out is not None else h
        return self.lm_head(h).contiguous()


_BLOOM_LINES = (
    "hidden_states = self.word_embeddings_layernorm(inputs_embeds)",
    "slopes = _get_alibi_slopes(self.num_heads, hidden_states.device)",
    "alibi = slopes[:, None, None] * torch.arange(kv_length, device=hidden_states.device)",
    "alibi = alibi.repeat(batch_size, 1, 1).to(hidden_states.dtype)",
    "hidden_states = self.ln_f(hidden_states)",
)


def bloom(model: Any) -> bool:
    """Whether ``model`` is transformers' ``BloomForCausalLM`` whose forward the :class:`BloomStage` copies."""
    return _checked(model, "BloomForCausalLM", "transformer", _BLOOM_LINES, "logits = self.lm_head(hidden_states)")


class BloomStage(nn.Module):
    """Blocks ``[lo, hi)`` of a transformers ``BloomForCausalLM`` (``BloomModel.forward``, cut)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:  # a transformers model: untyped
        super().__init__()
        base = model.transformer
        self.config, self.heads = model.config, base.num_heads
        self.slopes = sys.modules[type(base).__module__]._get_alibi_slopes  # the model's own
        self.first, self.last = lo == 0, hi == len(base.h)
        self.word_embeddings = base.word_embeddings if self.first else None
        self.word_embeddings_layernorm = base.word_embeddings_layernorm if self.first else None
        self.layers = nn.ModuleList(base.h[lo:hi])
        self.ln_f = base.ln_f if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x):
        embedded = self.word_embeddings(x) if self.word_embeddings is not None else x
        n, seq = embedded.shape[:2]
        h = self.word_embeddings_layernorm(embedded) if self.word_embeddings_layernorm is not None else embedded
        alibi = self.slopes(self.heads, h.device)[:, None, None] * torch.arange(seq, device=h.device)
        alibi = alibi.repeat(n, 1, 1).to(h.dtype)
        masking = importlib.import_module("transformers.masking_utils")  # transformers is optional
        mask = masking.create_causal_mask(config=self.config, inputs_embeds=embedded, attention_mask=None, cache=None)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, alibi=alibi)[0]
        return self.lm_head(self.ln_f(h)) if self.lm_head is not None and self.ln_f is not None else h


_GPT_NEO_LINES = (
    "position_embeds = self.wpe(position_ids)",
    "hidden_states = inputs_embeds + position_embeds",
    "hidden_states = self.drop(hidden_states)",
    "hidden_states = self.ln_f(hidden_states)",
)


def gpt_neo(model: Any) -> bool:
    """Whether ``model`` is transformers' ``GPTNeoForCausalLM`` whose forward the :class:`GPTNeoStage` copies."""
    return _checked(model, "GPTNeoForCausalLM", "transformer", _GPT_NEO_LINES, "logits = self.lm_head(hidden_states)")
