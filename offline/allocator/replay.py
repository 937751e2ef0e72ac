"""Replay an allocation stream through the caching-allocator model: per-stage and overall peaks of allocated and
reserved bytes, what the cache looked like at the reserved peak, the segment calls and release-and-retry events,
the first OOM under a capacity, a per-event timeline, and the smallest capacity that runs without OOM.

    from offline.allocator import replay, oom_capacity, parse_alloc_conf
    r = replay(stream, parse_alloc_conf("expandable_segments:True"), capacity_bytes=80 * 2**30)
    r.overall.peak_reserved_bytes, r.oom, r.timeline(max_points=2000)

What is counted is torch.cuda.memory_allocated / memory_reserved of the modelled allocator
(offline/allocator/model.py); the CUDA context and non-PyTorch memory come on top.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from estimator.alloc_conf import AllocatorConfig
from offline.allocator.model import CachingAllocator, OutOfMemory, SegmentInfo
from offline.allocator.stream import Stream

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


def replay(stream: Stream, config: AllocatorConfig = AllocatorConfig(), capacity_bytes: int | None = None,
           memory_fraction: float | None = None) -> ReplayResult:
    """Run every event of `stream` through a fresh CachingAllocator(config, capacity_bytes, memory_fraction);
    stop at the first OOM. The hot loop (_run) records only what it must (the block size each malloc took,
    the moments reserved changed, the cache at each stage entry and each reserved increase); the per-event
    timeline and the per-stage peaks are rebuilt from those with NumPy."""
    alloc = CachingAllocator(config, capacity_bytes, memory_fraction)
    run = _run(stream, alloc)
    n = run.done
    kind, stage = stream.kind[:n], stream.stage[:n].astype(np.int64)
    allocated = _allocated_timeline(kind, stream.handle[:n], np.array(run.took, np.int64))
    reserved = np.zeros(n, np.int64)
    if run.changes:
        at, value = np.array(run.changes, np.int64).T
        pos = np.searchsorted(at, np.arange(n), side="right") - 1
        reserved = np.where(pos >= 0, value[np.maximum(pos, 0)], 0)
    stages = _stage_stats(stream, run, alloc, stage, allocated, reserved)
    overall = _overall(run, alloc, int(allocated.max(initial=0)), int(reserved.max(initial=0)), n)
    oom = None
    if run.oom is not None:
        e = run.oom
        oom = OOMEvent(n, stream.stage_names[int(stream.stage[n])], e.requested, e.size, e.alloc_size,
                       alloc.allocated_bytes, alloc.reserved_bytes, e.limit)
    return ReplayResult(overall, stages, oom, allocated, reserved, config, capacity_bytes)


@dataclass
class _Run:
    done: int                   # events completed
    oom: OutOfMemory | None
    took: list[int]             # block bytes per completed malloc, in order
    changes: list[tuple]        # (event, reserved after it) whenever reserved changed
    ups: list[tuple]            # (event, reserved, allocated, largest free, inactive split) when reserved rose
    entries: list[tuple]        # (event, stage, allocated, reserved, largest, split, allocs, frees, retries)


def _run(stream: Stream, alloc: CachingAllocator) -> _Run:
    """The hot loop: one malloc or free per event; reserved is read after each malloc (a free never changes
    it), the cache's state is noted on entering a stage and whenever reserved rises."""
    malloc, free = alloc.malloc, alloc.free
    took: list[int] = []
    changes: list[tuple] = []
    ups: list[tuple] = []
    entries: list[tuple] = []
    app = took.append
    cs, last_r, i, oom = -1, 0, 0, None
    try:
        for k, h, b, s in zip(stream.kind.tolist(), stream.handle.tolist(), stream.nbytes.tolist(),
                              stream.stage.tolist()):
            if s != cs:
                cs = s
                entries.append((i, s, alloc.allocated_bytes, last_r, alloc.largest_free_bytes(),
                                alloc.inactive_split_bytes(), alloc.device_allocs, alloc.device_frees,
                                alloc.alloc_retries))
            if k:
                free(h)
            else:
                app(malloc(h, b))
                r = alloc.reserved_bytes
                if r != last_r:
                    changes.append((i, r))
                    if r > last_r:
                        ups.append((i, r, alloc.allocated_bytes, alloc.largest_free_bytes(),
                                    alloc.inactive_split_bytes()))
                    last_r = r
            i += 1
    except OutOfMemory as e:
        oom = e
    return _Run(i, oom, took, changes, ups, entries)


def _allocated_timeline(kind: np.ndarray, handle: np.ndarray, took: np.ndarray) -> np.ndarray:
    """Allocated bytes after each event: + the block a malloc took, - that block at its free (matched by
    handle: sorted by handle then position, a free follows its alloc)."""
    n = len(kind)
    delta = np.zeros(n, np.int64)
    delta[kind == 0] = took
    order = np.lexsort((np.arange(n), handle))
    d = delta[order]
    frees = np.flatnonzero(kind[order] == 1)
    d[frees] = -d[frees - 1]
    delta[order] = d
    return np.cumsum(delta)


def _stage_stats(stream: Stream, run: _Run, alloc: CachingAllocator, stage: np.ndarray,
                 allocated: np.ndarray, reserved: np.ndarray) -> tuple[StageStats, ...]:
    """Per stage: peaks over its events and its entry values; the cache at the first moment (an entry or a
    reserved increase within it) its reserved peak was reached; segment calls summed over its runs."""
    n_st = len(stream.stage_names)
    peak_a, peak_r = np.zeros(n_st, np.int64), np.zeros(n_st, np.int64)
    np.maximum.at(peak_a, stage, allocated)
    np.maximum.at(peak_r, stage, reserved)
    counters = np.zeros((n_st, 3), np.int64)
    final = (alloc.device_allocs, alloc.device_frees, alloc.alloc_retries)
    for j, e in enumerate(run.entries):
        s = e[1]
        peak_a[s] = max(peak_a[s], e[2])
        peak_r[s] = max(peak_r[s], e[3])
        nxt = run.entries[j + 1][6:9] if j + 1 < len(run.entries) else final
        counters[s] += np.subtract(nxt, e[6:9])
    moments = [(e[0], 0, e[1], e[3], e[2], e[4], e[5]) for e in run.entries]
    moments += [(u[0], 1, int(stage[u[0]]), u[1], u[2], u[3], u[4]) for u in run.ups]
    at_peak: dict[int, tuple] = {}
    for _, _, s, r, a, largest, split in sorted(moments):
        if s not in at_peak and r == peak_r[s]:
            at_peak[s] = (a, largest, split)
    counts = np.bincount(stage, minlength=n_st)
    out = []
    for s, name in enumerate(stream.stage_names):
        a, largest, split = at_peak.get(s, (0, 0, 0))
        r = int(peak_r[s])
        out.append(StageStats(name, int(counts[s]), int(peak_a[s]), r, a, largest, r - a, split,
                              *(int(c) for c in counters[s])))
    return tuple(out)


def _overall(run: _Run, alloc: CachingAllocator, peak_a: int, peak_r: int, n: int) -> StageStats:
    a, largest, split = next(((u[2], u[3], u[4]) for u in run.ups if u[1] == peak_r), (0, 0, 0))
    return StageStats("all", n, peak_a, peak_r, a, largest, peak_r - a, split, alloc.device_allocs,
                      alloc.device_frees, alloc.alloc_retries)


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
    base = replay(stream, replace(config, per_process_memory_fraction=1.0))   # unlimited
    if base.overall.peak_allocated_bytes == 0:
        return 0

    def fits(units: int) -> bool:
        return replay(stream, config, units * granularity, memory_fraction).fits

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

