"""The shared metadata cache is bounded in bytes as well as in entries."""

from __future__ import annotations

import gc
import tracemalloc

import torch

import metadispatch as md
from metadispatch.core import cache


def _total_by_hand() -> int:
    return sum(cache.entry_weight(k, v[0]) for k, v in cache._SHARED.items())


def _weights() -> list[int]:
    return [cache.entry_weight(k, v[0]) for k, v in cache._SHARED.items()]


def _distinct_calls(x, w, i):
    """Calls whose keys are all new for a new shape of ``x``: each recipe kind, float, bool and list arguments."""
    x @ w  # a fresh output
    x.add(i + 0.5)  # a float argument
    torch.cat([x, x[: i % 7]])  # a list of tensors
    x.sum((0, 1), keepdim=i % 2 == 0)  # a list of ints and a bool
    x.view(2, -1)  # a view of the input


def test_cache_counts_the_bytes_its_entries_keep_alive():
    # cached_bytes is what the entries really hold, as tracemalloc sees the
    # process grow -- not sys.getsizeof summed over objects every entry shares.
    cache.clear()
    with md.MetaMode(record=False):  # no trace: the cache is all that grows
        w = torch.empty(4, 4)
        xs = [torch.empty(i + 1, 4) for i in range(0, 300, 2)]  # their own entries come before
        for i in range(5):  # first-call caches of torch and of the rules
            _distinct_calls(torch.empty(2000 + i, 4), w, i)
        gc.collect()
        counted = cache.cached_bytes()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i, x in enumerate(xs):
                _distinct_calls(x, w, i)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        counted = cache.cached_bytes() - counted
    assert 0.75 * grown <= counted <= 1.25 * grown, (counted, grown)


def test_cache_bytes_stay_under_the_limit_with_long_argument_lists(monkeypatch):
    cache.clear()
    monkeypatch.setattr(cache, "LIMIT_BYTES", 400_000)
    with md.MetaMode():
        parts = [torch.empty(2, 3) for _ in range(300)]
        for n in range(40, 300, 10):  # every call a new key with n tensors in it
            torch.cat(parts[:n])
    assert 0 < cache.cached_bytes() <= 400_000
    assert cache.cached_bytes() == _total_by_hand()
    cache.clear()
    assert cache.cached_bytes() == 0 and not cache._SHARED


def test_cache_drops_the_oldest_entries_first(monkeypatch):
    cache.clear()
    monkeypatch.setattr(cache, "LIMIT_BYTES", 200_000)
    with md.MetaMode():
        x = torch.empty(4)
        first = [torch.empty(4) for _ in range(80)]
        torch.cat(first)
        assert max(_weights()) > 10_000  # it was kept at first
        for i in range(1, 800):  # many small entries push the big one out
            x.add(i)
    assert max(_weights()) < 10_000  # the cat's key is gone
    assert cache.cached_bytes() <= 200_000


def test_cache_keeps_no_entry_heavier_than_an_eighth_of_the_limit(monkeypatch):
    cache.clear()
    monkeypatch.setattr(cache, "LIMIT_BYTES", 80_000)
    with md.MetaMode() as mode:
        parts = [torch.empty(1) for _ in range(400)]
        a = torch.cat(parts)
        b = torch.cat(parts)  # answered again by the rule, and the same answer
    assert a.shape == b.shape == (400,)
    assert all(w <= 80_000 // 8 for w in _weights())
    assert not any(k[0] is torch.ops.aten.cat.default for k in cache._SHARED)
    assert mode.cache.misses == 3  # empty, and both cats
