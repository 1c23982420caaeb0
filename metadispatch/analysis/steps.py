"""The steps of a traced generation loop, and the cache each one leaves the next.

Note [What a step's cache is]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A trace of ``model.generate()`` under ``md.GenerateAssumptions`` (Note
[Generating under declared assumptions] in values/assume.py) is a prefill
and decode steps, each a forward of the model that ends at the call choosing
the next token (``argmax``, ``multinomial``).  What the model keeps for the
next step is read from the trace, not from the cache class: at a step's
token call, the storages that are still alive, were made by a call inside
the model (a module's call, not generate's own bookkeeping at top level),
and that no top-level call read since the forward returned -- so not the
logits, which generate slices to choose the token.  For transformers'
``DynamicCache`` that is each layer's keys and values, one storage each,
growing by one token a step; a sliding-window layer holds its window; a
``StaticCache`` the same preallocated storages every step.  Each storage
counts once, at the shape of the call that made it (a window's slice is a
view of it).  A pure function of a trace.
"""

from __future__ import annotations

import dataclasses

from ..ir.records import Leaf, TensorMeta, dtype_abbr
from ..ir.text import render
from ..ir.trace import Trace
from ..values.assume import TOKEN_OPS

__all__ = ["Step", "Steps", "generation_steps"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: calls ``first`` to ``end`` (its token call), and the cache alive at ``end``."""

    name: str  # "prefill", "decode 1", ...
    first: int
    end: int
    cache: tuple[TensorMeta, ...]  # one per storage, as the call that made it returned it

    @property
    def cache_bytes(self) -> int:
        return sum(m.numel * m.dtype.itemsize for m in self.cache)

    def shapes(self) -> list[tuple]:
        """The cache tensors' shapes, sorted."""
        return sorted(tuple(m.shape) for m in self.cache)


class Steps(list):
    """The steps in order; ``str()`` is a table of them."""

    def __str__(self) -> str:
        rows = []
        before = 0
        for s in self:
            kinds: dict = {}
            for m in s.cache:
                key = f"{dtype_abbr(m.dtype)}{list(m.shape)}"
                kinds[key] = kinds.get(key, 0) + 1
            held = ", ".join(f"{n} × {k}" for k, n in kinds.items())
            rows.append((s.name, f"{s.first}-{s.end}", f"{s.cache_bytes:,}", f"{s.cache_bytes - before:+,}", held))
            before = s.cache_bytes
        return "\n".join(render(("step", "calls", "cache B", "grew", "cache tensors"), rows, "<>>><")).lstrip("\n")


def generation_steps(trace: Trace) -> Steps:
    """The prefill and decode steps of a traced ``generate()``, with the cache after each (Note [What a step's cache is]).

    >>> import torch, transformers, metadispatch as md
    >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> t = md.tracer(assume=md.GenerateAssumptions(token_id=5))(lambda: model.generate(ids, max_new_tokens=3))
    >>> [(s.name, s.shapes()) for s in md.generation_steps(t)]  # doctest: +NORMALIZE_WHITESPACE
    [('prefill', [(1, 1, 3, 8), (1, 1, 3, 8)]), ('decode 1', [(1, 1, 4, 8), (1, 1, 4, 8)]),
     ('decode 2', [(1, 1, 5, 8), (1, 1, 5, 8)])]
    """
    calls = trace.calls
    tokens = [c.index for c in calls if c.op in TOKEN_OPS]
    marks = sorted((i, name) for name, i in trace.marks.items() if name == "prefill" or name.startswith("decode "))
    leaves = {leaf.meta.storage for leaf in trace.leaves.values() if isinstance(leaf, Leaf)}
    deaths = trace.deaths or {}
    made: dict = {}  # storage -> (call index, meta) of the call that made it, in a module
    steps = Steps()
    at = 0
    for first, name in marks:
        end = next((t for t in tokens if t >= first), None)
        if end is None:
            break
        for c in calls[at:end]:
            for m in c.output_metas:
                if m.storage not in made and m.storage not in leaves:
                    made[m.storage] = (c.index, m) if c.module else None
        at = end
        last_in_model = max((i for i in range(first, end) if calls[i].module), default=first)
        read_after = {m.storage for c in calls[last_in_model + 1 : end + 1] for m in c.inputs}
        held = tuple(
            meta
            for storage, found in made.items()
            if found is not None and deaths.get(storage, len(calls) + 1) > end and storage not in read_after
            for _, meta in (found,)
        )
        steps.append(Step(name, first, end, held))
    return steps
