"""CachingAllocator: the native CUDA caching allocator of PyTorch, modelled in pure Python on one device and
one stream.

Follows c10/cuda/CUDACachingAllocator.cpp at pytorch commit 001074d25084fdb87a799823e395a50f5ec044d3 (the stored
snapshot read for this model; functions named after torch's, as `DeviceCachingAllocator::<name>`), with the
2.13 changes listed in docs/allocator.md (large_segment_size, max_non_split_rounding_size):
- malloc: round_size -> pool by size -> get_free_block (best fit) -> on a miss: garbage_collect_cached_blocks
  (only with a memory fraction set), alloc_block, release_available_cached_blocks + alloc_block,
  release_cached_blocks + alloc_block (counted in num_alloc_retries), else OutOfMemoryError;
  then alloc_found_block splits when should_split.
- free -> free_block: merge with free neighbours (try_merge_blocks), back into the pool. Nothing is returned to
  the device until a release (OOM path, GC, empty_cache).
- expandable_segments (offline/allocator/expandable.py): map_block / unmap_block on one growing segment.

What it counts is what torch.cuda.memory_stats counts: allocated = sum of the rounded sizes of live blocks
(memory_allocated), reserved = sum of mapped segment bytes (memory_reserved). It models the caching allocator
only: the CUDA context, cuBLAS workspaces and anything cudaMalloc'd outside it are not in `reserved`.
Not modelled: several streams (record_stream, cross-stream events), CUDA graph private pools, IPC, the
cudaMallocAsync backend, free-memory callbacks.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from estimator.alloc_conf import UNLIMITED, AllocatorConfig
from offline.allocator.expandable import ExpandableMixin
from offline.allocator.pool import (ADDR_BITS, K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, K_SMALL_SIZE, Block, Pool,
                                      allocation_size, round_size)

VA_BASE = 1 << 40                 # first model address (any page-aligned value works)


class OutOfMemory(Exception):
    """torch.OutOfMemoryError: no cached block fits and no new segment can be had, even after releasing every
    cached block. Carries the numbers torch's message shows."""

    def __init__(self, requested: int, size: int, alloc_size: int, allocated: int, reserved: int, limit: int):
        self.requested, self.size, self.alloc_size = requested, size, alloc_size
        self.allocated, self.reserved, self.limit = allocated, reserved, limit
        super().__init__(f"out of memory: tried to allocate {alloc_size} bytes (request {requested}, rounded "
                         f"{size}); {allocated} bytes allocated, {reserved} reserved, limit {limit}")


@dataclass(frozen=True)
class BlockInfo:
    address: int
    size: int
    requested: int          # bytes asked for; 0 for a free block
    state: str              # "active_allocated" or "inactive", as torch.cuda.memory._snapshot() says


@dataclass(frozen=True)
class SegmentInfo:
    """One segment as torch.cuda.memory._snapshot() lists it (one per contiguous mapped range of an
    expandable segment)."""
    address: int
    total_size: int
    allocated_size: int
    segment_type: str       # "small" or "large"
    expandable: bool
    blocks: tuple[BlockInfo, ...]


class CachingAllocator(ExpandableMixin):
    """The allocator of one device. `capacity_bytes` is the memory the allocator may reserve (the card's memory
    less the CUDA context and other non-allocator use); None = unlimited. `memory_fraction` is
    torch.cuda.set_per_process_memory_fraction (or the config's per_process_memory_fraction < 1): it caps
    reservations at fraction * capacity and is what turns garbage_collection_threshold on, as in torch."""
    __slots__ = ("config", "capacity_bytes", "_capacity", "set_fraction", "allowed_bytes", "_gc_on", "_expandable",
                 "_max_split", "_plain_rounding", "_small", "_large", "_live", "_next_addr", "_segments",
                 "_free_unsplit", "_expandable_segments", "allocated_bytes", "reserved_bytes",
                 "peak_allocated_bytes", "peak_reserved_bytes", "requested_bytes", "device_allocs", "device_frees",
                 "alloc_retries", "num_ooms", "gc_releases")

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), capacity_bytes: int | None = None,
                 memory_fraction: float | None = None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0 or None, got {capacity_bytes}")
        if memory_fraction is None and config.per_process_memory_fraction < 1.0:
            memory_fraction = config.per_process_memory_fraction
        if memory_fraction is not None:
            if not 0.0 <= memory_fraction <= 1.0:
                raise ValueError(f"memory_fraction: must be in [0.0, 1.0], got {memory_fraction}")
            if capacity_bytes is None:
                raise ValueError("memory_fraction: needs capacity_bytes (the fraction is of the device's memory)")
        self.config = config
        self.capacity_bytes = capacity_bytes
        self._capacity = UNLIMITED if capacity_bytes is None else capacity_bytes
        self.set_fraction = memory_fraction is not None
        self.allowed_bytes = int(memory_fraction * capacity_bytes) if self.set_fraction else self._capacity
        self._gc_on = self.set_fraction and config.garbage_collection_threshold > 0.0
        self._expandable = config.expandable_segments
        self._max_split = config.max_split_size_bytes
        self._plain_rounding = not any(d > 1 for d in config.roundup_power2_divisions)
        self._small = Pool(small=True)
        self._large = Pool(small=False)
        self._live: dict[int, Block | None] = {}
        self._next_addr = VA_BASE
        self._segments: dict[int, Block] = {}        # cudaMalloc segments: base address -> first block at malloc
        self._expandable_segments: list = []         # ExpandableSegment objects (offline/allocator/expandable.py)
        self._free_unsplit = 0                       # free bytes in whole free cudaMalloc segments
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.requested_bytes = 0
        self.device_allocs = 0          # num_device_alloc: cudaMalloc calls (cuMemMap calls when expandable)
        self.device_frees = 0           # num_device_free
        self.alloc_retries = 0          # num_alloc_retries: times the release-everything-and-retry path ran
        self.num_ooms = 0
        self.gc_releases = 0            # segments freed by garbage_collect_cached_blocks

    # ---------------------------------------------------------------- malloc / free
    def malloc(self, handle: int, nbytes: int) -> int:
        """DeviceCachingAllocator::malloc for a request of `nbytes` (before rounding), live under `handle`;
        returns the block size it took (what memory_allocated grows by). A zero-byte request never reaches
        torch's malloc (allocate(0) returns a null pointer): it takes nothing. The pool updates are written out
        inline (no Pool method calls): this is the replay's hot path."""
        live = self._live
        if handle in live:
            raise ValueError(f"handle: {handle} is already live; free it before reusing it")
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
            live[handle] = None
            return 0
        if self._plain_rounding:
            size = 512 if nbytes < 512 else (nbytes + 511) >> 9 << 9
        else:
            size = round_size(nbytes, self.config)
        small = size <= K_SMALL_SIZE
        pool = self._small if small else self._large
        keys = pool.keys
        if self._gc_on:
            pool.calls += 1
        i = bisect_left(keys, size << ADDR_BITS)
        block = None
        if i < len(keys):
            k = keys[i]
            block = pool.blocks[k]
            if block.seg is None and k >> ADDR_BITS < self._max_split:     # get_free_block, the common case
                del keys[i]
                del pool.blocks[k]
                if block.prev is None and block.next is None:
                    self._free_unsplit -= block.size
            else:
                block = self._get_free_block(pool, size, i)
        if block is None:
            block = self._new_block(pool, size, nbytes)
        remaining = block.size - size
        if (remaining >= K_MIN_BLOCK_SIZE if small or self._expandable
                else size < self._max_split and remaining > K_SMALL_SIZE):     # should_split
            rest = Block(block.addr + size, remaining, small, block.seg)
            n = block.next
            rest.prev = block
            rest.next = n
            if n is not None:
                n.prev = rest
            block.next = rest
            block.size = size
            k = remaining << ADDR_BITS | rest.addr
            insort(keys, k)
            pool.blocks[k] = rest
            rest.gc_base = pool.calls
        block.allocated = True
        block.requested = nbytes
        live[handle] = block
        self.requested_bytes += nbytes
        size = block.size
        a = self.allocated_bytes = self.allocated_bytes + size
        if a > self.peak_allocated_bytes:
            self.peak_allocated_bytes = a
        return size

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free -> free_block: merge with free neighbours, return to the pool (inline
        pool updates, as in malloc)."""
        try:
            b = self._live.pop(handle)
        except KeyError:
            raise ValueError(f"handle: {handle} is not live") from None
        if b is None:
            return
        self.allocated_bytes -= b.size
        self.requested_bytes -= b.requested
        b.allocated = False
        b.requested = 0
        pool = self._small if b.small else self._large
        keys, blocks = pool.keys, pool.blocks
        p = b.prev
        if p is not None and not p.allocated and p.mapped:
            k = p.size << ADDR_BITS | p.addr
            del keys[bisect_left(keys, k)]
            del blocks[k]
            b.addr = p.addr
            b.size += p.size
            b.prev = p = p.prev
            if p is not None:
                p.next = b
        n = b.next
        if n is not None and not n.allocated and n.mapped:
            k = n.size << ADDR_BITS | n.addr
            del keys[bisect_left(keys, k)]
            del blocks[k]
            b.size += n.size
            b.next = n = n.next
            if n is not None:
                n.prev = b
        k = b.size << ADDR_BITS | b.addr
        insort(keys, k)
        blocks[k] = b
        b.gc_base = pool.calls
        if b.prev is None and b.next is None and b.seg is None:
            self._free_unsplit += b.size

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache: release_cached_blocks."""
        self._release_cached_blocks()

    # ---------------------------------------------------------------- finding a block
    def _get_free_block(self, pool: Pool, size: int, i: int) -> Block | None:
        """get_free_block past its common case (malloc has bisected to index i, the smallest block that fits,
        lowest address among equals): expandable blocks, and oversize blocks -- a request below max_split_size
        never gets one, an oversize request only one less than max_non_split_rounding_size larger."""
        keys = pool.keys
        b = pool.blocks[keys[i]]
        if b.seg is not None:
            i = self._expandable_best_fit(pool, i)
            if i < 0:
                return None
            b = pool.blocks[keys[i]]
        if b.size >= self._max_split:
            if size < self._max_split or b.size >= size + self.config.max_non_split_rounding_bytes:
                return None
        del pool.blocks[keys[i]]
        del keys[i]
        if b.prev is None and b.next is None and b.seg is None:
            self._free_unsplit -= b.size
        return b

    def _new_block(self, pool: Pool, size: int, nbytes: int) -> Block:
        """The miss path of malloc: GC, new segment, release oversize blocks and retry, release everything and
        retry; OutOfMemory when all fail."""
        alloc_size = allocation_size(size, self.config.large_segment_bytes)
        if self._gc_on:
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, size, alloc_size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self._release_cached_blocks()
            self.alloc_retries += 1
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self.num_ooms += 1
            raise OutOfMemory(nbytes, size, alloc_size, self.allocated_bytes, self.reserved_bytes,
                              min(self._capacity, self.allowed_bytes))
        return block

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int) -> Block | None:
        """alloc_block: a new cudaMalloc segment of alloc_size (or, expandable, map pages for `size`); None
        where it would pass the memory fraction's allowance or the device's capacity."""
        if self.set_fraction and self.reserved_bytes + alloc_size > self.allowed_bytes:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        if self.reserved_bytes + alloc_size > self._capacity:
            return None
        addr = self._next_addr
        self._next_addr += -(-alloc_size // K_SMALL_BUFFER) * K_SMALL_BUFFER
        block = Block(addr, alloc_size, pool.small)
        self._segments[addr] = block
        self.device_allocs += 1
        r = self.reserved_bytes = self.reserved_bytes + alloc_size
        if r > self.peak_reserved_bytes:
            self.peak_reserved_bytes = r
        return block

    # ---------------------------------------------------------------- giving memory back
    def _release_block(self, pool: Pool, b: Block) -> None:
        """release_block: cudaFree a whole free cudaMalloc segment."""
        pool.remove(b)
        del self._segments[b.addr]
        self._free_unsplit -= b.size
        self.reserved_bytes -= b.size
        self.device_frees += 1

    def _release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
        """release_available_cached_blocks (only with max_split_size set): free the smallest oversize cached
        block that covers the request, or else oversize blocks from the largest down until they cover it.
        Blocks that are split or in an expandable segment are skipped (torch never has them here)."""
        ms = self._max_split
        if ms == UNLIMITED:
            return False
        want = max(size, ms)
        keys = pool.keys
        i = bisect_left(keys, want << ADDR_BITS)
        if i < len(keys):
            b = pool.blocks[keys[i]]
            if b.prev is not None or b.next is not None or b.seg is not None:
                return False
            self._release_block(pool, b)
            return True
        released, j = 0, len(keys) - 1
        while released < want and j >= 0 and keys[j] >> ADDR_BITS >= ms:
            b = pool.blocks[keys[j]]
            j -= 1
            if b.prev is None and b.next is None and b.seg is None:
                released += b.size
                self._release_block(pool, b)
        return released >= want

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks -> release_blocks on the large then the small pool: cudaFree every whole free
        segment; in expandable segments unmap every free page (and drop a segment left with nothing mapped)."""
        for pool in (self._large, self._small):
            to_unmap = []
            for b in pool.free_blocks():
                if b.seg is not None:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(pool, b)
            for b in to_unmap:
                self._unmap_block(pool, b)
                if b.prev is None and b.next is None and not b.mapped:
                    self._release_expandable_segment(pool, b)

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks: once reserved passes garbage_collection_threshold * allowed, free whole
        cached large segments whose age (get_free_block calls on the pool since they were cached) is at least
        the mean age, repeating until the excess is reclaimed or nothing more can be freed."""
        pool = self._large
        threshold = int(self.config.garbage_collection_threshold * self.allowed_bytes)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        whole = [b for b in pool.free_blocks() if b.prev is None and b.next is None and b.seg is None]
        if not whole:
            return
        total_age = sum(pool.calls - b.gc_base for b in whole)
        count, reclaimed, freed = len(whole), 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in pool.free_blocks():
                if b.prev is None and b.next is None and b.seg is None and pool.calls - b.gc_base >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= pool.calls - b.gc_base
                    count -= 1
                    self._release_block(pool, b)
                    self.gc_releases += 1

    # ---------------------------------------------------------------- what it looks like
    def largest_free_bytes(self) -> int:
        """The largest cached free block (torch.cuda.memory cache_info's `largest`, over both pools)."""
        a, b = self._small.largest_free(), self._large.largest_free()
        return a if a > b else b

    def inactive_split_bytes(self) -> int:
        """stats inactive_split_bytes: free bytes in segments that are partly in use (expandable segments are
        excluded, as torch excludes them)."""
        if self._expandable:
            return 0
        return self.reserved_bytes - self.allocated_bytes - self._free_unsplit

    @property
    def segment_count(self) -> int:
        return len(self._segments) + self.expandable_segment_count()

    def live_handles(self) -> int:
        return len(self._live)

    def snapshot(self) -> list[SegmentInfo]:
        """The segments and their blocks, ordered by address, as DeviceCachingAllocator::snapshot lists them:
        a segment starts at a block with no mapped predecessor and runs while blocks are mapped."""
        blocks = [b for pool in (self._small, self._large) for b in pool.free_blocks()]
        blocks += [b for b in self._live.values() if b is not None]
        out = []
        for head in sorted(blocks, key=lambda b: b.addr):
            if head.prev is not None and head.prev.mapped:
                continue
            infos, b = [], head
            while b is not None and b.mapped:
                infos.append(BlockInfo(b.addr, b.size, b.requested,
                                       "active_allocated" if b.allocated else "inactive"))
                b = b.next
            out.append(SegmentInfo(head.addr, sum(i.size for i in infos),
                                   sum(i.size for i in infos if i.state == "active_allocated"),
                                   "small" if head.small else "large", head.seg is not None, tuple(infos)))
        return out
