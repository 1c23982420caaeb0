"""``md.max_batch``: the largest batch whose steady-state step fits on a GPU.

Requirements: no GPU and no out-of-memory error on purpose (Lightning's
``BatchSizeFinder`` and accelerate's ``find_executable_batch_size`` OOM a
real device until it stops failing); the figure is the one ``md.fits``
gives -- reserved memory through the simulated caching allocator, against
the profile's memory -- for the step a training loop repeats (``warmup=1``
by default: an optimizer's state is live from the start); two full traces
where a guess from small ones is right, O(log n) where it is not; one
answer for every rank of a logical world (the worst).

Note [Searching for the largest batch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A guess first, then full traces around it.  The guess is the largest batch
under which every call's live bytes stay within the capacity, each call's
bytes a line through two small traces (Note [Live bytes affine in batch and
depth] in ``affine.py``): batches ``2 * start`` and ``3 * start`` of the
full model, or, with ``scale=(a, c)``, of the model built ``a`` and ``c``
blocks deep (``make_step(batch, layers=k)``), which trace in a fraction of
the time.  Not batch 1: its size-1 dimensions take other ops (GPT-2 clones
its position ids and sums their gradient over the batch only from 2 on),
so its calls do not line up with a larger batch's.  The guess is only where to look: the answer is always a full
steady-state trace that fits, and ``next`` the full trace of ``batch + 1``
that does not.  From the guess ``g`` the search gallops (``g + 1, g + 2,
g + 4, ...`` while they fit, or ``g - 1, g - 2, g - 4, ...`` while they do
not) and bisects the last step: two full traces where the guess is right,
``O(log e)`` for a guess ``e`` off.  Without a guess (the small traces do
not line up call for call) it is the plain search: doubling from ``start``
until a batch does not fit, then bisecting, about ``2 log2(n)`` traces.
Both take the reserved peak to grow with the batch, which holds for the
steps we know of up to the allocator's rounding (a batch one larger can
land in the same 2 MiB segments).  A world is answered by its worst rank:
a batch fits when every rank traced (``ranks``, default all) fits, and the
guess is the smallest of the ranks' guesses.

Note [One warm-up for two batches]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each full trace is a warm-up step and the step scored, so confirming a
guess ``g`` (``g`` fits, ``g + 1`` does not) stepped the full model four
times.  Where ``make_step(g)`` and ``make_step(g + 1)`` step one model --
the same ``fn``, the same objects (the model, an optimizer) where the
arguments are not tensors -- the two are traced in one mode after one
warm-up at ``g`` (Note [One warm-up, several steps] in tracing/tracer.py):
three steps.  ``g``'s trace is then its direct steady-state trace, call
for call, so an answer is never a batch that its own trace says does not
fit; and ``g + 1``'s figure is only ever a "does not fit" (where it fits,
``g + 1`` is traced again, with its own warm-up).  ``g + 1``'s starts from what ``g``'s step left, which is what its own
warm-up would leave where the state a step keeps does not depend on the
batch; its figure is used only where that is shown: the state at its
start is, leaf for leaf (maker, shape, dtype, stride, bytes), the state at
``g``'s start (the step kept what the warm-up left), and the small direct
traces at batches ``2 * start`` and ``3 * start`` start from the same state
at every depth they were traced at (what a warm-up leaves is not a line
in the batch with a slope: an optimizer's moments, not a cache of the last
batch's activations).  Otherwise ``g + 1`` is traced on its own.  The
state of a first step that keeps something of its batch only from some
batch above ``3 * start`` on would get through; we know of no such step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import Tensor, nn

from .._compat import pytree
from ..analysis.fit import Fit, fits
from ..errors import MetaDispatchError
from ..ir.cut import STATE
from ..ir.records import tensor_bytes
from ..spec.profiles import GPUProfile, gpu_profile
from ..tracing.tracer import run_steps, run_traced, tracer
from .ac import blocks
from .affine import aligned, largest, peak

__all__ = ["MaxBatch", "max_batch"]


class MaxBatch:
    """The answer: ``batch`` (0: not even ``start`` fits), its ``fits``
    (a :class:`~metadispatch.analysis.fit.Fit`, the worst rank's; None when
    ``batch`` is 0) and ``next``, the figure of the first batch that does
    not fit, ``batch + 1`` (``start`` when ``batch`` is 0; None where
    ``limit`` fits); ``tried`` maps each batch traced in full to whether it
    fit; ``guess`` the batch the small traces pointed at (None: no guess),
    ``small`` how many small traces made it (``scale=``'s shallow ones;
    those of the full model are in ``tried``); ``seconds`` the search's
    time."""

    def __init__(
        self, batch: int, figures: dict, failed: int | None, seconds: float, gpu: GPUProfile, guess, small: int
    ) -> None:
        self.batch, self.gpu, self.seconds, self.guess, self.small = batch, gpu, seconds, guess, small
        self.fits: Fit | None = figures.get(batch)
        self.failed = failed  # the batch ``next`` is of: batch + 1, or ``start`` when that fails
        self.next: Fit | None = figures.get(failed) if failed is not None else None
        self.tried = {b: bool(f) for b, f in sorted(figures.items())}
        self.shared: list = []  # batches traced after another's warm-up (Note [One warm-up for two batches])

    def __repr__(self) -> str:
        return f"<MaxBatch {self.batch} on {self.gpu.title}>"

    def __str__(self) -> str:
        head = f"largest batch that fits on {self.gpu.title}: {self.batch}"
        small = f" and {self.small} shallow" if self.small else ""
        small = f", {len(self.shared)} after another's warm-up{small}" if self.shared else small
        guess = f", guessed {self.guess}" if self.guess is not None else ", no guess"
        head += f" ({len(self.tried)} full traces{small}{guess}, {self.seconds:.1f} s)"
        lines = [head]
        if self.fits is not None:
            lines.append(f"  batch {self.batch}: {self.fits}")
        if self.next is not None:
            lines.append(f"  batch {self.failed}: {self.next}")
        return "\n".join(lines)


def max_batch(
    make_step: Callable,
    gpu: str | GPUProfile | None = None,
    *,
    capacity: int | None = None,
    start: int = 1,
    limit: int = 1 << 24,
    warmup: int = 1,
    ranks=None,
    scale: tuple | None = None,
    share: bool = True,
    **options,
) -> MaxBatch:
    """The largest batch whose steady-state step fits on ``gpu`` (Note [Searching for the largest batch]).

    ``make_step(batch)`` returns ``(fn, args)`` or ``(fn, args, kwargs)``:
    the step for that batch and what to call it with; each candidate is
    traced with ``md.tracer(warmup=warmup, gpu=gpu, **options)``
    (``device`` defaults to ``"cuda"``) and judged by ``md.fits``
    (``capacity`` bytes instead of the profile's memory).  With
    ``world_size=N`` in ``options`` every rank in ``ranks`` (default: all)
    is traced and the worst decides.  ``scale=(a, c)``: the guess comes
    from the model built ``a`` and ``c`` blocks deep, ``make_step(batch,
    layers=k)`` (``2 <= a < c``); the full depth is counted in the model
    among the step's arguments (the children of its largest
    ``nn.ModuleList``).  ``share=False``: every batch its own warm-up
    (Note [One warm-up for two batches]; ``.shared`` lists those that did not).

    >>> import torch, metadispatch as md
    >>> def make_step(batch):
    ...     return (lambda: torch.empty(batch, 2 ** 18).sum()), ()  # 1 MiB a sample
    >>> found = md.max_batch(make_step, "l4", capacity=100 * 2 ** 20)
    >>> found.batch, found.fits.fits, found.next.fits, sorted(found.tried)
    (98, True, False, [2, 3, 97, 98, 99])
    """
    if type(start) is not int or start < 1 or type(limit) is not int or limit < start:
        raise MetaDispatchError(f"max_batch: start={start!r}, limit={limit!r}: batches 1 <= start <= limit")
    if scale is not None and not (
        isinstance(scale, tuple) and len(scale) == 2 and all(type(k) is int for k in scale) and 2 <= scale[0] < scale[1]
    ):
        raise MetaDispatchError(f"max_batch: scale={scale!r}, two depths (a, c) with 2 <= a < c, e.g. (2, 4)")
    profile = gpu_profile(gpu)
    options.setdefault("device", "cuda")
    world = options.get("world_size")
    chosen = list(range(world)) if world is not None and ranks is None else list(ranks or [options.get("rank", 0)])
    figures: dict = {}  # batch -> the worst rank's Fit, full depth
    ahead: dict = {}  # batch -> the worst rank's Fit from a shared warm-up, proven (Note [One warm-up for two batches])
    shared: set = set()  # the batches in ``figures`` that came from ``ahead``
    points: dict = {}  # (batch, layers) -> each rank's aligned live bytes (affine.py)
    states: dict = {}  # (batch, layers) -> each rank's state at its step's start, of the small traces
    # the small traces the guess is from: not batch 1, where size-1 dimensions take other ops (a clone, a sum)
    keys = [(b, k) for k in scale or (None,) for b in (2 * start, 3 * start)]
    began = time.perf_counter()

    def made(batch: int, layers: int | None) -> tuple:
        out = make_step(batch) if layers is None else make_step(batch, layers=layers)
        fn, args, kwargs = (*out, {}) if len(out) == 2 else out
        return fn, tuple(args), dict(kwargs)

    def run(batches: tuple, layers: int | None = None) -> list:
        """The worst rank's Fit of each of ``batches`` (one, or two sharing a warm-up: None where not proven)."""
        worst: list = [None] * len(batches)
        for r, rank in enumerate(chosen):  # r: its place in the lists of points and states
            steps = [made(b, layers) for b in batches]
            rank_options = dict(options, rank=rank) if world is not None else options
            trace = tracer(warmup=warmup, gpu=profile, **rank_options)
            mode = trace.make_mode()  # a declared policy (assume=) marks one call's steps: never shared
            if len(steps) > 1 and mode.assume is None and _shareable(*steps):
                traces = run_steps(mode, steps[0][0], [(a, k) for _, a, k in steps], trace.restore, trace.warmup)
            else:  # not one model stepped at two batches: the first alone, the second not proven
                traces = [run_traced(mode, steps[0][0], steps[0][1], steps[0][2], trace.restore, trace.warmup)]
                worst[1:] = [False] * (len(steps) - 1)
            for i, (batch, t) in enumerate(zip(batches, traces)):
                f = fits(t, profile, capacity)
                if (batch, layers) in keys:
                    points.setdefault((batch, layers), []).append(aligned(t.calls, f.memory.memory.timeline, layers))
                    states.setdefault((batch, layers), []).append(_state(t))
                proven = i == 0 or (worst[i] is not False and _state(t) == _state(traces[0]) and steady(r))
                if not proven:
                    worst[i] = False
                elif worst[i] is None or f.reserved_peak > worst[i].reserved_peak:
                    worst[i] = f
        return [w if w is not False else None for w in worst]

    def steady(r: int) -> bool:
        """Whether the small traces' steps start from the same state at each batch (the ``r``-th rank traced's)."""
        return all(key in states for key in keys) and all(
            states[(2 * start, k)][r] == states[(3 * start, k)][r] for k in scale or (None,)
        )

    def fit(batch: int, pair: bool = False) -> bool:
        if batch not in figures and batch in ahead:
            after = ahead.pop(batch)
            if after:  # an answer is always a direct trace's: this one again, its own warm-up, batch + 1 after it
                pair = True
            else:
                figures[batch] = after
                shared.add(batch)
        if batch not in figures:
            if pair and share and batch < limit and batch + 1 not in figures:
                figures[batch], after = run((batch, batch + 1))
                if after is not None and batch + 1 not in figures:
                    ahead[batch + 1] = after
            else:
                figures[batch] = run((batch,))[0]
        return bool(figures[batch])

    depth = _depth(make_step, start) if scale is not None else None
    small = keys if scale is not None else []
    for b, k in small:
        run((b,), k)
    if scale is None and 3 * start <= limit and fit(2 * start):
        fit(3 * start)

    def guess(missed: int | None = None) -> int | None:
        """The guess; after batch ``missed`` did not fit, the guess less what the lines missed of its reserved peak."""
        if not all(key in points for key in keys):
            return None
        bytes_ = profile.memory if capacity is None else capacity
        each: list[int | None] = []
        for r in range(len(chosen)):
            at = {key: points[key][r] for key in keys}
            line = peak(at, missed, depth) if missed is not None else None
            spare = figures[missed].reserved_peak - line if missed is not None and line is not None else 0
            each.append(largest(at, int(bytes_ - spare), depth))
        known = [e for e in each if e is not None]
        return min(known) if len(known) == len(each) else None

    first = guess()
    lo, hi = _search(fit, start, limit, first, figures, guess)
    batch = lo if lo >= start else 0
    found = MaxBatch(
        batch, figures, hi if hi <= limit else None, time.perf_counter() - began, profile, first, len(small)
    )
    found.shared = sorted(shared)
    return found


def _search(fit: Callable, start: int, limit: int, guess: int | None, figures: dict, again: Callable) -> tuple:
    """``(lo, hi)``, adjacent: the largest batch that fits (``start - 1``: none) and the smallest that does not
    (``limit + 1``: none up to ``limit``), from ``guess`` when there is one (Note [Searching for the largest batch]);
    ``again(batch)`` guesses anew after ``batch`` did not fit."""
    lo = max([b for b, f in figures.items() if f], default=start - 1)
    hi = min([b for b, f in figures.items() if not f], default=limit + 1)
    g = None if guess is None or hi - lo <= 1 else min(max(guess, lo, start), hi - 1)
    for _ in range(_AGAIN):  # the guess is of allocated bytes: take off what the allocator kept over it
        if g is None or fit(g, True):  # with g + 1 after g's warm-up where that is proven the same
            break
        hi, better = g, again(g)
        if better is None or better >= g - 1:  # no nearer guess: gallop down from here
            break
        g = max(better, lo + 1, start)
    if g is not None and hi - lo > 1:
        d = 1
        if fit(g):  # up, doubling the step, while they fit
            lo = g
            while g + d < hi and fit(g + d):
                lo, d = g + d, 2 * d
            hi = min(hi, g + d)
        else:  # down, doubling the step, while they do not
            hi = g
            while g - d > lo and not fit(g - d):
                hi, d = g - d, 2 * d
            lo = max(lo, g - d)
    elif hi - lo > 1:  # no guess: double from what fits
        b = start if lo < start else min(2 * lo, hi - 1)
        while lo < b < hi:
            if fit(b):
                lo, b = b, min(2 * b, hi - 1)
            else:
                hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fit(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


_AGAIN = 3  # guesses anew after a full trace that did not fit, before galloping down


def _depth(make_step: Callable, start: int) -> int:
    """How many blocks the full model has: the children of the largest ``nn.ModuleList`` of the step's model."""
    made = make_step(start)
    found = [a for a in (*made[1], *(made[2].values() if len(made) > 2 else ())) if isinstance(a, nn.Module)]
    if not found:
        raise MetaDispatchError(
            "max_batch: scale= counts the full model's blocks; pass the model among the step's args"
        )
    return len(blocks(found[0]))


def _shareable(first: tuple, second: tuple) -> bool:
    """Whether two ``(fn, args, kwargs)`` step one model: the same ``fn``, and the same objects where not tensors."""
    (f1, a1, k1), (f2, a2, k2) = first, second
    l1, spec1 = pytree.tree_flatten((a1, k1))
    l2, spec2 = pytree.tree_flatten((a2, k2))
    if f1 is not f2 or spec1 != spec2:
        return False
    return all(isinstance(x, Tensor) and isinstance(y, Tensor) or x is y for x, y in zip(l1, l2))


def _state(trace) -> list:
    """What the step starts from: each state leaf's maker, shape, dtype, stride and bytes (ir/cut.py)."""
    return sorted(
        (leaf.name, tuple(leaf.meta.shape), str(leaf.meta.dtype), tuple(leaf.meta.stride), tensor_bytes(leaf.meta))
        for leaf in trace.leaves.values()
        if leaf.kind == STATE
    )
