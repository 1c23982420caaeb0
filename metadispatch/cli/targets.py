"""What the command line traces: the built-in LLaMA, ``MODULE:CALLABLE`` or
a ``transformers`` architecture built from its config.

Each target is built under ``md.MetaMode(device=...)``, so building a 7B
model allocates nothing, and comes back as a :class:`Target`: the model, the
example inputs, and a step that runs forward and (unless told not to)
backward.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from ..core.mode import MetaMode

__all__ = ["Target", "default_target", "callable_target", "hf_target", "load_callable", "parse_overrides"]


class Target(NamedTuple):
    name: str
    model: Any
    inputs: tuple
    step: Callable  # step(model, *inputs): what gets traced


def _train_step(backward: bool, call: Callable | None = None) -> Callable:
    def step(model, *inputs):
        out = call(model, *inputs) if call is not None else model(*inputs)
        loss = _first_tensor(out)
        if backward and loss is not None and loss.requires_grad:
            (loss if loss.dim() == 0 else loss.float().sum()).backward()
        return out

    return step


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def default_target(device="cuda", backward=True, batch=1, seq=2048) -> Target:
    """LLaMA-7B in bf16, a batch of ``batch`` x ``seq`` tokens."""
    from .llama import LlamaConfig, example

    model, inputs = example(LlamaConfig(), batch=batch, seq=seq, device=device)
    return Target(f"built-in LLaMA-7B (bf16, batch {batch} x {seq} tokens)", model, inputs,
                  _train_step(backward))


def load_callable(spec: str) -> Callable:
    """``package.module:fn`` or ``path/to/file.py:fn``."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"expected MODULE:CALLABLE, got {spec!r}")
    if mod_name.endswith(".py") or "/" in mod_name:
        path = Path(mod_name)
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(path.stem, module)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    return getattr(module, attr)


def callable_target(spec: str, device="cuda", backward=True) -> Target:
    """A function returning ``(model, inputs)``; inputs a tensor or a tuple."""
    fn = load_callable(spec)
    with MetaMode(device=device, record=False):
        model, inputs = fn()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return Target(spec, model, inputs, _train_step(backward))


def parse_overrides(pairs: list) -> dict:
    """``["num_hidden_layers=2", "act='gelu'"]`` -> dict, values as Python literals."""
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--config expects key=value, got {pair!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def hf_target(arch: str, overrides: dict, device="cuda", backward=True, batch=1, seq=128,
              dtype=None) -> Target:
    """A ``transformers`` model of architecture ``arch`` (a model type such
    as ``llama`` or ``gpt2``) from its default config with ``overrides``."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("--hf needs transformers: pip install metadispatch[hf]") from e
    config = transformers.AutoConfig.for_model(arch, **overrides)
    with MetaMode(device=device, record=False):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
            causal = True
        except ValueError:
            model, causal = transformers.AutoModel.from_config(config), False
        if dtype is not None:
            model = model.to(dtype)
        ids = torch.randint(0, getattr(config, "vocab_size", 1000), (batch, seq))

    def call(model, ids):
        return model(input_ids=ids, labels=ids) if causal else model(input_ids=ids)

    return Target(f"transformers {type(model).__name__} (batch {batch} x {seq} tokens)", model,
                  (ids,), _train_step(backward, call))
