"""The caching-allocator model (offline/allocator/): every expected number below is derived by hand, in the
comments, from the rules of c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size, get_free_block,
should_split, free_block, release_*_blocks, garbage_collect_cached_blocks, expandable segments); then the config
parser, the stream format, snapshot conversion, and hypothesis invariants."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.alloc_conf import UNLIMITED, AllocatorConfig, parse_alloc_conf
from offline.allocator.model import CachingAllocator, OutOfMemory
from offline.allocator.pool import round_size
from offline.allocator.replay import oom_capacity, replay, segments_at
from offline.allocator.stream import Stream, stream_from_snapshot

MiB = 2**20
EXPANDABLE = parse_alloc_conf("expandable_segments:True")


def events(*evs, stage="s"):
    """('a', handle, MiB) / ('f', handle, MiB) -> a Stream (sizes in MiB unless given as int bytes)."""
    out = []
    for kind, h, size in evs:
        out.append(("alloc" if kind == "a" else "free", h, size if isinstance(size, int) and size > 4096
                    else int(size * MiB), stage))
    return Stream.from_events(out)


# ---------------------------------------------------------------- rounding and segment sizes
def test_round_size_512_and_power2_divisions():
    d = AllocatorConfig()
    assert round_size(1, d) == 512                # below kMinBlockSize: 512
    assert round_size(513, d) == 1024             # else up to a multiple of 512
    assert round_size(MiB + 1, d) == MiB + 512
    four = parse_alloc_conf("roundup_power2_divisions:4")
    # 1.2 MiB lies in [1 MiB, 2 MiB): 4 divisions are steps of 256 KiB -> 1.25 MiB
    assert round_size(int(1.2 * MiB), four) == 1310720
    # 1200 B: only rounded by divisions when above 512 * 4 = 2048 B; else to 512 multiples -> 1536
    assert round_size(1200, four) == 1536
    assert round_size(2 * MiB, four) == 2 * MiB   # a power of two stays


def test_small_pool_packs_into_2mib_segments():
    a = CachingAllocator()
    for h in range(3):
        a.malloc(h, 1000)                         # 3 x 1024 B in one 2 MiB small segment
    assert (a.allocated_bytes, a.reserved_bytes) == (3072, 2 * MiB)
    a.malloc(10, MiB)                             # 1 MiB is still small (<= kSmallSize): fits the 2 MiB - 3 KiB left
    assert (a.reserved_bytes, a.device_allocs) == (2 * MiB, 1)
    a.malloc(11, MiB)                             # 1 MiB - 3 KiB left < 1 MiB: a second 2 MiB segment
    assert (a.reserved_bytes, a.device_allocs) == (4 * MiB, 2)


def test_large_segment_sizes():
    a = CachingAllocator()
    a.malloc(1, 2 * MiB)                          # (1 MiB, 10 MiB): a 20 MiB segment (kLargeBuffer), split [2][18]
    assert a.reserved_bytes == 20 * MiB
    a.malloc(2, 11 * MiB + 1)                     # 11 MiB + 512 fits the free 18 MiB: no new segment
    assert (a.reserved_bytes, a.allocated_bytes) == (20 * MiB, 13 * MiB + 512)
    b = CachingAllocator()
    b.malloc(1, 11 * MiB + 1)                     # >= 10 MiB: 11 MiB + 512, segment rounded up to 2 MiB: 12 MiB;
    assert (b.reserved_bytes, b.allocated_bytes) == (12 * MiB, 12 * MiB)   # remainder < 1 MiB: not split
    c = CachingAllocator(parse_alloc_conf("large_segment_size_mb:32"))
    c.malloc(1, 2 * MiB)                          # large_segment_size_mb changes the 1-10 MiB segment
    assert c.reserved_bytes == 32 * MiB


def test_large_pool_remainder_of_1mib_is_not_split():
    a = CachingAllocator()
    a.malloc(1, 19 * MiB)                         # segment 20 MiB (19 MiB rounded up to 2 MiB)
    # remainder 1 MiB is not > kSmallSize: the block stays whole, so memory_allocated counts 20 MiB
    assert (a.allocated_bytes, a.reserved_bytes) == (20 * MiB, 20 * MiB)
    a.malloc(2, 17 * MiB)                         # new 18 MiB segment; remainder 0
    a.free(2)
    a.malloc(3, 15 * MiB)                         # reuses the 18 MiB block: remainder 3 MiB > 1 MiB -> split
    assert a.allocated_bytes == 20 * MiB + 15 * MiB
    assert a.inactive_split_bytes() == 3 * MiB and a.largest_free_bytes() == 3 * MiB


def test_best_fit_smallest_then_lowest_address():
    a = CachingAllocator()
    a.malloc(1, 12 * MiB)                         # segment S1 12 MiB
    a.malloc(2, 16 * MiB)                         # segment S2 16 MiB
    a.malloc(3, 14 * MiB)                         # segment S3 14 MiB
    for h in (1, 2, 3):
        a.free(h)
    a.malloc(4, 13 * MiB)                         # fits 16 and 14: best fit is S3 (14 MiB), remainder 1 MiB kept
    seg = {s.total_size: s for s in a.snapshot()}
    assert seg[14 * MiB].allocated_size == 14 * MiB and seg[16 * MiB].allocated_size == 0
    a.malloc(5, 12 * MiB)                         # exact fit: S1
    assert seg[12 * MiB].address == min(s.address for s in a.snapshot())
    assert a.reserved_bytes == 42 * MiB and a.device_allocs == 3


def test_free_merges_neighbours():
    a = CachingAllocator()
    for h in range(3):
        a.malloc(h, 5 * MiB)                      # one 20 MiB segment: [5][5][5][free 5]
    assert a.reserved_bytes == 20 * MiB and a.inactive_split_bytes() == 5 * MiB
    a.free(1)                                     # [5][free 5][5][free 5]: no free neighbour
    assert a.largest_free_bytes() == 5 * MiB and a.inactive_split_bytes() == 10 * MiB
    a.free(2)                                     # merges both sides: [5][free 15]
    assert a.largest_free_bytes() == 15 * MiB
    a.free(0)                                     # the whole segment is one free block: no longer split
    assert a.largest_free_bytes() == 20 * MiB and a.inactive_split_bytes() == 0
    (seg,) = a.snapshot()
    assert len(seg.blocks) == 1 and seg.blocks[0].state == "inactive"


def test_max_split_size_and_non_split_rounding():
    c = parse_alloc_conf("max_split_size_mb:40")
    a = CachingAllocator(c)
    a.malloc(1, 50 * MiB)                         # 50 MiB segment (>= max_split: oversize)
    a.free(1)
    a.malloc(2, 42 * MiB)                         # oversize request: 50 < 42 + 20 (max_non_split_rounding) -> reuse
    assert (a.allocated_bytes, a.reserved_bytes) == (50 * MiB, 50 * MiB)   # not split: counts the whole 50
    a.free(2)
    a.malloc(3, 20 * MiB)                         # < max_split never gets an oversize block: new 20 MiB segment
    assert a.reserved_bytes == 70 * MiB
    d = CachingAllocator()
    d.malloc(1, 50 * MiB)
    d.free(1)
    d.malloc(3, 20 * MiB)                         # default: the 50 MiB block is split, no new segment
    assert (d.reserved_bytes, d.allocated_bytes) == (50 * MiB, 20 * MiB)
    e = CachingAllocator(c)
    e.malloc(1, 70 * MiB)
    e.free(1)
    e.malloc(2, 48 * MiB)                         # 70 >= 48 + 20: too much waste, new 48 MiB segment
    assert e.reserved_bytes == 118 * MiB


def test_release_available_cached_blocks_frees_one_oversize_block():
    # max_split 40 MiB, capacity 80 MiB: a cached 60 MiB oversize block; a 30 MiB request may not use it and
    # 60 + 30 > 80, so release_available_cached_blocks frees it (lower_bound of max(30, 40)) and the retry fits.
    a = CachingAllocator(parse_alloc_conf("max_split_size_mb:40"), capacity_bytes=80 * MiB)
    a.malloc(1, 60 * MiB)
    a.free(1)
    a.malloc(2, 30 * MiB)
    assert (a.reserved_bytes, a.device_frees, a.alloc_retries) == (30 * MiB, 1, 0)


def test_release_cached_blocks_and_retry_before_oom():
    # capacity 40 MiB: cached 30 MiB segment, request 32 MiB: 30 + 32 > 40 -> free every whole cached segment,
    # retry (num_alloc_retries 1): 0 + 32 <= 40.
    a = CachingAllocator(capacity_bytes=40 * MiB)
    a.malloc(1, 30 * MiB)
    a.free(1)
    a.malloc(2, 32 * MiB)
    assert (a.reserved_bytes, a.alloc_retries, a.device_frees) == (32 * MiB, 1, 1)
    # the same with 30 MiB still live: nothing to release -> OOM, torch's "Tried to allocate 32 MiB"
    b = CachingAllocator(capacity_bytes=40 * MiB)
    b.malloc(1, 30 * MiB)
    with pytest.raises(OutOfMemory) as e:
        b.malloc(2, 32 * MiB)
    assert (e.value.alloc_size, b.alloc_retries, b.num_ooms) == (32 * MiB, 1, 1)


def test_garbage_collection_frees_old_whole_segments_first():
    # threshold 0.5 of 200 MiB (memory fraction 1) = 100 MiB. Large-pool get_free_block calls: A 1, B 2, C 3.
    # free A (age base 3); D 32 MiB misses (call 4): reserved 90 <= 100, no GC; new segment -> 122.
    # free B (base 4); E 34 MiB misses (call 5): 122 > 100, target 22; whole free: A age 2, B age 1, mean 1.5:
    # A is freed (30 >= 22, stop), B stays; E gets a new segment: 122 - 30 + 34 = 126.
    a = CachingAllocator(parse_alloc_conf("garbage_collection_threshold:0.5"), 200 * MiB, memory_fraction=1.0)
    for h in (1, 2, 3):
        a.malloc(h, 30 * MiB)
    a.free(1)
    a.malloc(4, 32 * MiB)
    assert a.reserved_bytes == 122 * MiB
    a.free(2)
    a.malloc(5, 34 * MiB)
    assert (a.reserved_bytes, a.gc_releases) == (126 * MiB, 1)
    assert sorted((s.total_size, s.allocated_size) for s in a.snapshot()) == \
        [(30 * MiB, 0), (30 * MiB, 30 * MiB), (32 * MiB, 32 * MiB), (34 * MiB, 34 * MiB)]
    # torch runs GC only with a memory fraction set: without it the threshold does nothing
    b = CachingAllocator(parse_alloc_conf("garbage_collection_threshold:0.5"), 200 * MiB)
    for h in (1, 2, 3):
        b.malloc(h, 30 * MiB)
    b.free(1)
    b.malloc(4, 32 * MiB)
    b.free(2)
    b.malloc(5, 34 * MiB)
    assert (b.reserved_bytes, b.gc_releases) == (156 * MiB, 0)


FRAGMENTING = events(("a", 1, 60), ("f", 1, 60), ("a", 2, 20), ("a", 3, 50))


def test_expandable_segments_avoid_an_oom_the_default_hits():
    # default, 80 MiB: segment 60; freed; 20 MiB splits it ([20][free 40]); 50 MiB needs a new 50 MiB segment:
    # 60 + 50 > 80 and the split segment cannot be released -> OOM at event 3.
    d = replay(FRAGMENTING, capacity_bytes=80 * MiB)
    assert d.oom is not None and d.oom.event == 3 and d.oom.segment_bytes == 50 * MiB
    # expandable, 20 MiB pages: 60 MiB maps 3 pages; freed; 20 MiB -> [20][free 40]; 50 MiB: the free 40 at the
    # end grows by one page (10 MiB short -> 20 MiB page): reserved 80, allocated 70. No OOM.
    e = replay(FRAGMENTING, EXPANDABLE, capacity_bytes=80 * MiB)
    assert e.oom is None
    assert (e.overall.peak_reserved_bytes, e.overall.peak_allocated_bytes) == (80 * MiB, 70 * MiB)
    assert oom_capacity(FRAGMENTING) == 110 * MiB and oom_capacity(FRAGMENTING, EXPANDABLE) == 80 * MiB


def test_expandable_pages_and_unmap_on_release():
    a = CachingAllocator(EXPANDABLE)
    a.malloc(1, 5 * MiB)                          # one 20 MiB page: [5][free 15]
    a.malloc(2, 30 * MiB)                         # free 15 at the end + one more page: [5][30][free 5] = 40 MiB
    assert (a.reserved_bytes, a.device_allocs) == (40 * MiB, 2)
    a.malloc(3, 100)                              # small pool: its own segment, 2 MiB pages
    assert a.reserved_bytes == 42 * MiB
    a.free(2)                                     # [5][free 35]: page [20, 40) is wholly free
    a.empty_cache()                               # unmaps it; [0, 20) holds live bytes and stays; small page stays
    assert a.reserved_bytes == 22 * MiB
    a.free(1)
    a.free(3)
    a.empty_cache()
    assert (a.reserved_bytes, a.segment_count) == (0, 0)


def test_oom_capacity_below_unlimited_peak_reserved():
    # unlimited: 30 MiB segment cached, then a new 32 MiB one: peak reserved 62 MiB. With 32 MiB the
    # release-and-retry path frees the cached 30 first: 32 MiB fits, 30 MiB (< peak allocated 32) cannot.
    s = events(("a", 1, 30), ("f", 1, 30), ("a", 2, 32))
    assert replay(s).overall.peak_reserved_bytes == 62 * MiB
    assert oom_capacity(s) == 32 * MiB
    assert replay(s, capacity_bytes=32 * MiB).overall.alloc_retries == 1


def test_replay_stages_timeline_and_segments():
    s = Stream.from_events([("alloc", 1, 5 * MiB, "fwd"), ("alloc", 2, 30 * MiB, "fwd"),
                            ("free", 1, 5 * MiB, "bwd"), ("alloc", 3, 12 * MiB, "bwd"),
                            ("free", 2, 30 * MiB, "opt"), ("free", 3, 12 * MiB, "opt")])
    r = replay(s)
    # fwd: 20 MiB segment split [5][15]; 30 MiB segment -> reserved 50, allocated 35, largest free 15
    f = r.stage("fwd")
    assert (f.peak_reserved_bytes, f.allocated_at_peak_bytes, f.largest_free_at_peak_bytes) == \
        (50 * MiB, 35 * MiB, 15 * MiB)
    assert (f.fragmentation_at_peak_bytes, f.inactive_split_at_peak_bytes, f.device_allocs) == (15 * MiB,) * 2 + (2,)
    # bwd: 5 freed (the 20 MiB segment whole again), 12 MiB reuses it split [12][8]: allocated 42, no new segment
    b = r.stage("bwd")
    assert (b.peak_allocated_bytes, b.peak_reserved_bytes, b.device_allocs) == (42 * MiB, 50 * MiB, 0)
    assert r.overall.peak_allocated_bytes == 42 * MiB and r.overall.events == 6
    assert list(r.reserved // MiB) == [20, 50, 50, 50, 50, 50]
    assert list(r.allocated // MiB) == [5, 35, 30, 42, 12, 0]
    t = r.timeline(max_points=3)                  # maxima over events [0,2) [2,4) [4,6)
    assert list(t.event) == [0, 2, 4] and list(t.allocated // MiB) == [35, 42, 12]
    segs = segments_at(s, 2)
    assert [(x.total_size // MiB, x.allocated_size // MiB) for x in segs] == [(20, 5), (30, 30)]


# ---------------------------------------------------------------- config parsing
def test_parse_alloc_conf_good():
    c = parse_alloc_conf(" max_split_size_mb:128 ,roundup_power2_divisions:[256:1,512:2,1024:4,>:8],"
                         "expandable_segments:True,garbage_collection_threshold:0.6,backend:native,"
                         "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,"
                         "pinned_num_register_threads:8")
    assert c.max_split_size_bytes == 128 * MiB and c.expandable_segments and c.garbage_collection_threshold == 0.6
    # intervals from 1 MiB: 256 MiB is index 8; the first entry fills 0..8 with 1; '>' fills after 1024 (index 10)
    assert c.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert parse_alloc_conf("").max_split_size_bytes == UNLIMITED
    assert parse_alloc_conf(None) == AllocatorConfig()
    assert parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    # large_segment_size_mb is read first wherever it stands; the split sizes' minimum follows it
    c = parse_alloc_conf("max_split_size_mb:40,large_segment_size_mb:32")
    assert (c.large_segment_bytes, c.max_non_split_rounding_bytes, c.max_split_size_bytes) == \
        (32 * MiB, 32 * MiB, 40 * MiB)


@pytest.mark.parametrize("text, starts", [
    ("foo:1", "PYTORCH_CUDA_ALLOC_CONF: unrecognized key 'foo'"),
    ("max_split_size_mb:10", "max_split_size_mb: too small, must be >= 20"),
    ("max_split_size_mb:abc", "max_split_size_mb: expected an integer"),
    ("max_split_size_mb", "max_split_size_mb: value missing"),
    ("max_split_size_mb:40:2", "max_split_size_mb: expected ','"),
    ("expandable_segments:true", "expandable_segments: expected True or False"),
    ("garbage_collection_threshold:1.0", "garbage_collection_threshold: expected a number in (0.0, 1.0)"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions:"),
    ("roundup_power2_divisions:[3:2]", "roundup_power2_divisions: interval boundaries must be powers of 2"),
    ("roundup_power2_divisions:[256:3]", "roundup_power2_divisions: divisions must be 0 or a power of 2"),
    ("large_segment_size_mb:10", "large_segment_size_mb: must be > 10"),
    ("backend:cudaMallocAsync", "backend: cudaMallocAsync (the driver's stream-ordered allocator) is not modelled"),
    ("backend:foo", "backend: expected native or cudaMallocAsync"),
    ("pinned_num_register_threads:3", "pinned_num_register_threads: expected a power of 2"),
])
def test_parse_alloc_conf_bad_is_one_line(text, starts):
    with pytest.raises(ValueError) as e:
        parse_alloc_conf(text)
    assert str(e.value).startswith(starts) and "\n" not in str(e.value)


# ---------------------------------------------------------------- stream format
def test_stream_round_trip(tmp_path):
    s = Stream.from_events([("alloc", 1, 100, "fwd"), ("alloc", 2, 5, "fwd"), ("free", 1, 100, "bwd"),
                            ("alloc", 1, 7, "bwd")], meta={"source": "traced", "model": "gpt2"})
    s.save(tmp_path / "s.npz")
    t = Stream.load(tmp_path / "s.npz")
    assert t.stage_names == ("fwd", "bwd") and t.meta == {"source": "traced", "model": "gpt2"}
    for name in ("kind", "handle", "nbytes", "stage"):
        assert np.array_equal(getattr(s, name), getattr(t, name)) and getattr(s, name).dtype == getattr(t, name).dtype


def _npz(path, header=None, **arrays):
    base = {"kind": np.array([0, 1], np.int8), "handle": np.array([1, 1], np.int64),
            "nbytes": np.array([8, 8], np.int64), "stage": np.array([0, 0], np.int16)}
    base.update(arrays)
    base = {k: v for k, v in base.items() if v is not None}
    if header is not False:
        base["header"] = np.array(header if header is not None else json.dumps(
            {"format": "willitfit.allocation-stream/1", "stage_names": ["s"], "meta": {}}))
    np.savez(path, **base)
    return path


@pytest.mark.parametrize("arrays, starts", [
    ({"kind": np.array([0, 2], np.int8)}, "kind: event 1 is not 0 or 1"),
    ({"kind": np.array([1, 0], np.int8)}, "handle: event 0 frees a handle that is not live"),
    ({"kind": np.array([0, 0], np.int8)}, "handle: event 1 allocates a handle that is still live"),
    ({"nbytes": np.array([2**50, 2**50], np.int64)}, "nbytes: event 0 is outside"),
    ({"nbytes": np.array([8, 9], np.int64)}, "nbytes: event 1 frees handle 1 with 9 bytes"),
    ({"stage": np.array([0, 1], np.int16)}, "stage: event 1 is outside 0..0"),
    ({"stage": np.array([0], np.int16)}, "arrays: lengths differ"),
    ({"nbytes": np.array([8.0, 8.0])}, "nbytes: must be a 1-D integer array"),
    ({"nbytes": np.array([object(), 8], dtype=object)}, "stream file:"),
    ({"extra": np.zeros(2)}, "stream file: arrays must be"),
    ({"header": None}, "stream file: arrays must be"),
])
def test_stream_load_rejects_bad_files(tmp_path, arrays, starts):
    p = _npz(tmp_path / "bad.npz", header=False if "header" in arrays else None,
             **{k: v for k, v in arrays.items() if k != "header"})
    with pytest.raises(ValueError) as e:
        Stream.load(p)
    assert str(e.value).startswith(starts) and "\n" not in str(e.value)


def test_stream_load_rejects_bad_header_and_non_npz(tmp_path):
    with pytest.raises(ValueError, match="^header: is not valid JSON"):
        Stream.load(_npz(tmp_path / "h.npz", header="{nope"))
    with pytest.raises(ValueError, match="^header: format must be"):
        Stream.load(_npz(tmp_path / "f.npz", header=json.dumps({"format": "x", "stage_names": ["s"]})))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="^stream file:"):
        Stream.load(tmp_path / "junk.npz")


def test_stream_from_snapshot():
    snap = {"segments": [], "device_traces": [[
        {"action": "free_requested", "addr": 999, "size": 64},    # allocated before recording: dropped
        {"action": "free_completed", "addr": 999, "size": 64},
        {"action": "segment_alloc", "addr": 100, "size": 2 * MiB},
        {"action": "alloc", "addr": 100, "size": 1000},
        {"action": "alloc", "addr": 1124, "size": 300},
        {"action": "free_requested", "addr": 100, "size": 1000},
        {"action": "free_completed", "addr": 100, "size": 1000},
        {"action": "alloc", "addr": 100, "size": 200},          # address reused: a new handle
        {"action": "oom", "size": 5, "device_free": 0},
    ]]}
    s = stream_from_snapshot(snap, meta={"model": "m"})
    assert s.kind.tolist() == [0, 0, 1, 0] and s.handle.tolist() == [0, 1, 0, 2]
    assert s.nbytes.tolist() == [1000, 300, 1000, 200]
    assert s.meta["dropped_frees"] == 1 and s.meta["live_at_end"] == 2 and s.meta["model"] == "m"
    assert replay(s).overall.peak_allocated_bytes == 1024 + 512
    with pytest.raises(ValueError, match="^device: the snapshot has traces for devices"):
        stream_from_snapshot({"device_traces": [[snap["device_traces"][0][3]], [snap["device_traces"][0][3]]]})
    with pytest.raises(ValueError, match="^snapshot: needs 'device_traces'"):
        stream_from_snapshot({"segments": []})


# ---------------------------------------------------------------- invariants
CONFIGS = [AllocatorConfig(), EXPANDABLE, parse_alloc_conf("max_split_size_mb:40"),
           parse_alloc_conf("roundup_power2_divisions:4"),
           parse_alloc_conf("expandable_segments:True,max_split_size_mb:40")]
SIZES = st.one_of(st.integers(0, 4096), st.integers(4096, 2 * MiB), st.integers(2 * MiB, 64 * MiB))


@st.composite
def op_lists(draw):
    """Random alloc/free sequences over a few live handles (free picks a live one)."""
    ops, live, nxt = [], [], 0
    for _ in range(draw(st.integers(1, 80))):
        if live and draw(st.booleans()):
            ops.append(("f", live.pop(draw(st.integers(0, len(live) - 1))), 0))
        else:
            ops.append(("a", nxt, draw(SIZES)))
            live.append(nxt)
            nxt += 1
    return ops


def _slack(block_size: int, rounded: int, config: AllocatorConfig) -> bool:
    """A live block is its rounded request plus what should_split would not cut off: nothing in the small pool
    or with expandable segments (any remainder >= 512 is split, and sizes are 512 multiples), at most 1 MiB in
    the large pool (kSmallSize), less than max_non_split_rounding for an oversize block."""
    extra = block_size - rounded
    if rounded <= MiB or config.expandable_segments:
        return extra == 0
    if rounded >= config.max_split_size_bytes:
        return 0 <= extra < config.max_non_split_rounding_bytes
    return 0 <= extra <= MiB


@settings(max_examples=40, deadline=None)
@given(op_lists(), st.sampled_from(CONFIGS), st.one_of(st.none(), st.integers(0, 160).map(lambda m: m * MiB)))
def test_invariants(ops, config, capacity):
    a = CachingAllocator(config, capacity)
    live = {}
    for kind, h, size in ops:
        if kind == "a":
            try:
                a.malloc(h, size)
            except OutOfMemory:
                continue
            live[h] = size
        elif h in live:
            a.free(h)
            del live[h]
        assert a.reserved_bytes >= a.allocated_bytes
        rounded = sum(round_size(n, config) for n in live.values() if n)
        if config.expandable_segments:
            assert a.allocated_bytes == rounded          # every remainder is split off
        assert a.allocated_bytes >= rounded
        if capacity is not None:
            assert a.reserved_bytes <= capacity
    segs = a.snapshot()
    assert sum(s.total_size for s in segs) == a.reserved_bytes
    assert sum(s.allocated_size for s in segs) == a.allocated_bytes
    for s in segs:
        states = [b.state for b in s.blocks]          # free blocks are always merged with free neighbours
        assert all(not (x == y == "inactive") for x, y in zip(states, states[1:]))
        for b in s.blocks:
            if b.state == "active_allocated":
                assert _slack(b.size, round_size(b.requested, config), config)
    for h in list(live):
        a.free(h)
    a.empty_cache()
    assert (a.allocated_bytes, a.reserved_bytes, a.segment_count) == (0, 0, 0)


@settings(max_examples=15, deadline=None)
@given(op_lists())
def test_oom_capacity_is_a_fitting_capacity(ops):
    evs, live = [], {}
    for kind, h, size in ops:
        if kind == "a":
            live[h] = size
            evs.append(("alloc", h, size, "s"))
        elif h in live:
            evs.append(("free", h, live.pop(h), "s"))
    s = Stream.from_events(evs)
    cap = oom_capacity(s)
    r = replay(s)
    assert replay(s, capacity_bytes=cap).fits
    assert r.overall.peak_allocated_bytes <= cap <= -(-r.overall.peak_reserved_bytes // (2 * MiB)) * 2 * MiB
    if cap >= 2 * MiB:
        assert not replay(s, capacity_bytes=cap - 2 * MiB).fits


def test_module_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, offline.allocator.replay; assert 'torch' not in sys.modules and 'duckdb' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stream_diff_names_the_allocations_one_run_made_and_the_other_did_not(tmp_path, capsys):
    # a measured stream with a 96 MiB workspace in backward the traced one lacks (and 513 B that rounds to 1 KiB)
    import sys as _sys
    _sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import stream_diff

    base = [("alloc", 1, 1000, "forward"), ("alloc", 2, 4096, "backward"), ("free", 2, 4096, "backward"),
            ("free", 1, 1000, "backward")]
    traced = Stream.from_events(base + [("alloc", 9, 513, "optimizer"), ("free", 9, 513, "optimizer")])
    gpu = Stream.from_events(base[:2] + [("alloc", 3, 96 * MiB, "backward"), ("free", 3, 96 * MiB, "backward")]
                             + base[2:] + [("alloc", 9, 1024, "optimizer"), ("free", 9, 1024, "optimizer")])
    # torch's counter: each block rounded to 512 bytes (1000 -> 1024)
    assert stream_diff.stage_peaks(gpu) == {"forward": 1024, "backward": 1024 + 4096 + 96 * MiB, "optimizer": 1024}
    text = stream_diff.report(gpu, traced)
    assert "GPU, not traced: backward" in text and f"{96 * MiB:,} B x 1" in text
    assert "traced, not GPU" not in text and "optimizer" in text   # 513 B and 1024 B are one 1 KiB block
    gpu.save(tmp_path / "g.npz")
    (tmp_path / "t.npz").write_bytes(b"not a stream")
    assert stream_diff.main([str(tmp_path / "g.npz"), str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: stream file:")
