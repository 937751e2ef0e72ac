"""Set two allocation streams of one case side by side: what a GPU allocated that the trace did not, and back.

    python scripts/stream_diff.py GPU.npz TRACED.npz [--top 15]

GPU.npz from `python -m bench measure --stream-dir DIR` (one case, one process), TRACED.npz from `python -m bench
trace ... --stream FILE` of the same case. Per stage name both streams have, it prints each one's peak allocated
bytes as the caching-allocator model replays it (offline.allocator.replay: torch.cuda.max_memory_allocated's
quantity, as `python -m bench replay` prints it), then the allocation sizes (each rounded to the block the
allocator takes for it, pool.round_size, so a request and its block compare equal) that one stream made more often
than the other in that stage, largest total first: the
allocations behind a gap between a measured row and its estimate (a kernel's workspace, a copy a CPU kernel never
makes). The streams are read as untrusted files (offline.allocator.stream: no pickle).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator.alloc_conf import AllocatorConfig  # noqa: E402
from offline.allocator.pool import round_size  # noqa: E402
from offline.allocator.replay import replay  # noqa: E402
from offline.allocator.stream import ALLOC, Stream  # noqa: E402


def stage_peaks(s: Stream) -> dict[str, int]:
    """{stage name: peak allocated bytes in that stage}, replayed under torch's default allocator settings."""
    return {st.name: st.peak_allocated_bytes for st in replay(s).stages if st.events}


def alloc_sizes(s: Stream) -> dict[str, Counter]:
    """{stage name: Counter of the block sizes its allocations take (pool.round_size, default settings)}."""
    out: dict[str, Counter] = {}
    config = AllocatorConfig()
    for i, name in enumerate(s.stage_names):
        mask = (s.stage == i) & (s.kind == ALLOC)
        out.setdefault(name, Counter()).update(round_size(int(x), config) for x in s.nbytes[mask])
    return out


def surplus(a: Counter, b: Counter, top: int) -> list[tuple[int, int, int]]:
    """(size, extra count, extra bytes) of the sizes `a` allocated more often than `b`, largest bytes first."""
    rows = [(size, n - b.get(size, 0), size * (n - b.get(size, 0))) for size, n in a.items() if n > b.get(size, 0)]
    return sorted(rows, key=lambda r: -r[2])[:top]


def report(gpu: Stream, traced: Stream, top: int = 15) -> str:
    """The side-by-side text (see the module docstring)."""
    pa, pb = stage_peaks(gpu), stage_peaks(traced)
    sa, sb = alloc_sizes(gpu), alloc_sizes(traced)
    common = [n for n in gpu.stage_names if n in pb]
    if not common:
        raise ValueError(f"stages: the streams share no stage name ({', '.join(gpu.stage_names)} against "
                         f"{', '.join(traced.stage_names)})")
    lines = [f"{'stage':<12}{'GPU allocated B':>18}{'traced allocated B':>20}{'GPU - traced':>16}"]
    lines += [f"{n:<12}{pa[n]:>18,}{pb[n]:>20,}{pa[n] - pb[n]:>+16,}" for n in common]
    for label, x, y in (("GPU, not traced", sa, sb), ("traced, not GPU", sb, sa)):
        for n in common:
            rows = surplus(x[n], y[n], top)
            if rows:
                lines.append(f"\n{label}: {n} ({sum(r[2] for r in rows):,} B in the {len(rows)} largest)")
                lines += [f"  {size:>16,} B x {count:<5} = {total:>16,} B" for size, count, total in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gpu", type=Path, help="the measured stream (.npz)")
    p.add_argument("traced", type=Path, help="the traced stream of the same case (.npz)")
    p.add_argument("--top", type=int, default=15, help="sizes listed per stage and direction (default 15)")
    args = p.parse_args(argv)
    try:
        if args.top < 1:
            raise ValueError(f"top: must be a positive integer, got {args.top}")
        print(report(Stream.load(args.gpu), Stream.load(args.traced), args.top))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
