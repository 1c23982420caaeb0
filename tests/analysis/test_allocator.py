"""The simulated CUDA caching allocator: each rule on hand-computed cases from
c10/cuda/CUDACachingAllocator.cpp, and md.memory(allocator="cuda") on the test models."""

import pickle

import pytest
import torch

import metadispatch as md
from metadispatch.analysis.allocator import CachingAllocator
from metadispatch.analysis.allocconfig import AllocatorConfig, round_size, segment_size
from tests.models import MODELS, train_step

MiB = 2**20


@pytest.mark.parametrize("request_, rounded", [(1, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512)])
def test_allocator_rounds_to_512(request_, rounded):
    assert round_size(request_) == rounded


@pytest.mark.parametrize(
    "request_, rounded",
    [
        (1200, 1536),  # not above 512 * 4: plain 512 rounding
        (5 * MiB + 1, 6 * MiB),  # 4..8 MiB in steps of 1 MiB
        (4 * MiB, 4 * MiB),  # powers of two stay
        (65 * MiB, 80 * MiB),  # 64..128 MiB in steps of 16 MiB
    ],
)
def test_allocator_roundup_power2_divisions(request_, rounded):
    assert round_size(request_, divisions=4) == rounded


@pytest.mark.parametrize(
    "size, segment",
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (11 * MiB + 512, 12 * MiB),
    ],
)
def test_allocator_segment_sizes(size, segment):
    assert segment_size(size) == segment


def test_allocator_small_pool_packs_one_segment():
    a = CachingAllocator(None)
    blocks = [a.malloc(100_000) for _ in range(20)]  # 100352 each; 20 of them in 2 MiB
    assert {b.segment.id for b in blocks} == {0}
    assert a.reserved == 2 * MiB and a.allocated == 20 * 100352
    a.malloc(100_000)  # 21 * 100352 > 2 MiB: a second segment
    assert a.reserved == 4 * MiB


def test_allocator_large_pool_splits_only_above_1mib_remaining():
    a = CachingAllocator(None)
    x = a.malloc(5 * MiB)
    assert (x.size, a.reserved) == (5 * MiB, 20 * MiB)  # 15 MiB split off
    y = a.malloc(9 * MiB)  # best fit: the 15 MiB rest; 6 MiB left is split off
    assert y.segment is x.segment and y.size == 9 * MiB
    z = a.malloc(5 * MiB + 512)  # 6 MiB rest, 1 MiB - 512 would remain: not split
    assert z.segment is x.segment and z.size == 6 * MiB
    assert a.allocated == 20 * MiB and a.reserved == 20 * MiB


def test_allocator_free_merges_neighbours_and_keeps_the_segment():
    a = CachingAllocator(None)
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)
    a.free(x)
    a.free(y)
    assert a.reserved == 20 * MiB and a.allocated == 0
    w = a.malloc(18 * MiB)  # fits only if x, y and the rest merged back into 20 MiB
    assert w.segment is x.segment and w.size == 18 * MiB  # the 2 MiB rest (> 1 MiB) splits off
    assert a.reserved == 20 * MiB


def test_allocator_best_fit_takes_the_smallest_block():
    a = CachingAllocator(None)
    big, small = a.malloc(40 * MiB), a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    assert a.malloc(11 * MiB).segment is small.segment


def test_allocator_max_split_size_keeps_oversize_blocks_whole():
    a = CachingAllocator(None, AllocatorConfig(max_split_size_mb=32))
    big = a.malloc(40 * MiB)
    a.free(big)
    small = a.malloc(12 * MiB)  # may not take the 40 MiB block: a new segment
    assert small.segment is not big.segment and a.reserved == 52 * MiB
    near = a.malloc(39 * MiB)  # oversize request within 20 MiB of the block: reused whole
    assert near.segment is big.segment and near.size == 40 * MiB
    a.free(near)
    assert a.malloc(19 * MiB + 512).segment is not big.segment  # small request, big block: no


def test_allocator_frees_cache_and_retries_before_oom():
    a = CachingAllocator(60 * MiB)
    x = a.malloc(40 * MiB)
    a.free(x)  # cached, reserved 40
    y = a.malloc(50 * MiB)  # no room for 50 more; release the cache, retry
    assert y is not None and a.retries == 1 and a.reserved == 50 * MiB
    assert a.malloc(20 * MiB) is None  # nothing cached to free: out of memory


def test_allocator_max_split_releases_oversize_first_without_a_retry():
    a = CachingAllocator(80 * MiB, AllocatorConfig(max_split_size_mb=24))
    a.free(a.malloc(50 * MiB))
    keep = a.malloc(2 * MiB)  # a 20 MiB segment, split (2 < 24): reserved 70
    b = a.malloc(25 * MiB)  # 50 >= 26 + 20: not reused; no room; the 50 MiB block is released
    assert b is not None and b.size == 26 * MiB and a.reserved == 46 * MiB
    assert a.retries == 0 and keep.allocated


def test_allocator_retry_is_counted_even_when_it_fails():
    a = CachingAllocator(30 * MiB)
    a.malloc(20 * MiB)
    assert a.malloc(20 * MiB) is None and a.retries == 1


def test_allocator_expandable_segments_grow_one_segment():
    a = CachingAllocator(None, AllocatorConfig(expandable_segments=True))
    x = a.malloc(5 * MiB)
    assert a.reserved == 20 * MiB  # one 20 MiB page
    y = a.malloc(30 * MiB)  # 15 MiB free tail + one more 20 MiB page
    assert y.segment is x.segment and a.reserved == 40 * MiB and len(a.segments) == 1
    a.free(y)
    a.free(x)
    assert a.malloc(39 * MiB).segment is x.segment and a.reserved == 40 * MiB


def test_allocator_expandable_segments_unmap_free_tail_on_oom():
    a = CachingAllocator(60 * MiB, AllocatorConfig(expandable_segments=True))
    x = a.malloc(10 * MiB)
    a.free(a.malloc(30 * MiB))
    assert a.reserved == 40 * MiB
    small = a.malloc(100)  # the small pool: its own 2 MiB page
    assert small.segment is not x.segment and a.reserved == 42 * MiB


def test_allocator_garbage_collection_threshold_releases_old_cache():
    a = CachingAllocator(100 * MiB, AllocatorConfig(garbage_collection_threshold=0.5))
    a.free(a.malloc(40 * MiB))
    a.free(a.malloc(30 * MiB))  # reuses the cached 40 MiB segment (40 < 30 + 20)
    assert a.reserved == 40 * MiB
    a.malloc(44 * MiB)  # reserved 40 <= 50 before it: nothing collected; a new segment
    assert a.reserved == 84 * MiB
    a.malloc(MiB)  # 84 > 50: the cached 40 MiB segment goes first, then a 2 MiB small segment
    assert a.reserved == 46 * MiB


def test_allocator_small_pool_splits_down_to_512_bytes():
    a = CachingAllocator(None)
    x = a.malloc(MiB)  # the small pool's largest request: a 2 MiB segment, 1 MiB split off
    y = a.malloc(MiB - 512)  # takes the 1 MiB rest; 512 B remain, enough to split [should_split]
    z = a.malloc(1)  # rounds to 512 and takes exactly that rest
    assert x.segment is y.segment is z.segment and (x.size, y.size, z.size) == (MiB, MiB - 512, 512)
    assert a.reserved == a.allocated == 2 * MiB


def test_allocator_large_pool_keeps_a_rest_of_1mib_unsplit():
    a = CachingAllocator(None)
    whole = a.malloc(19 * MiB)  # >= 10 MiB: a segment of 20 MiB (2 MiB rounding); rest 1 MiB, not > 1 MiB
    assert (whole.size, a.allocated, a.reserved) == (20 * MiB, 20 * MiB, 20 * MiB)
    split = a.malloc(18 * MiB + 1)  # 18 MiB + 512 in a new 20 MiB segment; rest 2 MiB - 512 > 1 MiB
    assert (split.size, a.allocated, a.reserved) == (18 * MiB + 512, 38 * MiB + 512, 40 * MiB)


def test_allocator_expandable_segments_split_large_blocks_down_to_512_bytes():
    a = CachingAllocator(None, AllocatorConfig(expandable_segments=True))
    b = a.malloc(19 * MiB)  # one 20 MiB page; the 1 MiB rest splits off (expandable: >= 512 B)
    assert (b.size, a.allocated, a.reserved) == (19 * MiB, 19 * MiB, 20 * MiB)


def test_allocator_releases_several_oversize_blocks_largest_first():
    a = CachingAllocator(150 * MiB, AllocatorConfig(max_split_size_mb=40))
    x, y = a.malloc(42 * MiB), a.malloc(44 * MiB)
    a.free(x)
    a.free(y)
    hold = a.malloc(30 * MiB)  # below max_split: the cached oversize blocks may not serve it
    assert hold.segment not in (x.segment, y.segment) and a.reserved == 116 * MiB
    big = a.malloc(60 * MiB)  # no room for 60 more; no single cached block >= 60: release 44, then 42
    assert big is not None and a.reserved == 90 * MiB and a.retries == 0
    assert len(a.segments) == 2


def test_allocator_garbage_collection_waits_until_no_cached_block_fits():
    a = CachingAllocator(100 * MiB, AllocatorConfig(garbage_collection_threshold=0.5))
    a.free(a.malloc(60 * MiB))  # reserved 60, above the threshold of 50
    a.malloc(50 * MiB)  # the cached block fits: taken (10 MiB split off), nothing collected
    assert a.reserved == 60 * MiB
    a.malloc(30 * MiB)  # no cached block fits: collect -- but the only cached block is part of a split segment
    assert a.reserved == 90 * MiB


def test_allocator_garbage_collection_leaves_the_small_pool():
    a = CachingAllocator(100 * MiB, AllocatorConfig(garbage_collection_threshold=0.5))
    a.free(a.malloc(1000))  # a cached 2 MiB small segment
    a.malloc(60 * MiB)
    a.malloc(20 * MiB)  # reserved 62 > 50, nothing fits: collected, but only large blocks are
    assert a.reserved == 82 * MiB and sum(s.small for s in a.segments.values()) == 1


@pytest.mark.parametrize(
    "conf, message",
    [
        (dict(max_split_size_mb=20), "more than 20"),
        (dict(roundup_power2_divisions=3), "power of 2"),
        (dict(garbage_collection_threshold=1.0), "fraction"),
    ],
)
def test_allocator_config_refuses_what_torch_refuses(conf, message):
    with pytest.raises(ValueError, match=message):
        AllocatorConfig(**conf)


def test_allocator_max_non_split_rounding_widens_oversize_reuse():
    conf = AllocatorConfig(max_split_size_mb=32, max_non_split_rounding_mb=40)
    a = CachingAllocator(None, conf)
    a.free(a.malloc(80 * MiB))
    assert a.malloc(45 * MiB).size == 80 * MiB  # 80 < 46 + 40: reused whole (the default 20 would not)
    assert a.reserved == 80 * MiB


def test_allocator_config_parses_the_environment_form():
    c = AllocatorConfig.parse("max_split_size_mb:64,roundup_power2_divisions:8,garbage_collection_threshold:0.6")
    assert (c.max_split_size_mb, c.roundup_power2_divisions, c.garbage_collection_threshold) == (64, 8, 0.6)
    with pytest.raises(ValueError, match="backend"):
        AllocatorConfig.parse("backend:cudaMallocAsync")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_memory_allocated_peak_equals_md_memory(name):
    model, inputs = MODELS[name]()
    t = md.tracer(device="cuda")(train_step, model, *inputs)
    r = md.memory(t, allocator="cuda", gpu="h100")
    assert r.peak == md.memory(t).peak
    assert r.timeline == md.memory(t).timeline
    assert r.reserved_peak >= r.allocated_peak >= r.peak
    assert r.fits and r.reserved_peak % (2 * MiB) == 0


def test_cuda_memory_small_capacity_names_the_first_oom_call():
    def step(x):
        y = x * 2  # 16 MiB each
        z = y + 1
        w = z * y
        del y, z  # cached by the allocator, not returned
        return w.sum()

    t = md.tracer(device="cuda")(step, torch.ones(4 * MiB))
    full = md.memory(t, allocator="cuda")
    # x, y, z, w: four 16 MiB segments; the sum's 4 bytes: a 2 MiB small segment
    assert full.reserved_peak == 4 * 16 * MiB + 2 * MiB and full.reserved_peak_call == 3
    tight = md.memory(t, allocator="cuda", capacity=65 * MiB)  # y and z's cache freed, then retried
    assert tight.fits and tight.retries == 1 and tight.reserved_peak == 64 * MiB
    r = md.memory(t, allocator="cuda", capacity=63 * MiB)
    assert not r.fits and r.first_oom_call == 2  # w: nothing cached to give back
    assert md.memory(t, allocator="cuda", capacity=MiB).first_oom_call == -1  # x itself


def test_cuda_memory_snapshot_opens_in_torch_memory_viz():
    from torch.cuda import _memory_viz

    model, inputs = MODELS["mlp"]()
    r = md.memory(md.tracer(device="cuda")(train_step, model, *inputs), allocator="cuda")
    snap = pickle.loads(pickle.dumps(r.snapshot()))
    assert "<html" in _memory_viz.trace_plot(snap).lower()
    assert "<html" in _memory_viz.segment_plot(snap).lower()
    assert sum(s["total_size"] for s in snap["segments"]) == r.allocator.reserved
    assert _memory_viz.segsum(snap)


def test_cuda_memory_llama_7b_simulation_keeps_the_plain_peak():
    from metadispatch.cli.targets import default_target

    target = default_target("cuda", True, 1, 2048)
    t = md.tracer(device="cuda")(target.step, target.model, *target.inputs)
    m = md.memory(t)
    r = md.memory(t, allocator="cuda", gpu="h100")
    assert r.peak == m.peak and r.reserved_peak > r.peak


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_memory_reserved_matches_real_allocator(name):
    import copy

    model, inputs = MODELS[name]()
    r = md.memory(md.tracer(device="cuda")(train_step, model, *inputs), allocator="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = copy.deepcopy(model).cuda()
    train_step(model, *(x.cuda() for x in inputs))
    torch.cuda.synchronize()
    assert r.reserved_peak == pytest.approx(torch.cuda.max_memory_reserved(), abs=64 * MiB, rel=0.02)
