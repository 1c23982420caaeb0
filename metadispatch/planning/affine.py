"""A guess at the largest batch from a few small traces: each call's live bytes, affine in batch and depth.

Requirements: a guess, never a verdict (``md.max_batch`` confirms it with
full traces); cheap (two batches of a model a few blocks deep, which trace
in a fraction of the full model's time); no guess at all where the small
traces do not line up call for call.

Note [Live bytes affine in batch and depth]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The peak of a step is not affine in its batch: it is the largest of the
calls' live bytes, and which call holds it moves (LLaMA-7B's steady state
peaks in the optimizer at batch 1 and in backward from batch 3: 67.4, 79.7
and 92.7 GB allocated at 1, 3 and 4).  Each call's live bytes are affine,
though, where the calls are the same at two batches: every tensor of the
step is a fixed size or a multiple of the batch (attention's ``b x s x s``
too).  Two traces at batches ``b1 < b2`` then give every call's line, and
the guess is the largest batch under which every line stays within the
capacity (the allocated bytes: reserved memory adds the allocator's
rounding, which the confirming full trace counts).

Depth is handled the same way for a model of ``L`` repeated blocks (the
children of one ``nn.ModuleList``, found in the calls' module names as
``prefix.<k>``): what the calls outside the blocks hold (parameters,
gradients and optimizer state of ``L`` blocks, the activations they saved)
is affine in ``L``, and a call inside block ``k`` holds an amount affine in
``k`` too (``k`` blocks' saved activations before it in forward, ``L - k``
blocks' gradients before it in backward), so over the blocks its largest
is at the first or the last.  Two depths ``a < c`` (``a >= 2``, so that the
first and last block differ) line up once the blocks in between are left
out: the calls outside the blocks, then those of the first and of the last
block, by phase and op; calls between two blocks (a residual add in the
parent module) count with the block before them, and a run of one op
outside the blocks (the optimizer reading each parameter's ``step``, as
many as there are parameters) counts once, at its largest.  Interior blocks are
taken to peak no higher than the two ends -- an assumption, which is why
the guess is confirmed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["aligned", "deep_peak", "largest", "peak"]


def aligned(calls: Sequence, timeline: Sequence[int], depth: int | None = None, ends: int = 1) -> tuple | None:
    """``(keys, live)``: the calls a trace of another batch (and, with ``depth``, another depth) shares with this one.

    Without ``depth`` every call counts, keyed by phase and op.  With
    ``depth`` (the number of blocks the model was built with) the calls of
    blocks other than the first and the last are left out (Note [Live bytes
    affine in batch and depth]); None when no list of ``depth`` blocks shows
    in the calls' module names.  ``ends=2`` keeps the first two blocks
    and the last two (Note [Blocks unlike their neighbours]).
    """
    if depth is None:
        return tuple((c.phase, c.op) for c in calls), list(timeline)
    where = [_index(c.module) for c in calls]
    counts: dict = {}
    for w in where:
        if w is not None:
            counts.setdefault(w[0], set()).add(w[1])
    lists = [p for p, ks in counts.items() if ks == set(range(depth))]
    if not lists:
        return None
    prefix = max(lists, key=lambda p: sum(w is not None and w[0] == p for w in where))
    blocks = [w[1] if w is not None and w[0] == prefix else None for w in where]
    last_block = {c.phase: i for i, (c, k) in enumerate(zip(calls, blocks)) if k is not None}
    keys: list[tuple] = []
    live: list[int] = []
    before: dict[str, int] = {}
    for i, (c, k) in enumerate(zip(calls, blocks)):
        if k is None and c.phase in before and i < last_block[c.phase]:
            k = before[c.phase]  # between two blocks: the block before it
        if k is not None:
            before[c.phase] = k
        role = "" if k is None else k if k < ends else k - depth if k >= depth - ends else None
        key = (c.phase, role, c.op)
        if role is not None and keys and keys[-1] == key:
            live[-1] = max(live[-1], timeline[i])  # a run of one op, as long as the parameters: one
        elif role is not None:
            keys.append(key)
            live.append(timeline[i])
    return tuple(keys), live


def largest(points: dict, capacity: int, depth: int | None = None) -> int | None:
    """The largest batch whose every call stays within ``capacity`` bytes, from ``points``.

    ``points`` maps ``(batch, layers)`` to :func:`aligned`'s ``(keys,
    live)``: two batches at one depth (``layers`` None), or two batches at
    each of two depths, extrapolated to ``depth``.  None where the points
    do not line up (other calls at another batch or depth) or no call grows
    with the batch (no bound from them); 0 where not even batch 0 would fit.
    """
    lines = _lines(points, depth)
    if lines is None:
        return None
    best = math.inf
    for base, slope in zip(*lines):
        if slope > 0:
            best = min(best, math.floor((capacity - base) / slope))
        elif base > capacity:
            return 0
    return None if best == math.inf else max(int(best), 0)


def peak(points: dict, batch: int, depth: int | None = None) -> float | None:
    """The allocated peak :func:`largest`'s lines give at ``batch`` (None where the points do not line up)."""
    lines = _lines(points, depth)
    return None if lines is None else max(base + slope * batch for base, slope in zip(*lines))


def deep_peak(shallow: tuple | None, deeper: tuple | None, depths: tuple, depth: int, ends: int = 1) -> float | None:
    """The allocated peak at ``depth`` blocks from :func:`aligned` (``ends``) of one step at two ``depths``.

    Each call's live bytes on its line through the two depths ``(a, c)``,
    the largest at ``depth`` (Note [Live bytes affine in batch and depth]);
    None where the calls do not line up, or ``a < 2 * ends`` (the blocks
    kept at the two ends overlap).

    Note [Blocks unlike their neighbours]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The interior blocks of a step can hold more than either end: FSDP2
    all-gathers the next block while one runs (in backward, block ``k - 1``
    during block ``k``), and the first and last blocks have no next, so an
    interior block holds one block's gathered parameters more.  On a
    6-layer LLaMA on 4 logical GPUs the ends' lines missed the peak by
    79 KiB.  The blocks from the second to the second-last are alike, each
    call's bytes affine in its block, so keeping two blocks at each end
    (``ends=2``) brackets them: exact against full traces
    (tests/planning/test_plan.py), for depths of 4 and more.
    """
    (a, c), none = depths, shallow is None or deeper is None
    if none or a < 2 * ends or shallow[0] != deeper[0]:  # type: ignore[index]
        return None
    t = (depth - a) / (c - a)
    return max(x + (y - x) * t for x, y in zip(shallow[1], deeper[1]))  # type: ignore[index]


def _lines(points: dict, depth: int | None) -> tuple | None:
    """Each call's intercept and slope in the batch, at ``depth`` where there are two depths."""
    if any(p is None for p in points.values()):
        return None
    keys = {p[0] for p in points.values()}
    batches = sorted({b for b, _ in points})
    layers = sorted({n for _, n in points}, key=lambda n: -1 if n is None else n)
    if len(keys) != 1 or len(batches) != 2 or len(points) != 2 * len(layers):
        return None
    b1, b2 = batches

    def line(at) -> tuple:
        lo, hi = points[(b1, at)][1], points[(b2, at)][1]
        slope = [(h - v) / (b2 - b1) for v, h in zip(lo, hi)]
        return [v - s * b1 for v, s in zip(lo, slope)], slope

    if len(layers) == 1:
        return line(layers[0])
    (a, c), (pa, sa), (pc, sc) = layers, line(layers[0]), line(layers[1])
    t = (int(depth or 0) - a) / (c - a)  # depth is given with two depths
    return [x + (y - x) * t for x, y in zip(pa, pc)], [x + (y - x) * t for x, y in zip(sa, sc)]


def _index(module: str) -> tuple | None:
    """``("layers", 3)`` for ``layers.3.mlp``: the first numbered part of a module's name and what comes before it."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None
