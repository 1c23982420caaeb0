"""The models ``metadispatch trace --pp`` splits into stages: the built-in
LLaMA (``llama.LlamaStage``) and those pipeline/split.py writes
out (Note [Splitting a model into pipeline stages] there)."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedFeatureError
from ..pipeline import split as pipeline_split
from ..pipeline.split import Split
from . import llama
from .targets import UsageError

__all__ = ["split"]


def split(model: nn.Module, blocks: str | None = None) -> Split:
    """The :class:`Split` of ``model``; a model no family covers is a usage error."""
    if isinstance(model, llama.Llama):
        if blocks is not None and blocks != "layers":
            raise UsageError(f"--blocks {blocks}: the built-in LLaMA is split at its blocks in layers")
        c = model.config
        return Split(len(model.layers), lambda lo, hi: llama.LlamaStage(model, lo, hi), c.dim, c.vocab_size, llama.loss)
    try:
        return pipeline_split.split(model, blocks)
    except UnsupportedFeatureError as e:
        said = str(e) if pipeline_split.SPLITS in str(e) else f"{e}; {pipeline_split.SPLITS} split"  # once
        raise UsageError(f"--pp: {said}, and the built-in LLaMA") from None
