"""A simulation of PyTorch's CUDA caching allocator, driven by a trace's storages.

Requirements: say what ``torch.cuda.max_memory_reserved`` would be -- what an
out-of-memory error is decided by -- not only what is allocated.  The rules
follow ``c10/cuda/CUDACachingAllocator.cpp`` (names in brackets are its):

- every request rounds up to 512 B [kMinBlockSize], or with
  ``roundup_power2_divisions=N`` to the next of N steps between powers of two;
- requests up to 1 MiB [kSmallSize] come from the small pool, whose segments
  are 2 MiB [kSmallBuffer]; larger ones from the large pool, in 20 MiB
  segments [kLargeBuffer] below 10 MiB [kMinLargeAlloc], else the request
  rounded up to 2 MiB [kRoundLarge];
- a request takes the smallest free block of its pool and stream that fits;
  a block at or above ``max_split_size`` serves only requests at or above it,
  and only if less than ``max_non_split_rounding_mb`` larger [get_free_block];
- the rest of a block splits off when at least 512 B (small pool, or
  expandable segments) or more than 1 MiB (large pool, and the request is
  below ``max_split_size``) [should_split]; a freed block merges with free
  neighbours in its segment [try_merge_blocks];
- when the device has no room for a new segment: release cached oversize
  blocks [release_available_cached_blocks], then every unsplit cached
  segment [release_cached_blocks] and retry (counted in ``retries``); only
  then is it out of memory;
- ``expandable_segments``: one segment per pool and stream grows in 2 MiB
  (small) or 20 MiB (large) pages instead of new segments;
- ``garbage_collection_threshold``: when no cached block fits and reserved
  is above that fraction of capacity, cached unsplit segments of the large
  pool are released, least recently freed first (the source's
  age-averaging is simplified to oldest first);
- ``max_non_split_rounding_mb`` (default 20): how much larger than an
  oversize request a cached oversize block may be and still serve it.

Limits: one stream (the trace records none); no CUDA graphs' private pools;
events and ``record_stream`` delays are not modelled; an expandable segment
gives pages back only from its free tail.
"""

from __future__ import annotations

import bisect

from .allocconfig import (
    LARGE_BUFFER,
    MIN_BLOCK,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
    round_size,
    segment_size,
)

__all__ = ["CachingAllocator", "Block", "Segment"]


class Segment:
    __slots__ = ("id", "address", "size", "small", "expandable", "last")

    def __init__(self, id, address, size, small, expandable):
        self.id, self.address, self.size, self.small, self.expandable = id, address, size, small, expandable
        self.last = None  # the block at the segment's end

    @property
    def page(self) -> int:
        return SMALL_BUFFER if self.small else LARGE_BUFFER


class Block:
    __slots__ = ("segment", "offset", "size", "allocated", "prev", "next", "freed_at", "requested")

    def __init__(self, segment, offset, size, prev=None, next=None):
        self.segment, self.offset, self.size = segment, offset, size
        self.prev, self.next = prev, next
        self.allocated, self.freed_at, self.requested = False, 0, 0

    @property
    def address(self) -> int:
        return self.segment.address + self.offset

    @property
    def key(self) -> tuple:
        return (self.size, self.segment.id, self.offset)


class CachingAllocator:
    """The allocator's state: segments, the free blocks of each pool, and its counters.

    ``capacity`` is what cudaMalloc may reserve in all (``None``: unlimited).

    >>> a = CachingAllocator(capacity=None)
    >>> b = a.malloc(1000)  # small pool: a 2 MiB segment, split at 1024
    >>> b.size, a.reserved, a.allocated
    (1024, 2097152, 1024)
    >>> a.free(b); a.reserved, a.allocated  # cached, not returned
    (2097152, 0)
    """

    def __init__(self, capacity: int | None, config: AllocatorConfig = AllocatorConfig()) -> None:
        self.capacity, self.config = capacity, config
        self.segments: dict = {}  # id -> Segment
        self._free: dict = {True: ([], {}), False: ([], {})}  # small? -> (sorted keys, key -> Block)
        self._expandable: dict = {}  # small? -> Segment
        self.reserved = self.allocated = self.retries = self.clock = 0
        self.events: list = []  # (action, address, size) in the memory visualizer's words
        self._next_address = 1 << 32

    # -- the pools' free blocks ------------------------------------------------------------
    def _insert(self, b: Block) -> None:
        keys, blocks = self._free[b.segment.small]
        bisect.insort(keys, b.key)
        blocks[b.key] = b
        b.freed_at = self.clock

    def _remove(self, b: Block) -> None:
        keys, blocks = self._free[b.segment.small]
        del keys[bisect.bisect_left(keys, b.key)]
        del blocks[b.key]

    def _best_fit(self, size: int, small: bool) -> Block | None:
        keys, blocks = self._free[small]
        i = bisect.bisect_left(keys, (size,))
        if i == len(keys):
            return None
        b, limit = blocks[keys[i]], self.config.max_split
        if size < limit <= b.size or (size >= limit and b.size >= size + self.config.max_non_split_rounding):
            return None  # oversize blocks are kept for oversize requests [get_free_block]
        return b

    # -- malloc and free ----------------------------------------------------------------------
    def malloc(self, nbytes: int, force: bool = False) -> Block | None:
        """A block for ``nbytes``, or ``None`` when out of memory (``force``: past capacity)."""
        self.clock += 1
        size = round_size(nbytes, self.config.roundup_power2_divisions)
        small = size <= SMALL_SIZE
        b = self._best_fit(size, small)
        if b is None and self.config.garbage_collection_threshold and self.capacity:
            self._collect(self.config.garbage_collection_threshold * self.capacity)
        if b is None:
            b = self._new_block(size, small)
        if b is None and self._release_oversize(size, small):
            b = self._new_block(size, small)
        if b is None:  # counted as a retry whether or not it then succeeds [alloc_block]
            self._release_cached()
            self.retries += 1
            b = self._new_block(size, small)
        if b is None:
            if not force:
                return None
            self.capacity, cap = None, self.capacity
            b = self._new_block(size, small)
            self.capacity = cap
        assert b is not None  # an unlimited capacity always has room
        return self._take(b, size, nbytes)

    def _take(self, b: Block, size: int, nbytes: int) -> Block:
        self._remove(b)
        rest = b.size - size
        split = (
            rest >= MIN_BLOCK
            if b.segment.small or b.segment.expandable
            else (size < self.config.max_split and rest > SMALL_SIZE)
        )
        if split:
            tail = Block(b.segment, b.offset + size, rest, b, b.next)
            if b.next:
                b.next.prev = tail
            b.next, b.size = tail, size
            if b.segment.last is b:
                b.segment.last = tail
            self._insert(tail)
        b.allocated, b.requested = True, nbytes
        self.allocated += b.size
        self.events.append(("alloc", b.address, b.size))
        return b

    def free(self, b: Block) -> None:
        """Return a block to its pool, merged with free neighbours [free_block]."""
        self.clock += 1
        b.allocated = False
        self.allocated -= b.size
        self.events.append(("free_completed", b.address, b.size))
        for n in (b.prev, b.next):
            if n is not None and not n.allocated:
                self._remove(n)
                if n is b.prev:
                    b.offset, b.prev = n.offset, n.prev
                    if n.prev:
                        n.prev.next = b
                else:
                    b.next = n.next
                    if n.next:
                        n.next.prev = b
                    if b.segment.last is n:
                        b.segment.last = b
                b.size += n.size
        self._insert(b)

    # -- segments -------------------------------------------------------------------------------
    def _room(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _new_block(self, size: int, small: bool) -> Block | None:
        if self.config.expandable_segments:
            return self._grow(size, small)
        nbytes = segment_size(size)
        if not self._room(nbytes):
            return None
        seg = Segment(len(self.segments) and max(self.segments) + 1, self._next_address, nbytes, small, False)
        self._next_address += -(-nbytes // ROUND_LARGE) * ROUND_LARGE
        self.segments[seg.id] = seg
        self.reserved += nbytes
        self.events.append(("segment_alloc", seg.address, nbytes))
        b = seg.last = Block(seg, 0, nbytes)
        self._insert(b)
        return b

    def _grow(self, size: int, small: bool) -> Block | None:
        seg = self._expandable.get(small)
        if seg is None:
            seg = self._expandable[small] = Segment(
                len(self.segments) and max(self.segments) + 1, self._next_address, 0, small, True
            )
            self._next_address += 1 << 40  # the source reserves address space for the whole device
            self.segments[seg.id] = seg
        tail = seg.last
        have = tail.size if tail is not None and not tail.allocated else 0
        grow = -(-(size - have) // seg.page) * seg.page
        if not self._room(grow):
            return None
        self.reserved += grow
        self.events.append(("segment_map", seg.address + seg.size, grow))
        seg.size += grow
        if have:
            self._remove(tail)
            tail.size += grow
        else:
            tail = seg.last = Block(seg, seg.size - grow, grow, prev=tail)
            if tail.prev:
                tail.prev.next = tail
        self._insert(tail)
        return tail

    def _release(self, b: Block) -> int:
        """Give a cached block back to the device if it is a whole segment (or an expandable tail)."""
        seg = b.segment
        if seg.expandable:  # unmap the whole pages of a free tail
            start = -(-b.offset // seg.page) * seg.page
            if b.next is not None or start >= seg.size:
                return 0
            gone = seg.size - start
            self._remove(b)
            if start > b.offset:
                b.size -= gone
                self._insert(b)
            else:
                seg.last = b.prev
                if b.prev:
                    b.prev.next = None
            seg.size = start
            self.events.append(("segment_unmap", seg.address + start, gone))
            self.reserved -= gone
            return gone
        else:
            if b.prev is not None or b.next is not None:
                return 0
            self._remove(b)
            del self.segments[seg.id]
            self.events.append(("segment_free", seg.address, seg.size))
        self.reserved -= b.size
        return b.size

    def _cached(self) -> list:
        return [b for _, blocks in self._free.values() for b in blocks.values()]

    def _release_oversize(self, size: int, small: bool) -> bool:
        limit = self.config.max_split
        if limit == float("inf"):
            return False
        keys, blocks = self._free[small]
        want = max(size, limit)  # the source's search key
        i = bisect.bisect_left(keys, (want,))
        if i < len(keys):
            return self._release(blocks[keys[i]]) > 0
        released = 0
        for key in reversed(keys[:]):  # largest first [release_available_cached_blocks]
            if released >= want or key[0] < limit:
                break
            released += self._release(blocks[key])
        return released >= want

    def _release_cached(self) -> None:
        for b in self._cached():
            self._release(b)

    def _collect(self, threshold: float) -> None:
        """Release cached large-pool segments, oldest first, until reserved is under ``threshold``
        [garbage_collect_cached_blocks: large blocks only, once no cached block fits]."""
        if self.reserved <= threshold:
            return
        for b in sorted(self._free[False][1].values(), key=lambda b: b.freed_at):
            if self.reserved <= threshold:
                break
            self._release(b)
