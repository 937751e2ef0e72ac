"""`python -m bench ingest FILE...` and `python -m bench export --format ... --out PATH`.

    python -m bench ingest results/*.jsonl --db data/benchmarks.duckdb
    python -m bench export --format parquet --out runs.parquet --source measured

Exit codes: 0 done; 2 bad input (any invalid row without --skip-invalid, in which case nothing is
written) or a database another process kept locked for longer than --wait.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import duckdb

from bench.store.db import DEFAULT_WAIT_S, DatabaseBusy, default_db_path
from bench.store.rows import SOURCES
from bench.store.ingest import ingest_files
from bench.store.ingest import export


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, metavar="PATH",
                   help="DuckDB database file (default: $WILLITFIT_DB, else data/benchmarks.duckdb)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help=f"how long to wait for another process's lock on the database (default {DEFAULT_WAIT_S:g})")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ingest", help="validate run rows from JSONL/CSV/Parquet files and add them to the database",
        description="Validate every row of every file, then insert each file in one transaction. Rows whose "
                    "run_id is already stored are counted as duplicates. Any invalid row means nothing is "
                    "written (exit 2) unless --skip-invalid.")
    p.add_argument("files", nargs="+", metavar="FILE", help="a .jsonl, .csv or .parquet file of run rows")
    _add_common(p)
    p.add_argument("--skip-invalid", action="store_true",
                   help="write the valid rows and report the invalid ones instead of writing nothing")
    p.add_argument("--replace", action="store_true",
                   help="a traced row replaces the stored traced row with the same run_id (after the tracer "
                        "changed); measured and published rows are never replaced")
    p.set_defaults(func=run_ingest)

    p = subparsers.add_parser(
        "export", help="write stored runs to a Parquet, CSV or JSONL file",
        description="Write the runs columns of the matching rows; the file can be ingested again unchanged.")
    p.add_argument("--format", required=True, choices=("parquet", "csv", "jsonl"), help="output file format")
    p.add_argument("--out", required=True, metavar="PATH", help="output file (replaced if it exists)")
    _add_common(p)
    p.add_argument("--source", action="append", choices=SOURCES,
                   help="only runs from this source (repeat for several)")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="only runs of this model_name (repeat for several)")
    p.set_defaults(func=run_export)


def _wait(args) -> float | None:
    if not args.wait >= 0:
        print(f"wait: {args.wait} must be >= 0 seconds", file=sys.stderr)
        return None
    return args.wait


def run_ingest(args) -> int:
    wait_s = _wait(args)
    if wait_s is None:
        return 2
    db_path = args.db or default_db_path()
    try:
        report = ingest_files(args.files, db_path, skip_invalid=args.skip_invalid, wait_s=wait_s,
                              replace=getattr(args, "replace", False))
    except DatabaseBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except duckdb.Error as e:  # not a DuckDB file, unwritable, ...: one line, not a traceback
        print(f"db: cannot write {db_path} ({str(e).splitlines()[0]})", file=sys.stderr)
        return 2
    for file, line, reason in report.rejected:
        print(f"{file}:{line}: {reason}", file=sys.stderr)
    if not report.written:
        # line 0 is a whole file that could not be read (missing, too large, unknown type), not a row
        files = sum(1 for _, line, reason in report.rejected if line == 0 and not reason.startswith("... and"))
        rows = report.n_rejected - files
        what = " and ".join(filter(None, (f"{files} file(s) could not be read" if files else "",
                                          f"{rows} invalid row(s) rejected" if rows else "")))
        print(f"{what}; nothing written to {db_path} "
              + ("(fix them, or pass --skip-invalid to write the valid rows)" if rows else "(check the path)"),
              file=sys.stderr)
        return 2
    print(f"inserted {report.inserted}, duplicates {report.duplicates}, rejected {report.n_rejected} -> {db_path}")
    return 0


def run_export(args) -> int:
    wait_s = _wait(args)
    if wait_s is None:
        return 2
    db_path = Path(args.db) if args.db else default_db_path()
    if not db_path.is_file():
        print(f"db: no database at {db_path}", file=sys.stderr)
        return 2
    filters = {"source": args.source, "model_name": args.model}
    try:
        n = export(db_path, args.out, args.format, filters, wait_s=wait_s)
    except DatabaseBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except duckdb.Error as e:
        print(f"db: cannot read {db_path} ({str(e).splitlines()[0]})", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"out: cannot write {args.out} ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"exported {n} run(s) to {args.out}")
    return 0
