"""The caching allocator's sizes and its ``PYTORCH_CUDA_ALLOC_CONF`` options.

The constants and the two sizing functions of ``c10/cuda/CUDACachingAllocator.cpp``
(names in brackets are the source's); ``allocator.py`` uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AllocatorConfig",
    "round_size",
    "segment_size",
    "MIN_BLOCK",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "LARGE_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the simulation honours.

    >>> AllocatorConfig.parse("expandable_segments:True,max_split_size_mb:128")
    AllocatorConfig(expandable_segments=True, max_split_size_mb=128, roundup_power2_divisions=0, \
garbage_collection_threshold=0.0, max_non_split_rounding_mb=20)
    """

    expandable_segments: bool = False
    max_split_size_mb: int | None = None
    roundup_power2_divisions: int = 0
    garbage_collection_threshold: float = 0.0
    max_non_split_rounding_mb: int = 20

    def __post_init__(self) -> None:
        # the source's own checks [parseMaxSplitSize, parseRoundUpPower2Divisions,
        # parseGarbageCollectionThreshold]: torch refuses these values at start-up
        m, d, g = self.max_split_size_mb, self.roundup_power2_divisions, self.garbage_collection_threshold
        if m is not None and m <= LARGE_BUFFER >> 20:
            raise ValueError(f"max_split_size_mb={m}: torch requires more than {LARGE_BUFFER >> 20}")
        if d < 0 or d & (d - 1):
            raise ValueError(f"roundup_power2_divisions={d}: torch requires a power of 2")
        if not 0.0 <= g < 1.0:
            raise ValueError(f"garbage_collection_threshold={g}: torch requires a fraction in (0, 1)")

    @classmethod
    def parse(cls, conf: str) -> AllocatorConfig:
        """From the environment variable's ``key:value,key:value`` form."""
        kw: dict = {}
        for item in filter(None, conf.split(",")):
            key, _, value = item.partition(":")
            if key == "expandable_segments":
                kw[key] = value.strip().lower() == "true"
            elif key in ("max_split_size_mb", "roundup_power2_divisions", "max_non_split_rounding_mb"):
                kw[key] = int(value)
            elif key == "garbage_collection_threshold":
                kw[key] = float(value)
            else:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF option {key!r} is not simulated")
        return cls(**kw)

    @property
    def max_non_split_rounding(self) -> int:
        return self.max_non_split_rounding_mb << 20

    @property
    def max_split(self) -> float:
        return float("inf") if self.max_split_size_mb is None else self.max_split_size_mb << 20


def round_size(size: int, divisions: int = 0) -> int:
    """A request's size in the allocator [round_size]."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor // divisions
        if step == 0:
            return floor << 1
        down = size & ~(step - 1)
        return size if down == size else down + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The cudaMalloc a rounded request causes when nothing cached fits [get_allocation_size]."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE
