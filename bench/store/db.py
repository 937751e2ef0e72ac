"""The DuckDB store: connections, migrations and the read helpers the app uses.

DuckDB lets one process write a database file, or many processes read it, never both at once: opening
takes a file lock, and a second opener gets "IO Error: Could not set lock on file".
(https://duckdb.org/docs/current/connect/concurrency). So every call here opens a short-lived
connection, does its work and closes it, and opening retries with backoff for a bounded wait before
raising `DatabaseBusy`. A writer applies the numbered migrations in `bench/store/migrations/` on every open,
each in one transaction, recorded in `schema_migrations`; a reader that finds an older schema migrates
it first through a brief write connection.

SQL lives in `bench/store/queries/*.sql`; values are always bound parameters.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import numbers
import os
import random
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import duckdb

from bench.store.rows import MAX_JSON, canonical_json
from estimator import spec

REPO_DIR = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
QUERIES_DIR = Path(__file__).resolve().parent / "queries"
DEFAULT_WAIT_S = 30.0      # how long an opener waits for another process's lock before giving up
MAX_BACKOFF_S = 0.25       # cap on one sleep between lock attempts; keeps readers responsive
DEFAULT_FETCH_LIMIT = 1_000  # rows fetch_runs returns unless told otherwise (an app table; pass None for all)
# Readers let DuckDB sort and limit on narrow columns first and fetch the wide rows (config_json, ...)
# only for the rows kept, for pages of up to this many rows (DuckDB's default is 50). On a million
# runs this halves the CPU of a filtered page of 100..1000 rows (docs/performance.md, ## Database).
LATE_MATERIALIZATION_ROWS = 10_000

# Columns of v_runs that fetch_runs / export may filter on by equality (or IN for a list of values).
FILTER_COLUMNS = (
    "run_id", "source", "gpu_name", "gpu_count", "model_name", "model_type", "family", "config_hash",
    "mode", "method", "recipe", "precision", "weight_format", "optimizer", "optimizer_impl", "batch",
    "seq", "checkpointing", "attention", "kv_dtype", "strategy", "world_size", "oom", "metric",
)


class DatabaseBusy(RuntimeError):
    """Another process (or a differently-configured connection in this one) holds the database lock."""


def default_db_path() -> Path:
    """$WILLITFIT_DB if set, else <repo>/data/benchmarks.duckdb."""
    env = os.environ.get("WILLITFIT_DB")
    return Path(env) if env else REPO_DIR / "data" / "benchmarks.duckdb"


def load_sql(name_or_path: str | Path) -> str:
    """Text of bench/store/queries/<name>.sql, or of an explicit .sql path."""
    text = str(name_or_path)
    if re.fullmatch(r"[a-z0-9_]+", text):
        return (QUERIES_DIR / f"{text}.sql").read_text()
    path = Path(text)
    if path.suffix != ".sql" or not path.is_file():
        raise ValueError(f"sql: {text!r} is neither a query name in bench/store/queries/ nor a .sql file")
    return path.read_text()


def migration_files() -> list[tuple[int, str, Path]]:
    """(version, name, path) of bench/store/migrations/NNN_name.sql, in version order."""
    out = []
    for path in sorted(MIGRATIONS_DIR.glob("*.sql")):
        m = re.fullmatch(r"(\d{3})_([a-z0-9_]+)\.sql", path.name)
        if not m:
            raise ValueError(f"migrations: {path.name!r} is not named NNN_name.sql")
        out.append((int(m.group(1)), m.group(2), path))
    versions = [v for v, _, _ in out]
    if versions != list(range(1, len(out) + 1)):
        raise ValueError(f"migrations: versions must run 1, 2, 3, ... without gaps; found {versions}")
    return out


HEAD_VERSION = len(migration_files())


def utcnow() -> datetime:
    """Current UTC time without a zone, as the TIMESTAMP columns store it."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _is_lock_error(e: Exception) -> bool:
    msg = str(e)
    # IOException: another process holds the file lock. ConnectionException: this process already has
    # the file open with the other read_only setting (e.g. a Streamlit thread mid-read).
    return ((isinstance(e, duckdb.IOException) and "Could not set lock" in msg)
            or (isinstance(e, duckdb.ConnectionException) and "different configuration" in msg))


def _open(path: Path, read_only: bool, deadline: float, wait_s: float) -> duckdb.DuckDBPyConnection:
    """duckdb.connect, retrying lock conflicts with jittered exponential backoff until `deadline`."""
    attempt = 0
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except (duckdb.IOException, duckdb.ConnectionException) as e:
            if not _is_lock_error(e):
                raise
            now = time.monotonic()
            if now >= deadline:
                raise DatabaseBusy(
                    f"database {path} is busy: another process holds its lock and did not release it "
                    f"within {wait_s:g} s ({str(e).splitlines()[0]})") from None
            sleep_s = min(MAX_BACKOFF_S, 0.005 * 2 ** attempt) * random.uniform(0.5, 1.0)
            time.sleep(min(sleep_s, max(0.0, deadline - now)))
            attempt += 1


def migrate(con: duckdb.DuckDBPyConnection, upto: int | None = None) -> list[int]:
    """Apply every migration not yet recorded (up to version `upto`), each in its own transaction.

    Idempotent: a migration recorded in schema_migrations is skipped. Returns the versions applied now.
    """
    con.execute(load_sql("create_schema_migrations"))
    done = {v for (v,) in con.execute(load_sql("applied_migrations")).fetchall()}
    applied = []
    for version, name, path in migration_files():
        if version in done or (upto is not None and version > upto):
            continue
        con.begin()
        try:
            con.execute(path.read_text())
            con.execute(load_sql("record_migration"), [version, name, utcnow()])
            con.commit()
        except BaseException:
            con.rollback()
            raise
        applied.append(version)
    return applied


def schema_version(con: duckdb.DuckDBPyConnection) -> int:
    """Highest applied migration, 0 for a database without the ledger."""
    try:
        versions = con.execute(load_sql("applied_migrations")).fetchall()
    except duckdb.CatalogException:
        return 0
    return max((v for (v,) in versions), default=0)


@contextlib.contextmanager
def incoming_runs(con: duckdb.DuckDBPyConnection, table):
    """One transaction with `table` (Arrow, the run columns) registered as `incoming_runs`, the view
    queries/insert_runs.sql reads: committed when the block ends, rolled back whole on any error (nothing
    half-written), the view dropped either way. Every writer of runs (ingest, published import, pull) goes through it."""
    con.register("incoming_runs", table)
    try:
        con.begin()
        try:
            yield con
            con.commit()
        except BaseException:
            con.rollback()
            raise
    finally:
        con.unregister("incoming_runs")


@contextlib.contextmanager
def connect(path: str | Path | None = None, read_only: bool = False, wait_s: float = DEFAULT_WAIT_S):
    """A short-lived connection, closed on exit; never keep it beyond one call.

    A writer migrates the schema to head. A reader of a missing or out-of-date database first creates /
    migrates it through a brief write connection, so the views it queries always exist. Both wait up to
    `wait_s` seconds for a lock held elsewhere, then raise DatabaseBusy.
    """
    path = Path(path) if path is not None else default_db_path()
    deadline = time.monotonic() + wait_s
    if read_only and not path.exists():
        _migrate_file(path, deadline, wait_s)
    if not read_only:
        path.parent.mkdir(parents=True, exist_ok=True)
    con = _open(path, read_only, deadline, wait_s)
    try:
        if not read_only:
            migrate(con)
        elif schema_version(con) < HEAD_VERSION:
            con.close()
            _migrate_file(path, deadline, wait_s)
            con = _open(path, True, deadline, wait_s)
        if read_only:
            con.execute("SET late_materialization_max_rows = ?", [LATE_MATERIALIZATION_ROWS])
        yield con
    finally:
        con.close()


def _migrate_file(path: Path, deadline: float, wait_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    con = _open(path, False, deadline, wait_s)
    try:
        migrate(con)
    finally:
        con.close()


def db_fingerprint(path: str | Path | None = None) -> tuple[int, int]:
    """(mtime_ns, size_bytes) of the database file plus its write-ahead log; (0, 0) if absent.

    Changes whenever a writer commits, so the app keys its cache on it.
    """
    path = Path(path) if path is not None else default_db_path()
    mtime_ns, size_bytes = 0, 0
    for p in (path, path.with_name(path.name + ".wal")):
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            mtime_ns, size_bytes = max(mtime_ns, st.st_mtime_ns), size_bytes + st.st_size
    return mtime_ns, size_bytes


def query_df(sql_name_or_path: str | Path, params: list | dict | None = None,
             db_path: str | Path | None = None, wait_s: float = DEFAULT_WAIT_S):
    """Run a read-only query from bench/store/queries/ (or a .sql path) with bound params; a pandas DataFrame."""
    sql = load_sql(sql_name_or_path)
    with connect(db_path, read_only=True, wait_s=wait_s) as con:
        return con.execute(sql, params).df()


def filter_clause(filters: dict | None, allowed: tuple[str, ...] = FILTER_COLUMNS) -> tuple[str, list]:
    """`AND col = ?` / `AND col IN (?, ...)` terms for whitelisted columns, and their bound values.

    Only names from `allowed` reach the SQL text; values never do. None or an empty list means
    "no filter on this column" (an empty multiselect in the app shows everything).
    """
    terms, params = [], []
    for name, value in (filters or {}).items():
        if name not in allowed:
            raise ValueError(f"filters: unknown column {name!r}; allowed {', '.join(allowed)}")
        if value is None:
            continue
        if isinstance(value, (list, tuple, set, frozenset)):
            values = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else list(value)
            if not values:
                continue
            terms.append(f"AND {name} IN ({', '.join('?' * len(values))})")
            params.extend(values)
        else:
            terms.append(f"AND {name} = ?")
            params.append(value)
    return " ".join(terms), params


def runs_sql(filters: dict | None) -> tuple[str, list]:
    """bench/store/queries/runs.sql with the filter terms in place; the caller appends the limit parameter."""
    clause, params = filter_clause(filters)
    return load_sql("runs").replace("/*filters*/", clause), params


def fetch_runs(filters: dict | None = None, db_path: str | Path | None = None,
               limit: int | None = DEFAULT_FETCH_LIMIT, wait_s: float = DEFAULT_WAIT_S):
    """Rows of v_runs matching `filters` ({column: value or [values]}), newest first; a DataFrame."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit: must be a non-negative integer or None, got {limit!r}")
    sql, params = runs_sql(filters)
    with connect(db_path, read_only=True, wait_s=wait_s) as con:
        return con.execute(sql, [*params, limit]).df()


def get_run(run_id: str, db_path: str | Path | None = None, wait_s: float = DEFAULT_WAIT_S) -> dict | None:
    """One run (v_runs columns) as a dict, or None if no run has that id."""
    df = query_df("run_detail", [run_id], db_path, wait_s)
    return df.iloc[0].to_dict() if len(df) else None


def count_runs(db_path: str | Path | None = None, wait_s: float = DEFAULT_WAIT_S) -> int:
    with connect(db_path, read_only=True, wait_s=wait_s) as con:
        return int(con.execute(load_sql("count_runs")).fetchone()[0])


@dataclass(frozen=True)
class Calibration:
    """One fit of the analytic memory model against stored runs: a row of `calibrations`."""

    architecture: str                  # config.json model_type the fit applies to, e.g. 'llama'
    k: float                           # the fitted coefficient
    n_points: int                      # data points (runs) the fit used
    run_ids: tuple[str, ...]           # runs.run_id of those runs, so the fit can be reproduced
    method: str                        # how k was fitted, e.g. 'ols' or 'huber'
    attention: str | None = None       # sdpa | flash | eager; None = fitted across all of them
    checkpointing: str | None = None   # none | full | selective; None = fitted across all of them
    k_ci_low: float | None = None      # confidence interval of k (params can say which level)
    k_ci_high: float | None = None
    r2: float | None = None            # coefficient of determination of the fit
    residual_std_bytes: float | None = None  # std of (measured - fitted) peak, in bytes
    params: dict = field(default_factory=dict)  # other fitted numbers, e.g. {"context_bytes": ...}
    created_at: datetime | None = None  # UTC, no zone; None = the time it is stored

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.architecture):
            raise ValueError(f"architecture: {self.architecture!r} is not a model_type; "
                             "allowed letters, digits, '_', '.', '-' (1..64 characters)")
        for name, allowed in (("attention", spec.ATTENTION), ("checkpointing", spec.CHECKPOINTING)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name}: {value!r} not allowed; choose one of {', '.join(allowed)} or None")
        for name in ("k", "k_ci_low", "k_ci_high", "r2", "residual_std_bytes"):
            value = getattr(self, name)
            if value is None and name != "k":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
        if self.k_ci_low is not None and self.k_ci_high is not None and not self.k_ci_low <= self.k <= self.k_ci_high:
            raise ValueError(f"k_ci_low: interval [{self.k_ci_low}, {self.k_ci_high}] must contain k={self.k}")
        if self.residual_std_bytes is not None and self.residual_std_bytes < 0:
            raise ValueError(f"residual_std_bytes: {self.residual_std_bytes} must be >= 0")
        if isinstance(self.n_points, bool) or not isinstance(self.n_points, numbers.Integral) or self.n_points < 1:
            raise ValueError(f"n_points: must be an integer >= 1, got {self.n_points!r}")
        if (not isinstance(self.run_ids, tuple) or not self.run_ids
                or not all(isinstance(r, str) and 0 < len(r) <= 64 for r in self.run_ids)):
            raise ValueError("run_ids: must be a non-empty tuple of run_id strings (at most 64 characters each)")
        if not isinstance(self.method, str) or not 0 < len(self.method) <= 64:
            raise ValueError(f"method: must be a name of 1..64 characters, got {self.method!r}")
        if not isinstance(self.params, dict) or not all(isinstance(key, str) for key in self.params):
            raise ValueError("params: must be a dict with string keys")
        try:
            text = json.dumps(self.params, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"params: must be JSON-serialisable with finite numbers ({e})") from None
        if len(text) > MAX_JSON:
            raise ValueError(f"params: {len(text)} characters of JSON; at most {MAX_JSON}")
        if self.created_at is not None and (not isinstance(self.created_at, datetime) or self.created_at.tzinfo):
            raise ValueError(f"created_at: must be a datetime in UTC without tzinfo, got {self.created_at!r}")


def _calibration_record(cal: Calibration, created_at: datetime) -> dict:
    """Named parameters of insert_calibration.sql; the id hashes everything, so it is unique per store."""
    record = {
        "architecture": cal.architecture, "attention": cal.attention, "checkpointing": cal.checkpointing,
        "k": float(cal.k), "k_ci_low": cal.k_ci_low, "k_ci_high": cal.k_ci_high, "r2": cal.r2,
        "residual_std_bytes": cal.residual_std_bytes, "n_points": int(cal.n_points),
        "run_ids": canonical_json(list(cal.run_ids)), "method": cal.method,
        "params_json": canonical_json(cal.params), "created_at": created_at,
    }
    ident = canonical_json({**record, "created_at": created_at.isoformat()})
    return {"calibration_id": hashlib.sha256(ident.encode()).hexdigest(), **record}


def _calibration_from_record(rec: dict) -> Calibration:
    return Calibration(
        architecture=rec["architecture"], k=rec["k"], n_points=rec["n_points"],
        run_ids=tuple(json.loads(rec["run_ids"])), method=rec["method"], attention=rec["attention"],
        checkpointing=rec["checkpointing"], k_ci_low=rec["k_ci_low"], k_ci_high=rec["k_ci_high"], r2=rec["r2"],
        residual_std_bytes=rec["residual_std_bytes"],
        params=json.loads(rec["params_json"]) if rec["params_json"] else {}, created_at=rec["created_at"])


def insert_calibration(cal: Calibration, db_path: str | Path | None = None,
                       wait_s: float = DEFAULT_WAIT_S) -> str:
    """Store a fitted calibration (created_at defaults to now, UTC); returns its calibration_id."""
    record = _calibration_record(cal, cal.created_at or utcnow())
    with connect(db_path, read_only=False, wait_s=wait_s) as con:
        con.execute(load_sql("insert_calibration"), record).fetchall()
    return record["calibration_id"]


def latest_calibrations(architecture: str | None = None, db_path: str | Path | None = None,
                        wait_s: float = DEFAULT_WAIT_S) -> list[Calibration]:
    """The newest calibration per (architecture, attention, checkpointing), optionally of one architecture."""
    with connect(db_path, read_only=True, wait_s=wait_s) as con:
        cur = con.execute(load_sql("latest_calibrations"), {"architecture": architecture})
        names = [d[0] for d in cur.description]
        return [_calibration_from_record(dict(zip(names, row))) for row in cur.fetchall()]


__all__ = [
    "Calibration", "DatabaseBusy", "DEFAULT_WAIT_S", "FILTER_COLUMNS", "HEAD_VERSION", "connect", "count_runs", "db_fingerprint", "default_db_path", "fetch_runs", "get_run",
    "insert_calibration", "latest_calibrations", "load_sql", "migrate", "query_df", "schema_version",
]
