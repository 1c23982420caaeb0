"""A checkpoint's tensors one at a time, for loading: what ``md.materialize(checkpoint=)`` copies from.

:func:`plan` decides, from the headers, which of a module's state-dict
entries come from the checkpoint (refusing what ``load_state_dict`` would
refuse); :func:`stream` then yields each tensor's data as it is asked
for: safetensors through ``safe_open`` (one tensor read at a time),
``torch.save`` zips through ``torch.load(mmap=True, weights_only=True)``
(pages read as they are copied), so the host holds at most one
checkpoint tensor beyond the model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import CheckpointMismatchError
from .check import check
from .entries import Contents
from .index import inspect
from .torch_zip import named_tensors

__all__ = ["plan", "stream"]


def plan(module: nn.Module, checkpoint, strict: bool = True) -> tuple[Contents, list[tuple[str, torch.Tensor]]]:
    """The checkpoint's contents and ``(name, module's tensor)`` for each state entry it holds, in
    ``load_state_dict``'s order; raises :class:`CheckpointMismatchError` where ``load_state_dict``
    would (shapes always; missing and unexpected keys when ``strict``)."""
    contents = checkpoint if isinstance(checkpoint, Contents) else inspect(checkpoint)
    findings = check(module, contents)
    bad = findings.shape or (strict and (findings.missing or findings.unexpected))
    if bad:
        shown = [line for line in findings.lines() if not line.startswith(("dtype", "stored twice"))]
        raise CheckpointMismatchError(
            f"materialize: {contents.path} does not fit the module ({len(shown)} problems: "
            + "; ".join(shown[:8])
            + (", ..." if len(shown) > 8 else "")
            + ")",
            findings=findings,
        )
    state = module.state_dict(keep_vars=True)
    return contents, [(name, t) for name, t in state.items() if name in contents.tensors]


def stream(contents: Contents, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, CPU tensor)`` for each name, in order; each shard opened once."""
    folder = os.path.dirname(contents.path)
    with contextlib.ExitStack() as stack:
        opened: dict = {}
        for name in names:
            file = contents.tensors[name].file
            if file not in opened:
                opened[file] = _open(os.path.join(folder, file), stack)
            yield name, opened[file](name)


def _open(path: str, stack: contextlib.ExitStack):
    if _is_safetensors(path):
        try:  # an optional dependency (transformers brings it); inspect needs none
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError(f"loading {path}'s data needs safetensors: pip install safetensors") from e
        f = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
        return f.get_tensor
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    tensors = dict(named_tensors(path, loaded, torch.Tensor))
    return tensors.__getitem__


def _is_safetensors(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) != b"PK"
