"""Checkpoints read by their headers: what a file holds and whether it fits a model.

``md.checkpoint.inspect(path)`` lists a checkpoint's tensors (names, shapes,
dtypes, bytes) from a safetensors file, a ``torch.save`` zip or a shard
index without reading tensor data or running pickle code;
``md.checkpoint.check(model, path)`` compares them with a model built on
``meta`` or under ``md.MetaMode``.

Modules: ``entries`` (the records and the one way to refuse a file),
``safetensors_file`` and ``torch_zip`` (the two readers), ``index`` (shard
indexes and ``inspect``), ``check`` (``check`` and a model's ties),
``stream`` (what ``md.materialize(checkpoint=)`` loads, tensor by tensor).
"""

from .check import Findings, check, ties
from .entries import Contents, Entry
from .index import inspect

__all__ = ["inspect", "check", "ties", "Contents", "Entry", "Findings"]
