"""expandable_segments:True: one growing virtual segment per pool, mapped in pages.

Source: c10/cuda/CUDACachingAllocator.cpp at pytorch commit 001074d25084fdb87a799823e395a50f5ec044d3 -- Note
[Expandable Segments], `struct ExpandableSegment` (map / unmap round to whole pages: `segmentLeft`,
`segmentRight`), `DeviceCachingAllocator::find_expandable_block`, `map_block`, `try_allocate_expandable_block`,
`unmap_block`, `release_expandable_segment`, and the expandable branch of `get_free_block`.

Pages are 2 MiB in the small pool and large_segment_size (20 MiB) in the large pool. A segment reserves virtual
address space for 1 1/8 of the device's memory (here: of capacity_bytes; 64 TiB when unlimited), so in practice
each pool has one segment that grows at its end; pages freed by a release are unmapped and later re-mapped from
the lowest address that fits. Mapping fails (OOM) when the new pages would take reserved past the capacity; one
map call is all-or-nothing, as cuMemCreate of each page is rolled back on failure.
"""
from __future__ import annotations

from offline.allocator.pool import K_SMALL_BUFFER, Block, Pool

UNLIMITED_ADDRESS_SPACE = 1 << 46


class ExpandableSegment:
    __slots__ = ("base", "size", "page", "mapped")

    def __init__(self, base: int, size: int, page: int):
        self.base, self.size, self.page = base, size, page
        self.mapped = 0             # bytes of it backed by physical pages


def _expandable_size(b: Block) -> int:
    """A free block's size counting the unmapped space right after it (get_free_block's expandable_size)."""
    n = b.next
    return b.size + (n.size if n is not None and not n.mapped else 0)


class ExpandableMixin:
    """The expandable-segment half of CachingAllocator (uses its pools, stats and capacity)."""
    __slots__ = ()

    def expandable_segment_count(self) -> int:
        """Expandable segments with memory mapped (one whose map failed holds only address space, as in torch)."""
        return sum(1 for s in self._expandable_segments if s.mapped)

    def _expandable_best_fit(self, pool: Pool, i: int) -> int:
        """get_free_block with expandable blocks: with the option on, walk to larger blocks while the next one
        can grow less (its size plus the unmapped space after it); with it off, skip expandable blocks.
        Returns the index into pool.keys, or -1."""
        keys, blocks = pool.keys, pool.blocks
        if self._expandable:
            while i + 1 < len(keys) and blocks[keys[i]].seg is not None and \
                    _expandable_size(blocks[keys[i + 1]]) < _expandable_size(blocks[keys[i]]):
                i += 1
            return i
        while i < len(keys) and blocks[keys[i]].seg is not None:
            i += 1
        return i if i < len(keys) else -1

    def _find_expandable_block(self, pool: Pool, size: int) -> Block:
        """find_expandable_block: the lowest-addressed unmapped block (with the free block before it, if any)
        followed by enough free or unmapped space for `size`; else a new segment's single unmapped block."""
        for addr in pool.unmapped:
            c = pool.unmapped_block(addr)
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = K_SMALL_BUFFER if pool.small else self.config.large_segment_bytes
        space = UNLIMITED_ADDRESS_SPACE if self.capacity_bytes is None else self.capacity_bytes * 9 // 8
        space = max(-(-space // page), 1) * page
        base = -(-self._next_addr // page) * page
        self._next_addr = base + space
        seg = ExpandableSegment(base, space, page)
        self._expandable_segments.append(seg)
        c = Block(base, space, pool.small, seg, mapped=False)
        pool.add_unmapped(c)
        return c

    def _try_merge(self, dst: Block, src: Block | None, pool: Pool) -> int:
        """try_merge_blocks: absorb a free neighbour in the same mapped state; `dst` must be out of the pool."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _map_block(self, pool: Pool, to_map: Block, size: int) -> bool:
        """map_block: map the pages covering the first `size` bytes of an unmapped block; the rest stays
        unmapped. The new range merges with free neighbours and joins the pool."""
        page = to_map.seg.page
        mapped = -(-size // page) * page
        if self.reserved_bytes + mapped > self._capacity:
            return False
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        to_map.seg.mapped += mapped
        if mapped < to_map.size:
            rest = Block(to_map.addr + mapped, to_map.size - mapped, pool.small, to_map.seg, mapped=False)
            rest.splice(to_map, to_map.next)
            pool.add_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev, pool)
        self._try_merge(to_map, to_map.next, pool)
        pool.insert(to_map)
        self.device_allocs += 1
        r = self.reserved_bytes = self.reserved_bytes + mapped
        if r > self.peak_reserved_bytes:
            self.peak_reserved_bytes = r
        return True

    def _try_allocate_expandable_block(self, pool: Pool, size: int) -> Block | None:
        """try_allocate_expandable_block: map what the candidate lacks, page by page, until it holds `size`."""
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(pool, c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map_block(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.remove(c)
        return c

    def _unmap_block(self, pool: Pool, b: Block) -> None:
        """unmap_block: unmap the whole pages inside a free block; the partial pages at either end stay mapped
        as free blocks of their own."""
        seg = b.seg
        page = seg.page
        begin = -(-(b.addr - seg.base) // page)
        end = (b.addr + b.size - seg.base) // page
        if begin >= end:
            return
        pool.remove(b)
        addr, size = seg.base + begin * page, (end - begin) * page
        before = addr - b.addr
        if before > 0:
            head = Block(b.addr, before, pool.small, seg)
            head.splice(b.prev, b)
            pool.insert(head)
        after = b.size - before - size
        if after > 0:
            tail = Block(addr + size, after, pool.small, seg)
            tail.splice(b, b.next)
            pool.insert(tail)
        b.addr, b.size, b.mapped = addr, size, False
        seg.mapped -= size
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.add_unmapped(b)
        self.reserved_bytes -= size
        self.device_frees += 1

    def _release_expandable_segment(self, pool: Pool, b: Block) -> None:
        """release_expandable_segment: a segment with nothing mapped gives back its address space."""
        pool.remove_unmapped(b)
        self._expandable_segments.remove(b.seg)
