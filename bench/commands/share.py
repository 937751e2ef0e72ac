"""`python -m bench push FILE...` and `python -m bench pull`: the shared measurement dataset (bench/share/).

    export WILLITFIT_DATASET=hf://datasets/<org>/<name>     # or s3://..., memory://..., a local directory
    python -m bench push runs.jsonl                          # validated as ingest does; one contribution file
    python -m bench pull --db data/benchmarks.duckdb         # new contributions, validated again, deduplicated

Exit codes: 0 done; 2 bad input (the dataset address, a missing token, an invalid row: nothing uploaded) or a
database kept locked longer than --wait; 1 the dataset could not be read or written, or (pull) a file was skipped.
"""
from __future__ import annotations

import sys

import duckdb

from bench.share import remote
from bench.share.pull import pull
from bench.share.push import push
from bench.share.remote import ShareError
from bench.store.db import DEFAULT_WAIT_S, DatabaseBusy, default_db_path


def _add_dataset(p) -> None:
    p.add_argument("--dataset", default=None, metavar="URL",
                   help=f"the shared dataset (default ${remote.ENV}): {remote.ALLOWED}")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "push", help="validate run rows and upload them to the shared dataset as one contribution",
        description="Validate every row of every file as `ingest` does (any invalid row: nothing is uploaded), "
                    "write them as one parquet file and upload it with its manifest. On hf:// this opens a pull "
                    "request on the dataset (HF_TOKEN needed); maintainers review and merge it.")
    p.add_argument("files", nargs="+", metavar="FILE", help="a .jsonl, .csv or .parquet file of run rows")
    _add_dataset(p)
    p.set_defaults(func=run_push)

    p = subparsers.add_parser(
        "pull", help="bring the shared dataset's contributions into the local database",
        description="Download each contribution not yet pulled, check its sha256 against its manifest, validate "
                    "every row again and insert the new ones (deduplicated by run_id) with a record of the file "
                    "they came from. A corrupt or invalid file is skipped with one line; the rest still pull.")
    _add_dataset(p)
    p.add_argument("--db", default=None, metavar="PATH",
                   help="DuckDB database file (default: $WILLITFIT_DB, else data/benchmarks.duckdb)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help=f"how long to wait for another process's lock on the database (default {DEFAULT_WAIT_S:g})")
    p.set_defaults(func=run_pull)


def run_push(args) -> int:
    try:
        report = push(args.files, args.dataset)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    except ShareError as e:
        print(e, file=sys.stderr)
        return 2 if str(e).startswith(("HF_TOKEN", "HF_HUB_OFFLINE")) else 1
    for file, line, reason in report.rejected:
        print(f"{file}:{line}: {reason}", file=sys.stderr)
    if not report.uploaded:
        if report.n_rejected:
            print(f"rejected {report.n_rejected} invalid row(s); nothing uploaded", file=sys.stderr)
        else:
            print("files: no rows to push; nothing uploaded", file=sys.stderr)
        return 2
    print(f"pushed {report.rows} row(s) (duplicates {report.duplicates}) as {report.name} -> {report.where}")
    return 0


def run_pull(args) -> int:
    if not args.wait >= 0:
        print(f"wait: {args.wait} must be >= 0 seconds", file=sys.stderr)
        return 2
    db_path = args.db or default_db_path()
    try:
        report = pull(args.dataset, db_path, wait_s=args.wait)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    except DatabaseBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ShareError as e:
        print(e, file=sys.stderr)
        return 1
    except duckdb.Error as e:
        print(f"db: cannot write {db_path} ({str(e).splitlines()[0]})", file=sys.stderr)
        return 2
    for file, reason in report.skipped:
        print(f"skipped {file}: {reason}", file=sys.stderr)
    print(f"pulled {len(report.pulled)} file(s): inserted {report.inserted} row(s); {report.already} file(s) pulled "
          f"before; {len(report.skipped)} skipped -> {db_path}")
    return 1 if report.skipped else 0
