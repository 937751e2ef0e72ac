"""`push`: validate run files exactly as `python -m bench ingest` does, write them as one parquet file and upload it
with its manifest to the shared dataset (bench.share.remote: fsspec, or a pull request on the Hugging Face hub).

All or nothing: one invalid row in any file means nothing is uploaded, and the report names the file, line and
field, as ingest's does. The dataset address and, for hf://, the token are checked before any file is read.
"""
from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.share import remote
from bench.share.remote import Dataset
from bench.store.db import HEAD_VERSION
from bench.store.ingest import IngestError, prepare_rows, read_rows


@dataclass(frozen=True)
class PushReport:
    uploaded: bool
    name: str = ""                  # '<timestamp>-<sha prefix>' of the contribution ('' when nothing uploaded)
    rows: int = 0                   # rows in the uploaded file (run_ids unique)
    duplicates: int = 0             # rows dropped because their run_id repeated across or within the files
    rejected: tuple[tuple[str, int, str], ...] = ()   # (file, line, reason); line 0 = the whole file
    n_rejected: int = 0
    where: str = ""                 # the file's address, or the pull request's URL on the hub


def contribution_table(paths: Iterable[str | Path]) -> tuple[pa.Table | None, int, list, int]:
    """(table of the unique valid rows, duplicates, rejections, n_rejected) of the files, validated as ingest
    validates them; the table is None when any row or file was refused."""
    tables, rejected, n_rejected, duplicates = [], [], 0, 0
    for path in paths:
        try:
            prepared = prepare_rows(str(path), read_rows(path), keep_valid=False)
        except (IngestError, OSError) as e:
            rejected.append((str(path), 0, str(e)))
            n_rejected += 1
            continue
        rejected.extend(prepared.rejected)
        n_rejected += prepared.n_rejected
        duplicates += prepared.in_file_duplicates
        if prepared.table is not None:
            tables.append(prepared.table)
    if n_rejected:
        return None, duplicates, rejected, n_rejected
    table = pa.concat_tables(tables) if tables else None
    if table is not None and table.num_rows:
        ids = table.column("run_id").to_pylist()
        first = {}
        for i, run_id in enumerate(ids):
            first.setdefault(run_id, i)
        if len(first) < len(ids):  # the same run in two files: keep the first
            duplicates += len(ids) - len(first)
            table = table.take(sorted(first.values()))
    return table, duplicates, rejected, n_rejected


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def upload(ds: Dataset, name: str, parquet: bytes, manifest: bytes, token: str | None) -> str:
    """Send one contribution; the address it is at (or the pull request's URL)."""
    if ds.kind == "hf":
        return remote.upload_hf(ds, name, parquet, manifest, token)
    remote.upload_fsspec(ds, name, parquet, manifest)
    return f"{ds.url}/{remote.CONTRIBUTIONS}/{name}.parquet"


def push(paths: Iterable[str | Path], dataset: str | None = None, uploader=upload) -> PushReport:
    """Validate `paths` and upload them as one contribution to `dataset` (default $WILLITFIT_DATASET).

    ValueError (the dataset address) or ShareError (no token, offline, the remote refused) before any file is
    read or anything sent; a PushReport with uploaded=False when a row was invalid (nothing sent)."""
    ds = remote.dataset_from_env(dataset)
    token = remote.hf_token() if ds.kind == "hf" else None
    paths = list(paths)
    if not paths:
        raise ValueError("files: none given; pass one or more .jsonl, .csv or .parquet files of run rows")
    table, duplicates, rejected, n_rejected = contribution_table(paths)
    if table is None or table.num_rows == 0:
        return PushReport(False, duplicates=duplicates, rejected=tuple(rejected), n_rejected=n_rejected)
    data = parquet_bytes(table)
    sha = hashlib.sha256(data).hexdigest()
    name = remote.contribution_name(sha)
    contributors = sorted({c for c in table.column("contributor").to_pylist() if c})
    versions = sorted({v for v in table.column("tool_version").to_pylist() if v})
    manifest = remote.manifest_bytes(name, sha, table.num_rows, HEAD_VERSION, ", ".join(contributors)[:256] or None,
                                     ", ".join(versions)[:64] or None)
    where = uploader(ds, name, data, manifest, token)
    return PushReport(True, name, table.num_rows, duplicates, (), 0, where)


__all__ = ["PushReport", "contribution_table", "parquet_bytes", "push", "upload"]
