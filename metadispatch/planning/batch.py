"""``md.max_batch``: the largest batch whose steady-state step fits on a GPU.

Requirements: no GPU and no out-of-memory error on purpose (Lightning's
``BatchSizeFinder`` and accelerate's ``find_executable_batch_size`` OOM a
real device until it stops failing); the figure is the one ``md.fits``
gives -- reserved memory through the simulated caching allocator, against
the profile's memory -- for the step a training loop repeats (``warmup=1``
by default: an optimizer's state is live from the start); O(log n) traces;
one answer for every rank of a logical world (the worst).

Note [Searching for the largest batch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Batches double from ``start`` until one does not fit, then a binary search
between the last that fit and the first that did not: about ``2 log2(n)``
traces for an answer ``n``.  It takes the reserved peak to grow with the
batch, which holds for the steps we know of up to the allocator's rounding
(a batch one larger can land in the same 2 MiB segments); the result's
``next`` is the traced figure of ``batch + 1``, so that the answer is
checked where it matters.  A world is answered by its worst rank: a batch
fits when every rank traced (``ranks``, default all) fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..analysis.fit import Fit, fits
from ..errors import MetaDispatchError
from ..spec.profiles import GPUProfile, gpu_profile
from ..tracing.tracer import tracer

__all__ = ["MaxBatch", "max_batch"]


class MaxBatch:
    """The answer: ``batch`` (0: not even ``start`` fits), its ``fits``
    (a :class:`~metadispatch.analysis.fit.Fit`, the worst rank's; None when
    ``batch`` is 0) and ``next``, the figure of the first batch that does
    not fit, ``batch + 1`` (``start`` when ``batch`` is 0; None where
    ``limit`` fits); ``tried`` maps each
    batch traced to whether it fit; ``seconds`` the search's time."""

    def __init__(self, batch: int, figures: dict, failed: int | None, seconds: float, gpu: GPUProfile) -> None:
        self.batch, self.gpu, self.seconds = batch, gpu, seconds
        self.fits: Fit | None = figures.get(batch)
        self.failed = failed  # the batch ``next`` is of: batch + 1, or ``start`` when that fails
        self.next: Fit | None = figures.get(failed) if failed is not None else None
        self.tried = {b: bool(f) for b, f in sorted(figures.items())}

    def __repr__(self) -> str:
        return f"<MaxBatch {self.batch} on {self.gpu.title}>"

    def __str__(self) -> str:
        head = f"largest batch that fits on {self.gpu.title}: {self.batch}"
        head += f" ({len(self.tried)} traces, {self.seconds:.1f} s)"
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
    **options,
) -> MaxBatch:
    """The largest batch whose steady-state step fits on ``gpu`` (Note [Searching for the largest batch]).

    ``make_step(batch)`` returns ``(fn, args)`` or ``(fn, args, kwargs)``:
    the step for that batch and what to call it with; each candidate is
    traced with ``md.tracer(warmup=warmup, gpu=gpu, **options)``
    (``device`` defaults to ``"cuda"``) and judged by ``md.fits``
    (``capacity`` bytes instead of the profile's memory).  With
    ``world_size=N`` in ``options`` every rank in ``ranks`` (default: all)
    is traced and the worst decides.

    >>> import torch, metadispatch as md
    >>> def make_step(batch):
    ...     return (lambda: torch.empty(batch, 2 ** 18).sum()), ()  # 1 MiB a sample
    >>> found = md.max_batch(make_step, "l4", capacity=100 * 2 ** 20)
    >>> found.batch, found.fits.fits, found.next.fits
    (98, True, False)
    """
    if type(start) is not int or start < 1 or type(limit) is not int or limit < start:
        raise MetaDispatchError(f"max_batch: start={start!r}, limit={limit!r}: batches 1 <= start <= limit")
    profile = gpu_profile(gpu)
    options.setdefault("device", "cuda")
    world = options.get("world_size")
    chosen = list(range(world)) if world is not None and ranks is None else list(ranks or [options.get("rank", 0)])
    figures: dict = {}
    began = time.perf_counter()

    def fit(batch: int) -> bool:
        worst = None
        for rank in chosen:
            made = make_step(batch)
            fn, args, kwargs = (*made, {}) if len(made) == 2 else made
            rank_options = dict(options, rank=rank) if world is not None else options
            trace = tracer(warmup=warmup, gpu=profile, **rank_options)(fn, *args, **kwargs)
            f = fits(trace, profile, capacity)
            if worst is None or f.reserved_peak > worst.reserved_peak:
                worst = f
        figures[batch] = worst
        return bool(worst)

    lo, hi = 0, None  # the largest that fit, the smallest that did not
    b = start
    while hi is None:
        if fit(b):
            lo = b
            if b == limit:
                break
            b = min(2 * b, limit)
        else:
            hi = b
    if hi is not None and lo:  # not when even ``start`` does not fit: nothing below it was asked for
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fit(mid):
                lo = mid
            else:
                hi = mid
    return MaxBatch(lo, figures, hi, time.perf_counter() - began, profile)
