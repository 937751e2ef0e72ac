"""Replay an allocation stream through the caching-allocator model: per-stage and overall peaks of allocated and
reserved bytes, what the cache looked like at the reserved peak, the segment calls and release-and-retry events,
the first OOM under a capacity, a per-event timeline, and the smallest capacity that runs without OOM.

    from estimator.allocator import replay, oom_capacity, parse_alloc_conf
    r = replay(stream, parse_alloc_conf("expandable_segments:True"), capacity_bytes=80 * 2**30)
    r.overall.peak_reserved_bytes, r.oom, r.timeline(max_points=2000)

What is counted is torch.cuda.memory_allocated / memory_reserved of the modelled allocator
(estimator/allocator/model.py); the CUDA context and non-PyTorch memory come on top.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from estimator.allocator.config import AllocatorConfig
from estimator.allocator.model import CachingAllocator, OutOfMemory, SegmentInfo
from estimator.allocator.stream import Stream

GRANULARITY = 2 << 20           # oom_capacity's step: 2 MiB, the smallest segment / page


@dataclass(frozen=True)
class StageStats:
    """Peaks over one stage's events (and the moment it was entered, as after torch.cuda.reset_peak_memory_stats
    at the stage's start). The *_at_peak fields describe the first event at which reserved reached its peak: the
    moment the allocator last had to grow."""
    name: str
    events: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    allocated_at_peak_bytes: int      # allocated when reserved first reached its peak
    largest_free_at_peak_bytes: int   # largest cached free block then
    fragmentation_at_peak_bytes: int  # reserved - allocated then: cached, not in use
    inactive_split_at_peak_bytes: int # of which in partly used segments (torch's inactive_split_bytes)
    device_allocs: int                # cudaMalloc (expandable: cuMemMap) calls in the stage
    device_frees: int                 # cudaFree (expandable: unmap) calls in the stage
    alloc_retries: int                # times every cached block was released and the allocation retried


@dataclass(frozen=True)
class OOMEvent:
    event: int                  # index of the event that failed
    stage: str
    requested_bytes: int
    rounded_bytes: int
    segment_bytes: int          # the segment torch tried to get ("Tried to allocate ...")
    allocated_bytes: int        # after the release-and-retry path ran
    reserved_bytes: int
    limit_bytes: int


@dataclass(frozen=True)
class Timeline:
    event: np.ndarray           # index of the first event of each point
    allocated: np.ndarray       # bytes (the maximum over the point's events when downsampled)
    reserved: np.ndarray


@dataclass(frozen=True, eq=False)
class ReplayResult:
    overall: StageStats
    stages: tuple[StageStats, ...]
    oom: OOMEvent | None
    allocated: np.ndarray       # int64 per completed event: allocated bytes after it
    reserved: np.ndarray        # int64 per completed event: reserved bytes after it
    config: AllocatorConfig
    capacity_bytes: int | None

    @property
    def fits(self) -> bool:
        return self.oom is None

    def stage(self, name: str) -> StageStats:
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"stage: {name!r} is not one of {', '.join(s.name for s in self.stages)}")

    def timeline(self, max_points: int | None = None) -> Timeline:
        """(allocated, reserved) after every event, or at most `max_points` points, each the maximum over a run
        of consecutive events (so no peak is lost in the downsampling)."""
        n = len(self.allocated)
        if max_points is None or n <= max_points:
            return Timeline(np.arange(n), self.allocated, self.reserved)
        if max_points < 1:
            raise ValueError(f"max_points: must be >= 1, got {max_points}")
        starts = (np.arange(max_points, dtype=np.int64) * n) // max_points
        return Timeline(starts, np.maximum.reduceat(self.allocated, starts),
                        np.maximum.reduceat(self.reserved, starts))


class _Peaks:
    """Running peaks of one stage (or of the whole run)."""
    __slots__ = ("alloc", "res", "at_peak", "da", "df", "rt")

    def __init__(self):
        self.alloc = self.res = self.da = self.df = self.rt = 0
        self.at_peak = (0, 0, 0)

    def stats(self, name: str, events: int) -> StageStats:
        a, largest, split = self.at_peak
        return StageStats(name, events, self.alloc, self.res, a, largest, self.res - a, split,
                          self.da, self.df, self.rt)


def replay(stream: Stream, config: AllocatorConfig = AllocatorConfig(), capacity_bytes: int | None = None,
           memory_fraction: float | None = None, record: bool = True) -> ReplayResult:
    """Run every event of `stream` through a fresh CachingAllocator(config, capacity_bytes, memory_fraction);
    stop at the first OOM. `record=False` skips the per-event timeline (faster; the arrays are then empty)."""
    alloc = CachingAllocator(config, capacity_bytes, memory_fraction)
    n_stages = len(stream.stage_names)
    peaks = [_Peaks() for _ in range(n_stages)]
    total = _Peaks()
    tl_a: list[int] = []
    tl_r: list[int] = []
    oom = None
    done = 0
    try:
        done = _run(stream, alloc, peaks, total, tl_a, tl_r, record)
    except _Stopped as stop:
        done, e = stop.done, stop.oom
        oom = OOMEvent(done, stream.stage_names[int(stream.stage[done])], e.requested, e.size, e.alloc_size,
                       alloc.allocated_bytes, alloc.reserved_bytes, e.limit)
    counts = np.bincount(stream.stage[:done + (oom is not None)].astype(np.int64), minlength=n_stages)
    total.alloc, total.res = alloc.peak_allocated_bytes, alloc.peak_reserved_bytes
    total.da, total.df, total.rt = alloc.device_allocs, alloc.device_frees, alloc.alloc_retries
    return ReplayResult(total.stats("all", int(counts.sum())),
                        tuple(p.stats(name, int(c)) for p, name, c in zip(peaks, stream.stage_names, counts)),
                        oom, np.array(tl_a, np.int64), np.array(tl_r, np.int64), config, capacity_bytes)


class _Stopped(Exception):
    def __init__(self, done: int, oom: OutOfMemory):
        self.done, self.oom = done, oom


def _run(stream: Stream, alloc: CachingAllocator, peaks: list[_Peaks], total: _Peaks,
         tl_a: list[int], tl_r: list[int], record: bool) -> int:
    """The hot loop: one malloc or free per event, peaks checked after each malloc and on entering a stage
    (a free never raises either). Returns the number of events done; raises _Stopped on OOM."""
    malloc, free = alloc.malloc, alloc.free
    app_a, app_r = tl_a.append, tl_r.append
    cs, st, base = -1, None, (0, 0, 0)
    i = 0
    try:
        for k, h, b, s in zip(stream.kind.tolist(), stream.handle.tolist(), stream.nbytes.tolist(),
                              stream.stage.tolist()):
            if s != cs:
                if st is not None:
                    _count(st, base, alloc)
                cs, st, base = s, peaks[s], (alloc.device_allocs, alloc.device_frees, alloc.alloc_retries)
                _at_entry(st, alloc)
            if k:
                free(h)
            else:
                malloc(h, b)
                a = alloc.allocated_bytes
                if a > st.alloc:
                    st.alloc = a
                r = alloc.reserved_bytes
                if r > st.res:
                    st.res = r
                    st.at_peak = at = (a, alloc.largest_free_bytes(), alloc.inactive_split_bytes())
                    if r > total.res:
                        total.res = r
                        total.at_peak = at
            if record:
                app_a(alloc.allocated_bytes)
                app_r(alloc.reserved_bytes)
            i += 1
    except OutOfMemory as e:
        raise _Stopped(i, e) from None
    finally:
        if st is not None:
            _count(st, base, alloc)
    return i


def _count(p: _Peaks, base: tuple[int, int, int], alloc: CachingAllocator) -> None:
    p.da += alloc.device_allocs - base[0]
    p.df += alloc.device_frees - base[1]
    p.rt += alloc.alloc_retries - base[2]


def _at_entry(p: _Peaks, alloc: CachingAllocator) -> None:
    a, r = alloc.allocated_bytes, alloc.reserved_bytes
    if a > p.alloc:
        p.alloc = a
    if r > p.res:
        p.res = r
        p.at_peak = (a, alloc.largest_free_bytes(), alloc.inactive_split_bytes())


def segments_at(stream: Stream, event: int, config: AllocatorConfig = AllocatorConfig(),
                capacity_bytes: int | None = None, memory_fraction: float | None = None) -> list[SegmentInfo]:
    """The segments and their blocks after the first `event` events (for a memory_viz-style segment chart).
    If an OOM comes first, the state just after it."""
    if not 0 <= event <= len(stream):
        raise ValueError(f"event: must be in 0..{len(stream)}, got {event}")
    alloc = CachingAllocator(config, capacity_bytes, memory_fraction)
    try:
        for k, h, b in zip(stream.kind[:event].tolist(), stream.handle[:event].tolist(),
                           stream.nbytes[:event].tolist()):
            if k:
                alloc.free(h)
            else:
                alloc.malloc(h, b)
    except OutOfMemory:
        pass
    return alloc.snapshot()


def oom_capacity(stream: Stream, config: AllocatorConfig = AllocatorConfig(),
                 memory_fraction: float | None = None, granularity: int = GRANULARITY) -> int:
    """The smallest capacity (a multiple of `granularity`, 2 MiB) at which the stream replays without OOM,
    by bisection. It lies between the peak allocated (reserved never drops below allocated) and the unlimited
    run's peak reserved (at that capacity the run is the unlimited one), and can be below the latter because
    the release-and-retry path gives cached blocks back before giving up. Bisection assumes that a capacity
    that fits implies every larger one fits; the allocator need not be monotonic, so the answer is a capacity
    that was replayed without OOM, not a proof that no smaller one would."""
    if granularity <= 0:
        raise ValueError(f"granularity: must be > 0, got {granularity}")
    if len(stream) == 0:
        return 0
    fraction = memory_fraction if memory_fraction is not None else config.per_process_memory_fraction
    base = replay(stream, replace(config, per_process_memory_fraction=1.0), record=False)   # unlimited
    if base.overall.peak_allocated_bytes == 0:
        return 0

    def fits(units: int) -> bool:
        return replay(stream, config, units * granularity, memory_fraction, record=False).fits

    lo = -(-base.overall.peak_allocated_bytes // granularity) - 1      # below peak allocated: cannot fit
    share = fraction if 0.0 < fraction < 1.0 else 1.0
    hi = -(-int(base.overall.peak_reserved_bytes / share) // granularity)
    for _ in range(64):
        if fits(hi):
            break
        lo, hi = hi, hi * 2
    else:
        raise ValueError("oom_capacity: no capacity up to 2**64 times the peak fits; the stream cannot run")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi * granularity

