"""`pull`: bring the shared dataset's contributions into the local database, and the read-only copy the app browses.

Three steps, each safe to interrupt:

1. `fetch`: list `manifest/`, check each manifest, download each parquet file not yet pulled (size-bounded), check its
   sha256 against the manifest and keep it in the local cache (`$WILLITFIT_CACHE/shared/<dataset>/contributions/`,
   written under a temporary name and moved into place). A file whose bytes do not match is not cached.
2. `load`: every row of a cached file is validated again (bench.store.ingest, as `python -m bench ingest` does); one
   invalid row, or a row count other than the manifest's, refuses the whole file.
3. `write`: one transaction per file inserts its new rows (deduplicated by run_id), which runs it carried
   (`pulled_runs`) and the file itself (`pulls`): a file is pulled whole or not at all.

A file that fails any step is skipped with a one-line reason naming it; the others still pull. `browse_db` runs steps
2 and 3 over the cached files into a fresh DuckDB file (replaced atomically) that the app opens read-only.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from bench.share import remote
from bench.share.remote import Dataset, Manifest, ShareError
from bench.store.db import DEFAULT_WAIT_S, HEAD_VERSION, connect, load_sql, utcnow, incoming_runs
from bench.store.ingest import MAX_FILE_BYTES, IngestError, prepare_rows, read_rows
from estimator.store import cache_dir


@dataclass
class PullReport:
    pulled: list[tuple[str, int, int]] = field(default_factory=list)  # (file, rows, inserted)
    already: int = 0                                                    # files pulled before
    skipped: list[tuple[str, str]] = field(default_factory=list)       # (file, one-line reason)

    @property
    def inserted(self) -> int:
        return sum(n for _, _, n in self.pulled)


def cache_root(ds: Dataset, base: Path | None = None) -> Path:
    return remote.cache_root(ds, Path(base) if base is not None else cache_dir())


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cached_path(root: Path, m: Manifest) -> Path:
    return root / remote.CONTRIBUTIONS / f"{m.name}.parquet"


def fetch(ds: Dataset, root: Path, skip: dict[str, str] | None = None) -> tuple[list[Manifest], PullReport]:
    """Download and sha-check the contributions not in `skip` ({file: sha256} already pulled) into `root`; the
    manifests whose files are now cached, and a report of the files skipped (and why)."""
    report, ready, skip = PullReport(), [], skip or {}
    for name in remote.list_manifests(ds):
        label = f"{remote.MANIFESTS}/{name}.json"
        try:
            m = remote.parse_manifest(name, remote.read_bounded(ds, label, remote.MAX_MANIFEST_BYTES), HEAD_VERSION)
        except ValueError as e:
            report.skipped.append((label, str(e)))
            continue
        if m.file in skip:
            if skip[m.file] != m.sha256:
                report.skipped.append((m.file, f"sha256: the manifest now says {m.sha256[:16]}..., but it was "
                                               f"pulled at {skip[m.file][:16]}...; not pulled again"))
            else:
                report.already += 1
            continue
        path = cached_path(root, m)
        if path.is_file() and _sha256_file(path) == m.sha256:
            ready.append(m)
            continue
        try:
            data = remote.read_bounded(ds, m.file, MAX_FILE_BYTES)
        except ValueError as e:
            report.skipped.append((m.file, str(e)))
            continue
        got = hashlib.sha256(data).hexdigest()
        if got != m.sha256:
            report.skipped.append((m.file, f"sha256: the file's bytes hash to {got[:16]}..., the manifest says "
                                           f"{m.sha256[:16]}...; corrupt or replaced, not pulled"))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{uuid.uuid4().hex}.part")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        ready.append(m)
    return ready, report


def load(path: Path, m: Manifest) -> pa.Table:
    """The validated rows of one cached contribution; ValueError with one line when the file is refused."""
    try:
        prepared = prepare_rows(m.file, read_rows(path), keep_valid=False)
    except IngestError as e:
        raise ValueError(str(e)) from None
    if prepared.n_rejected:
        _, line, why = prepared.rejected[0]
        raise ValueError(f"row {line}: {why}; the whole file is refused ({prepared.n_rejected} invalid row(s))")
    total = prepared.table.num_rows + prepared.in_file_duplicates
    if total != m.rows:
        raise ValueError(f"rows: the file holds {total}, the manifest says {m.rows}; not pulled")
    return prepared.table


def write(ds: Dataset, m: Manifest, table: pa.Table, db_path, wait_s: float = DEFAULT_WAIT_S) -> int:
    """Insert one file's rows, the runs it carried and the file itself, in one transaction; rows inserted."""
    with connect(db_path, read_only=False, wait_s=wait_s) as con:
        with incoming_runs(con, table):
            inserted = con.execute(load_sql("insert_runs")).fetchone()[0] if table.num_rows else 0
            con.execute(load_sql("insert_pulled_runs"), [ds.url, m.file])
            con.execute(load_sql("insert_pull"), [ds.url, m.file, m.sha256, utcnow(), m.rows, inserted])
    return inserted


def pulled_files(ds: Dataset, db_path, wait_s: float = DEFAULT_WAIT_S) -> dict[str, str]:
    """{file: sha256} already pulled from `ds` into the database."""
    with connect(db_path, read_only=True, wait_s=wait_s) as con:
        return dict(con.execute(load_sql("pulled_files"), [ds.url]).fetchall())


def load_and_write(ds: Dataset, root: Path, manifests: list[Manifest], db_path, report: PullReport,
                   wait_s: float = DEFAULT_WAIT_S) -> PullReport:
    for m in manifests:
        try:
            table = load(cached_path(root, m), m)
        except ValueError as e:
            report.skipped.append((m.file, str(e)))
            continue
        report.pulled.append((m.file, m.rows, write(ds, m, table, db_path, wait_s)))
    return report


def pull(dataset: str | None = None, db_path=None, cache_base: Path | None = None,
         wait_s: float = DEFAULT_WAIT_S) -> PullReport:
    """Bring every contribution of `dataset` (default $WILLITFIT_DATASET) not yet pulled into the database."""
    ds = remote.dataset_from_env(dataset)
    remote.check_readable(ds)   # before the database is touched
    root = cache_root(ds, cache_base)
    manifests, report = fetch(ds, root, pulled_files(ds, db_path, wait_s))
    return load_and_write(ds, root, manifests, db_path, report, wait_s)


def cached_manifests(ds: Dataset, root: Path) -> list[Manifest]:
    """The contributions in the local cache, as manifests re-read from the files (name, sha256, rows from the file;
    the rows are validated again when loaded)."""
    out = []
    for path in sorted((root / remote.CONTRIBUTIONS).glob("*.parquet")):
        name = path.stem
        if not remote.NAME_RE.fullmatch(name):
            continue
        sha = _sha256_file(path)
        if not name.endswith(sha[:16]):
            continue  # damaged in the cache: fetch downloads it again
        try:
            rows = sum(1 for _ in read_rows(path))
        except IngestError:
            continue
        out.append(Manifest(name, f"{remote.CONTRIBUTIONS}/{name}.parquet", sha, rows, HEAD_VERSION))
    return out


def browse_db(ds: Dataset, cache_base: Path | None = None) -> tuple[Path, PullReport]:
    """A DuckDB file holding the validated rows of the cached contributions (built once per set of files, replaced
    atomically), for read-only browsing; and the report of the files it refused."""
    root = cache_root(ds, cache_base)
    manifests = cached_manifests(ds, root)
    key = hashlib.sha256("\n".join(m.sha256 for m in manifests).encode()).hexdigest()[:16]
    final = root / f"browse-{key}.duckdb"
    report = PullReport()
    if final.is_file():
        return final, report
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".browse-{uuid.uuid4().hex}.duckdb.part"
    try:
        with connect(tmp, read_only=False):
            pass  # an empty, migrated database even when nothing is cached
        load_and_write(ds, root, manifests, tmp, report)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
        tmp.with_name(tmp.name + ".wal").unlink(missing_ok=True)
    for old in root.glob("browse-*.duckdb"):
        if old != final:
            old.unlink(missing_ok=True)
    return final, report


def refresh(dataset: str | None = None, cache_base: Path | None = None) -> PullReport:
    """Download new contributions into the cache only (no database is written): what the app's browse button does."""
    ds = remote.dataset_from_env(dataset)
    _, report = fetch(ds, cache_root(ds, cache_base))
    return report


__all__ = ["PullReport", "ShareError", "browse_db", "cache_root", "cached_manifests", "fetch", "load", "pull",
           "pulled_files", "refresh", "write"]
