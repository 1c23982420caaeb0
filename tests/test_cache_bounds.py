"""The shared metadata cache is bounded in bytes as well as in entries."""

from __future__ import annotations

import torch

import metadispatch as md
from metadispatch.core import cache


def _total_by_hand() -> int:
    return sum(cache._weight(k) + cache._weight(v[0]) for k, v in cache._SHARED.items())


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
    monkeypatch.setattr(cache, "LIMIT_BYTES", 400_000)
    with md.MetaMode():
        x = torch.empty(4)
        first = [torch.empty(4) for _ in range(80)]
        torch.cat(first)
        assert max(cache._weight(k) for k in cache._SHARED) > 10_000  # it was kept at first
        for i in range(1, 400):  # many small entries push the big one out
            x.add(i)
    assert max(cache._weight(k) for k in cache._SHARED) < 10_000  # the cat's key is gone
    assert cache.cached_bytes() <= 400_000


def test_cache_keeps_no_entry_heavier_than_an_eighth_of_the_limit(monkeypatch):
    cache.clear()
    monkeypatch.setattr(cache, "LIMIT_BYTES", 80_000)
    with md.MetaMode() as mode:
        parts = [torch.empty(1) for _ in range(400)]
        a = torch.cat(parts)
        b = torch.cat(parts)  # answered again by the rule, and the same answer
    assert a.shape == b.shape == (400,)
    assert all(cache._weight(k) <= 80_000 // 8 for k in cache._SHARED)
    assert not any(k[0] is torch.ops.aten.cat.default for k in cache._SHARED)
    assert mode.cache.misses == 3  # empty, and both cats
