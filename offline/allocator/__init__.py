"""A pure-Python model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) and the replay
of allocation streams through it. See docs/allocator.md.

    from offline.allocator import parse_alloc_conf, replay, Stream
    result = replay(Stream.load("run.npz"), parse_alloc_conf("expandable_segments:True"))
    result.overall.peak_reserved_bytes
"""
