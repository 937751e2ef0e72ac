"""`python -m bench replay FILE`: replay an allocation stream (.npz from `python -m bench trace --stream` or
`python -m bench measure --stream-dir`) through the caching-allocator model and print, per stage, the peak
allocated and reserved bytes, and at the reserved peak the largest free block, the fragmentation and the
segment count, then oom_capacity.

    python -m bench trace --model llama-3.2-1b --batch 1 --seq 512 --stream run.npz
    python -m bench replay run.npz
    python -m bench replay run.npz --alloc-conf "expandable_segments:True" --capacity-gib 2.5 --json

Bad input (a file that is not a valid stream, a bad --alloc-conf) exits with code 2 and one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from estimator.units import GiB
from bench.trace.streams import format_summary, summary
from estimator.alloc_conf import parse_alloc_conf
from offline.allocator.stream import Stream


def register(subparsers) -> None:
    p = subparsers.add_parser("replay", help="replay an allocation stream through the caching-allocator model",
                              description="\n\n".join(__doc__.split("\n\n")[:2]),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="stream .npz (offline.allocator.Stream; validated, never unpickled)")
    p.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF to replay under, e.g. "
                   "'expandable_segments:True' (default: torch's defaults)")
    p.add_argument("--capacity-gib", type=float, default=None,
                   help="device capacity in GiB (2^30 bytes) available to torch: report the first OOM under it")
    p.add_argument("--no-oom-capacity", action="store_true",
                   help="skip oom_capacity (a bisection: a dozen replays)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:

    try:
        config = parse_alloc_conf(args.alloc_conf)
        capacity = None
        if args.capacity_gib is not None:
            if not (math.isfinite(args.capacity_gib) and 0 < args.capacity_gib <= 4096):
                raise ValueError(f"capacity_gib: {args.capacity_gib} is out of range; allowed 0 < GiB <= 4096")
            capacity = int(args.capacity_gib * GiB)
        stream = Stream.load(args.file)
    except ValueError as e:
        print(f"python -m bench replay: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    d = summary(stream, config, capacity, with_capacity=not args.no_oom_capacity)
    print(json.dumps(d, indent=2) if args.json else format_summary(d))
    return 0
