"""The KV cache a causal LM writes, layer by layer: what each layer kind holds per token and per sequence.

Note [KV layout from three prompt lengths]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A config formula (``2 * layers * kv_heads * head_dim * dtype``) is wrong for
every model that is not plain multi-head attention, and wrong differently per
layer: a sliding-window layer stops growing at its window, an MLA layer
caches a latent, a linear-attention or state-space layer holds a state of
fixed size.  So the model's own forward runs under a logical GPU (meta
storage: no memory, no weights) at three prompt lengths, and the bytes every
layer of the cache object holds afterwards are measured (each storage once,
for the first layer that holds it) after a prefill of ``n - 1`` tokens and one
decode step -- the state every later decode step holds.  (After a prefill
alone, transformers' sliding layers keep a view of the whole prompt's
storage, so the memory held then is the prompt's; the first decode step
replaces it by the window's.)

* two lengths ``a < b`` below every window the config declares give each
  layer's growth per token and its fixed part (``bytes(a) - slope * a``);
* a third length past the largest window shows which layers stop growing:
  where ``bytes(c)`` is below the line through the first two, the layer holds
  ``(bytes(c) - fixed) / slope`` tokens at most -- its window as the cache
  class keeps it.

A layer that does not grow between ``a`` and ``b`` is a fixed state.  The
cache object's ``layers`` (transformers' ``Cache``) are the layers; a cache
without them is measured as one.  The kinds are named from the measurement,
with the cache class's layer type beside it, and ``MLA`` where the config
declares a latent rank (``kv_lora_rank``).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from .. import _compat
from ..errors import MetaDispatchError
from ..mode.mode import MetaMode

__all__ = ["KVLayer", "KVLayout", "kv_layout"]


@dataclasses.dataclass(frozen=True)
class KVLayer:
    """One cache layer: ``fixed`` bytes per sequence, plus ``per_token`` for each of at most ``cap`` tokens."""

    kind: str  # "full", "sliding", "state" (and "MLA" where the config caches a latent)
    cls: str  # the cache layer's class, e.g. DynamicSlidingWindowLayer
    per_token: float
    fixed: int
    cap: int | None  # tokens held at most; None: grows with the sequence

    def bytes_at(self, n: int) -> float:
        return self.fixed + self.per_token * (n if self.cap is None else min(n, self.cap))


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Every layer of the cache, in the model's order (Note [KV layout from three prompt lengths])."""

    layers: tuple[KVLayer, ...]
    lengths: tuple[int, int, int]  # the prompts measured

    def bytes_at(self, n: int) -> float:
        """Bytes one sequence of ``n`` tokens holds in the cache."""
        return sum(layer.bytes_at(n) for layer in self.layers)

    @property
    def per_token(self) -> float:
        """Bytes each token adds while every layer still grows (below every window)."""
        return sum(layer.per_token for layer in self.layers)

    @property
    def fixed(self) -> int:
        return sum(layer.fixed for layer in self.layers)

    def longest(self, budget: float, limit: int) -> int:
        """The most tokens one sequence can hold in ``budget`` bytes, at most ``limit``."""
        if self.bytes_at(0) > budget:
            return 0
        lo, hi = 0, limit  # bytes_at is non-decreasing: bisect for the last n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.bytes_at(mid) <= budget else (lo, mid - 1)
        return lo

    def kinds(self) -> list[str]:
        """``"2 × full (DynamicLayer): 256 B/token"``-style lines, one per kind of layer."""
        groups: dict = {}
        for layer in self.layers:
            key = (layer.kind, layer.cls, layer.per_token, layer.fixed, layer.cap)
            groups[key] = groups.get(key, 0) + 1
        lines = []
        for (kind, cls, per_token, fixed, cap), count in groups.items():
            held = f", at most {cap:,} tokens" if cap is not None and per_token else ""
            state = f" + {fixed:,} B per sequence" if fixed else ""
            lines.append(f"{count} × {kind} ({cls}): {per_token:,.0f} B per token{held}{state}")
        return lines


def kv_layout(
    model: nn.Module, gpu: str, lengths: tuple[int, int] | None = None, *, world_size: int | None = None
) -> KVLayout:
    """Measure the cache ``model`` writes on a logical ``gpu`` (Note [KV layout from three prompt lengths]).

    ``world_size``: ``model`` is rank 0 of a tensor-parallel world of that
    many ranks (planning/tp.py), and the layout is that rank's cache.
    """
    config = getattr(model, "config", None)
    window = _largest_window(config)
    smallest = _smallest_window(config)
    if lengths is None:
        lengths = (16, 32) if smallest is None or smallest > 33 else (max(smallest // 4, 2), max(smallest // 2, 3))
    a, b = lengths
    if not (type(a) is int and type(b) is int and 2 <= a < b) or (smallest is not None and b > smallest):
        raise MetaDispatchError(
            f"kv_layout: lengths={lengths!r}: two prompt lengths 2 <= a < b"
            + (f", both at most the smallest window ({smallest})" if smallest is not None else "")
        )
    c = (window or 0) + 2 * b
    vocab = int(getattr(config, "vocab_size", 32000))
    held = [_per_layer(model, gpu, n, vocab, world_size) for n in (a, b, c)]
    latent = getattr(config, "kv_lora_rank", None)
    layers = []
    for (cls, ba), (_, bb), (_, bc) in zip(*held, strict=True):
        slope = (bb - ba) / (b - a)
        fixed = max(round(ba - slope * a), 0)
        if slope == 0:
            kind, cap = "state", None
        elif bc < fixed + slope * c:
            kind, cap = "sliding", round((bc - fixed) / slope)
        else:
            kind, cap = "full", None
        if latent and kind != "state":
            kind = f"{kind} MLA"
        layers.append(KVLayer(kind, cls, slope, fixed, cap))
    return KVLayout(tuple(layers), (a, b, c))


def decoded_cache(model, ids):
    """The cache after a prefill of ``ids[:, :-1]`` and a decode step of its last token."""
    out = model(ids[:, :-1], use_cache=True)
    return cache_of(model(ids[:, -1:], **{cache_kwarg(model): cache_of(out)}, use_cache=True))


def cache_kwarg(model) -> str:
    """The argument a forward takes its cache by: ``cache`` from transformers 5.x, else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(out):
    """The cache object a transformers forward returned (``cache``; ``past_key_values`` before 5.x)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _per_layer(model, gpu: str, n: int, vocab: int, world_size: int | None) -> list[tuple[str, int]]:
    with MetaMode(device="cuda", gpu=gpu, world_size=world_size), no_grad_for(world_size):
        cache = decoded_cache(model, torch.randint(0, vocab, (1, n)))
    seen: set = set()  # a storage two layers hold counts for the first
    return [
        (type(layer).__name__, storage_bytes(_tensors(layer), seen))
        for layer in getattr(cache, "layers", None) or [cache]
    ]


def no_grad_for(world_size: int | None):
    """``inference_mode``, or ``no_grad`` for a tensor-parallel rank: under
    MetaMode a DTensor's linear decomposes and sets a version counter, which an
    inference tensor refuses ("Cannot set version_counter for inference
    tensor"); a real CPU run of the same DTensor linear does not.  The cache
    and the weights are the same under either; the workaround stays here
    until the dispatch is fixed."""
    return torch.no_grad() if world_size else torch.inference_mode()


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the storages under ``tensors`` not yet in ``seen`` (storage ids), each once; adds them to it."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and (key := _compat.storage_id(s := t.untyped_storage())) not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def _windows(config) -> list[int]:
    windows = [getattr(config, k, None) for k in ("sliding_window", "attention_chunk_size")]
    return [int(w) for w in windows if isinstance(w, int) and w > 0]


def _largest_window(config) -> int | None:
    return max(_windows(config), default=None)


def _smallest_window(config) -> int | None:
    return min(_windows(config), default=None)


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
