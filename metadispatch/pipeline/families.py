"""Encoders and vision models split into pipeline stages (``metadispatch trace --pp``).

Note [Pipeline stages of encoders and vision models]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
As a torch.distributed.pipelining user splits one (Note [Splitting a model
into pipeline stages] in split.py): the first stage is the stem
(embeddings, a ResNet's conv/bn/pool, a ViT's patch embedding, class
token and position embedding) and the first blocks, the middle ones only
blocks, the last the last blocks and the head.  What flows between two
stages is one tensor, a block's output: a transformers encoder's hidden
states (the mask every stage rebuilds as the model's forward does, from
no padding mask: ``create_bidirectional_mask``), a ViT's tokens, a
ResNet's feature map -- whose shape changes at each of its stages'
first block (strided, a downsampling shortcut), so the shapes are not
written out but found: each stage run once, in order, on the meta device
(a copy of the stage on meta parameters: no memory, no data), as torch's
own shape inference does.  The last stage returns what the model's
forward does (a ResNet's or ViT's logits, an encoder's last hidden
state, its pooler left out: the loss never reads it) and its loss is
that output summed, as the command line's step takes a model's first
output when it returns no loss.  The others return theirs contiguous:
gloo refuses to send a strided view (a torchvision ViT block's output
keeps the transposed layout of its attention's).

Refused, naming the model: an encoder-decoder (T5, BART): each decoder
block attends to the encoder's output, so every decoder stage needs it
beside its own hidden states -- two tensors from two places, which a
stage-to-next-stage pipeline does not pass on; and models none of these
families covers.

An encoder under an LM head (``BertLMHeadModel``, ``BertForMaskedLM``,
RoBERTa's, XLM-RoBERTa's and ELECTRA's generator heads: ``LM_HEADS``) is its base model's stages with the head on the
last, whose loss is the model's (a causal LM's shifted by one, a masked
LM's not); a decoder config (``is_decoder``) masks causally, as the base
model's forward does.

A transformers ViT or DeiT image classifier (``IMAGE_TRANSFORMERS``) is
its base model's stages, the final norm and the classifier on the class
token on the last, whose loss is the model's own (transformers'
``ForSequenceClassificationLoss`` on its config); the lines of the two
forwards the stage copies are checked in the installed release.

Limits: a padding mask (``attention_mask``) is not passed between stages
(each stage attends to every token); other task heads (text
classification, ``BertForPreTraining``'s two) are not split -- their base
model is; an LM
head's decoder weight, tied to the word embeddings, is two unsynchronised
copies where the end stages are on two ranks (as GPT-2's, split.py).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedFeatureError

__all__ = ["FAMILIES", "family", "refuse_encoder_decoder", "example_io", "summed"]

FAMILIES = (
    "transformers encoders (BertModel, RobertaModel, ...: embeddings, encoder.layer; with an LM head: "
    "BertLMHeadModel, BertForMaskedLM, RobertaForCausalLM, RobertaForMaskedLM, XLM-RoBERTa's and ELECTRA's), transformers "
    "ViTForImageClassification and DeiTForImageClassification, torchvision ResNet "
    "and VisionTransformer, timm VisionTransformer"
)


def summed(output: torch.Tensor, _target=None) -> torch.Tensor:
    """The last stage's loss: its output summed (Note [Pipeline stages of encoders and vision models])."""
    return output.float().sum()


def refuse_encoder_decoder(model: nn.Module) -> None:
    """Raise, naming ``model``, if it is an encoder-decoder (Note [Pipeline stages of encoders and vision models])."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or (hasattr(model, "encoder") and hasattr(model, "decoder")):
        raise UnsupportedFeatureError(
            f"cannot split a {type(model).__name__} into pipeline stages: it is an encoder-decoder, and each "
            "decoder block attends to the encoder's output (cross-attention), so every decoder stage would need "
            "that output beside its own hidden states; a pipeline passes one activation from a stage to the next. "
            "Build its PipelineStages yourself (docs/distributed.md)"
        )


def family(model: nn.Module) -> tuple | None:
    """``(blocks path, its blocks, stage class)`` of ``model``'s family, or None."""
    for match, path, blocks, stage in _STAGES:
        if match(model):
            return path(model) if callable(path) else path, blocks(model), stage
    return None


def example_io(stage_of: Callable, spans: list, x: torch.Tensor) -> list:
    """``(input, output)`` meta tensors of each stage ``[lo, hi)`` of ``spans``, run in order on ``x``."""
    out, h = [], _meta(x)
    with torch.no_grad():
        for lo, hi in spans:
            # a copy on meta tensors, not the stage itself: a module called under a trace is held till its end
            mod = stage_of(lo, hi)
            y = copy.deepcopy(mod, {id(t): _meta(t) for t in (*mod.parameters(), *mod.buffers())})(h)
            out.append((h, y))
            h = y
    return out


def _meta(t: torch.Tensor) -> torch.Tensor:
    # torch.empty, not empty_like or .to: a logical world's mode places those on its own device
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


class _Stage(nn.Module):
    """Blocks ``[lo, hi)`` in ``self.layers``, the stem on the first stage and the head on the last."""

    def __init__(self, blocks: list, lo: int, hi: int) -> None:
        super().__init__()
        self.first, self.last = lo == 0, hi == len(blocks)
        self.layers = nn.ModuleList(blocks[lo:hi])


class EncoderStage(_Stage):
    """Blocks ``[lo, hi)`` of a transformers encoder (``BertModel.forward``, cut)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:  # a transformers model: untyped
        super().__init__(list(model.encoder.layer), lo, hi)
        self.config = model.config
        self.embeddings = model.embeddings if self.first else None
        # ELECTRA's, where its embeddings are narrower than its blocks (ElectraModel.forward)
        self.embeddings_project = getattr(model, "embeddings_project", None) if self.first else None

    def forward(self, x):
        h = self.embeddings(input_ids=x) if self.embeddings is not None else x
        h = self.embeddings_project(h) if self.embeddings_project is not None else h
        masking = importlib.import_module("transformers.masking_utils")  # transformers is optional
        if getattr(self.config, "is_decoder", False):  # BertModel._create_attention_masks: causal as a decoder
            mask = masking.create_causal_mask(
                config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=None
            )
        else:
            mask = masking.create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=None)
        for layer in self.layers:
            h = layer(h, mask)
            h = h[0] if isinstance(h, tuple) else h
        return h.contiguous()


# An LM head on a transformers encoder: the head's attribute and the model's loss (its forward: the head on the
# base model's last hidden state; a causal LM's loss shifts the labels by one, a masked LM's does not).
LM_HEADS = {
    "BertLMHeadModel": ("cls", "causal"),
    "BertForMaskedLM": ("cls", "masked"),
    "RobertaForCausalLM": ("lm_head", "causal"),
    "RobertaForMaskedLM": ("lm_head", "masked"),
    "XLMRobertaForCausalLM": ("lm_head", "causal"),
    "XLMRobertaForMaskedLM": ("lm_head", "masked"),
    "ElectraForCausalLM": (("generator_predictions", "generator_lm_head"), "causal"),  # applied in this order
    "ElectraForMaskedLM": (("generator_predictions", "generator_lm_head"), "masked"),
}


class EncoderLMStage(EncoderStage):
    """Blocks ``[lo, hi)`` of the encoder under an LM head (:data:`LM_HEADS`), the head on the last stage."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:
        super().__init__(model.base_model, lo, hi)
        names = LM_HEADS[type(model).__name__][0]
        parts = [getattr(model, n) for n in ((names,) if isinstance(names, str) else names)]
        self.head = (parts[0] if len(parts) == 1 else nn.Sequential(*parts)) if self.last else None

    def forward(self, x):
        h = super().forward(x)
        return self.head(h) if self.head is not None else h


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``BertForMaskedLM``'s loss: every position predicts its own label (-100: none)."""
    return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


# A transformers ViT-style image classifier: the head on the class token, the loss transformers' own.
IMAGE_TRANSFORMERS = ("ViTForImageClassification", "DeiTForImageClassification")


class ImageTransformerStage(_Stage):
    """Blocks ``[lo, hi)`` of a transformers ViT or DeiT image classifier (its and its base model's forward, cut)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:
        base = model.base_model
        super().__init__(list(base.layers), lo, hi)
        self.config = model.config
        self.embeddings = base.embeddings if self.first else None
        self.layernorm = base.layernorm if self.last else None
        self.classifier = model.classifier if self.last else None

    def forward(self, x):
        if self.embeddings is not None:
            x = self.embeddings(x.to(self.embeddings.patch_embeddings.projection.weight.dtype))
        masking = importlib.import_module("transformers.masking_utils")  # transformers is optional
        mask = masking.create_bidirectional_mask(config=self.config, inputs_embeds=x, attention_mask=None)
        for layer in self.layers:
            x = layer(x, mask)
        if self.layernorm is None or self.classifier is None:
            return x.contiguous()
        return self.classifier(self.layernorm(x)[:, 0, :])


def image_classification_loss(config, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own loss (``loss_function(labels, logits, config)``): cross-entropy for one label an image."""
    loss_utils = importlib.import_module("transformers.loss.loss_utils")
    return loss_utils.ForSequenceClassificationLoss(labels, logits, config)


def _image_transformer(m) -> bool:
    if type(m).__name__ not in IMAGE_TRANSFORMERS or not type(m).__module__.startswith("transformers"):
        return False
    base, head = inspect.getsource(type(m.base_model).forward), inspect.getsource(type(m).forward)
    # the lines the stage copies: a release that changes them is refused, not split into something else
    return "hidden_states = layer(hidden_states, attention_mask" in base and (
        "pooled_output = sequence_output[:, 0, :]\n        logits = self.classifier(pooled_output)" in head
    )


class ResNetStage(_Stage):
    """Blocks ``[lo, hi)`` of a torchvision ResNet, its four stages' blocks in one list (``ResNet._forward_impl``, cut)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:
        super().__init__(_resnet_blocks(model), lo, hi)
        self.stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool) if self.first else None
        self.head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc) if self.last else None

    def forward(self, x):
        x = self.stem(x) if self.stem is not None else x
        for block in self.layers:
            x = block(x)
        return self.head(x) if self.head is not None else x.contiguous()


class TorchvisionViTStage(_Stage):
    """Blocks ``[lo, hi)`` of a torchvision ``VisionTransformer`` (its and its ``Encoder``'s forward, cut)."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:
        super().__init__(list(model.encoder.layers), lo, hi)
        self.hidden = model.hidden_dim
        if self.first:  # VisionTransformer._process_input, the class token, Encoder's position embedding
            self.conv_proj, self.class_token = model.conv_proj, model.class_token
            self.pos_embedding, self.dropout = model.encoder.pos_embedding, model.encoder.dropout
        self.ln: nn.Module | None = model.encoder.ln if self.last else None
        self.heads: nn.Module | None = model.heads if self.last else None

    def forward(self, x):
        if self.first:
            n = x.shape[0]
            tokens = self.conv_proj(x).reshape(n, self.hidden, -1).permute(0, 2, 1)
            x = self.dropout(torch.cat([self.class_token.expand(n, -1, -1), tokens], dim=1) + self.pos_embedding)
        for block in self.layers:
            x = block(x)
        return self.heads(self.ln(x)[:, 0]) if self.ln is not None and self.heads is not None else x.contiguous()


class TimmViTStage(_Stage):
    """Blocks ``[lo, hi)`` of a timm ``VisionTransformer`` (``forward_features`` and ``forward_head``, cut):
    the model itself without its blocks, and without its head or its embedding on the stages that lack them."""

    def __init__(self, model: Any, lo: int, hi: int) -> None:
        super().__init__(list(model.blocks), lo, hi)
        drop = ["blocks"]
        drop += [] if self.last else ["norm", "fc_norm", "head_drop", "head", "attn_pool"]
        drop += [] if self.first else ["patch_embed", "pos_drop", "patch_drop", "norm_pre", "pos_embed", "cls_token"]
        self.vit = _without(model, drop + ([] if self.first else ["reg_token"]))

    def forward(self, x):
        m = self.vit
        if self.first:
            x = m.norm_pre(m.patch_drop(m._pos_embed(m.patch_embed(x))))
        for block in self.layers:
            x = block(x)
        return m.forward_head(m.norm(x)) if self.last else x.contiguous()


def _without(model: nn.Module, names: list) -> nn.Module:
    """A shallow copy of ``model`` sharing its parameters, ``names`` (modules, parameters) taken out of it."""
    view = copy.copy(model)
    view._modules, view._parameters, view._buffers = dict(model._modules), dict(model._parameters), dict(model._buffers)
    for name in names:
        if isinstance(view._modules.get(name), nn.Module):
            view._modules[name] = nn.Identity()
        elif view._parameters.get(name) is not None:
            view._parameters[name] = None
    return view


def _resnet_blocks(model) -> list:
    return [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]


def _is(module: str, name: str) -> Callable:
    return lambda m: type(m).__name__ == name and type(m).__module__.startswith(module)


def _encoder(m) -> bool:
    enc = getattr(m, "encoder", None)
    return hasattr(m, "embeddings") and isinstance(getattr(enc, "layer", None), nn.ModuleList)


def _lm_head(m) -> bool:
    return type(m).__name__ in LM_HEADS and type(m).__module__.startswith("transformers") and _encoder(m.base_model)


# (which models, where their blocks are, their stage): Note [Pipeline stages of encoders and vision models]
_STAGES: list = [
    (_encoder, "encoder.layer", lambda m: list(m.encoder.layer), EncoderStage),
    (
        _lm_head,
        lambda m: f"{m.base_model_prefix}.encoder.layer",
        lambda m: list(m.base_model.encoder.layer),
        EncoderLMStage,
    ),
    (
        _image_transformer,
        lambda m: f"{m.base_model_prefix}.layers",
        lambda m: list(m.base_model.layers),
        ImageTransformerStage,
    ),
    (_is("torchvision.models", "ResNet"), "layer1..layer4", _resnet_blocks, ResNetStage),
    (
        _is("torchvision.models", "VisionTransformer"),
        "encoder.layers",
        lambda m: list(m.encoder.layers),
        TorchvisionViTStage,
    ),
    (_is("timm.models", "VisionTransformer"), "blocks", lambda m: list(m.blocks), TimmViTStage),
]
