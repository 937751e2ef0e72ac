"""Blocks, pools and the size rules of the CUDA caching allocator.

Source: c10/cuda/CUDACachingAllocator.cpp at pytorch commit 001074d25084fdb87a799823e395a50f5ec044d3 (the stored
snapshot read for this model; see docs/allocator.md for what changed up to 2.13) -- `struct Block`, `struct
BlockPool` (free blocks ordered by BlockComparatorSize: stream, size, address), `round_size`,
`roundup_power2_next_division`, `get_allocation_size`, `should_split` -- and c10/core/AllocatorConfig.h of the
installed torch 2.13.0 wheel, lines 16-25, for the constants.

A pool keeps its free blocks as one sorted list of integer keys `size << ADDR_BITS | address` (best fit is a
bisect: the smallest size that fits, then the lowest address, as BlockComparatorSize orders them) and a dict from
key to Block. Single CUDA stream: the stream part of torch's ordering is constant and left out.
"""
from __future__ import annotations

from bisect import bisect_left, insort

from estimator.alloc_conf import AllocatorConfig

K_MIN_BLOCK_SIZE = 512          # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20          # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20        # "small" allocations are packed in 2 MiB segments (and expandable pages)
K_MIN_LARGE_ALLOC = 10 << 20    # requests in (1 MiB, 10 MiB) get a large_segment_size (20 MiB) segment
K_ROUND_LARGE = 2 << 20         # larger requests get a segment rounded up to 2 MiB

ADDR_BITS = 56                  # model addresses stay below 2**56; a key is size << ADDR_BITS | address


class Block:
    """A contiguous range of a segment: allocated, free (cached) or, in an expandable segment, unmapped."""
    __slots__ = ("addr", "size", "prev", "next", "allocated", "mapped", "seg", "requested", "gc_base", "small")

    def __init__(self, addr: int, size: int, small: bool, seg=None, mapped: bool = True):
        self.addr = addr
        self.size = size
        self.small = small
        self.seg = seg              # the ExpandableSegment, or None for a cudaMalloc segment
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.requested = 0          # bytes asked for (before rounding), while allocated
        self.gc_base = 0            # pool.calls when it entered the pool (Block::gc_count_base)

    def splice(self, before: Block | None, after: Block | None) -> None:
        """Insert self between `before` and `after` (Block::splice)."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class Pool:
    """BlockPool: the free mapped blocks of one size class (small <= 1 MiB, large above), best fit by bisect,
    and the unmapped blocks of its expandable segments ordered by address (BlockPool::unmapped)."""
    __slots__ = ("small", "keys", "blocks", "unmapped", "calls")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[int] = []            # sorted size << ADDR_BITS | addr of every free mapped block
        self.blocks: dict[int, Block] = {}
        self.unmapped: list[int] = []        # sorted addresses of unmapped blocks
        self.calls = 0                       # get_free_blocks_call_count (only counted when GC is on)

    def insert(self, b: Block) -> None:
        """BlockPool::insert_into_blocks: also stamps the block's GC age base."""
        k = b.size << ADDR_BITS | b.addr
        insort(self.keys, k)
        self.blocks[k] = b
        b.gc_base = self.calls

    def remove(self, b: Block) -> None:
        k = b.size << ADDR_BITS | b.addr
        del self.keys[bisect_left(self.keys, k)]
        del self.blocks[k]

    def add_unmapped(self, b: Block) -> None:
        insort(self.unmapped, b.addr)
        self.blocks[-1 - b.addr] = b         # negative keys never collide with free-block keys

    def remove_unmapped(self, b: Block) -> None:
        del self.unmapped[bisect_left(self.unmapped, b.addr)]
        del self.blocks[-1 - b.addr]

    def unmapped_block(self, addr: int) -> Block:
        return self.blocks[-1 - addr]

    def largest_free(self) -> int:
        return self.keys[-1] >> ADDR_BITS if self.keys else 0

    def free_blocks(self) -> list[Block]:
        return [self.blocks[k] for k in self.keys]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """Round `size` up to the next of `divisions` equal steps between its two enclosing powers of two
    (roundup_power2_next_division): 1200 with 4 divisions lies in [1024, 2048), steps of 256, -> 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(nbytes: int, config: AllocatorConfig) -> int:
    """The block size a request of `nbytes` takes (round_size): at least 512 bytes; a multiple of 512, or, where
    roundup_power2_divisions gives d > 1 for its interval and nbytes > 512 * d, the next of d steps between
    powers of two. This is what torch.cuda.memory_allocated counts for the request."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions_for(nbytes)
    if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(nbytes, divisions)
    return (nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE


def allocation_size(size: int, large_segment_bytes: int) -> int:
    """The cudaMalloc size of a new segment for a rounded request (get_allocation_size): 2 MiB for a small
    request, large_segment_size (20 MiB) below 10 MiB, else the request rounded up to 2 MiB."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_bytes
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE
