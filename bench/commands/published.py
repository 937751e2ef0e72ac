"""`python -m bench import-published`: rebuild the published tier of the database from data/published/points.csv.

    python -m bench import-published                                        # the shipped data file
    python -m bench import-published --from ../shared/published/points.csv  # map the collected file first

Every published run is replaced in one transaction (bench/published/importer.py). Exit 2 with one line on bad data.
"""
from __future__ import annotations

import sys
from bench.published import importer as published


def counts_markdown() -> str:
    """Mapped / partial / unmapped by source and by metric, as markdown tables (docs/published.md)."""
    from collections import Counter


    rows = published.load_data()
    out = []
    for key, title in (("source_repo", "source"), ("metric", "metric")):
        c = Counter((p[key], p["mapping_status"]) for p in rows)
        out += [f"| {title} | mapped | partial | unmapped | all |", "|---|---:|---:|---:|---:|"]
        for k in sorted({k for k, _ in c}):
            n = [c[(k, s)] for s in ("mapped", "partial", "unmapped")]
            out.append(f"| {k} | {n[0]} | {n[1]} | {n[2]} | {sum(n)} |")
        out.append("")
    return "\n".join(out)


def run(args) -> int:

    if args.counts:
        print(counts_markdown())
        return 0
    try:
        if args.source:
            n = published.write_data(args.source)
            print(f"mapped {n} rows -> {published.DATA_FILE}")
        n = published.import_published(args.db, wait_s=args.wait)
    except ValueError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    rows = published.load_data()
    by = {}
    for p in rows:
        by[p["mapping_status"]] = by.get(p["mapping_status"], 0) + 1
    print(f"published tier: {n} runs written ({', '.join(f'{v} {k}' for k, v in sorted(by.items()))})")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("import-published", help="rebuild the published tier from data/published/points.csv",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", default=None,
                   help="the collected CSV to map first (writes data/published/points.csv)")
    p.add_argument("--db", default=None, help="DuckDB file (default: $WILLITFIT_DB, else data/benchmarks.duckdb)")
    p.add_argument("--counts", action="store_true", help="print the mapping counts by source and metric; import nothing")
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for another process's lock")
    p.set_defaults(func=run)
