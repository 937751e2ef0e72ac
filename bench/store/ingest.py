"""Ingest run rows from JSONL / CSV / Parquet files into the database, and export them back out.

Files are untrusted (contributed results): sizes and line lengths are bounded, JSON is parsed strictly,
nothing is ever eval'd or unpickled, and every row passes `bench.store.validate.validate_row`. One file is one
transaction: all of its valid rows or none. A row whose run_id is already stored, or repeats earlier in
the same file, is counted as a duplicate, not an error. By default any invalid row anywhere means
nothing is written at all; with skip_invalid=True the invalid rows are reported and the rest written.
"""
from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from bench.store.db import DEFAULT_WAIT_S, FILTER_COLUMNS, connect, filter_clause, incoming_runs, load_sql
from bench.store.rows import COLUMN_NAMES, COLUMNS
from bench.store.validate import parse_json_text, validate_row

MAX_FILE_BYTES = 512 * 2**20          # 512 MiB per input file
MAX_LINE_BYTES = 4 * 2**20            # one JSONL line / CSV record: three 256 KiB JSON columns, escaped, fit
MAX_PARQUET_UNCOMPRESSED_BYTES = 4 * 2**30  # what the footer says the columns expand to (guards zip bombs)
MAX_ERRORS_PER_FILE = 1000            # report this many rejected lines per file, then a count
CHUNK_ROWS = 50_000                   # validated rows held as Python dicts before becoming Arrow columns
FORMATS = ("parquet", "csv", "jsonl")
EXPORT_FILTER_COLUMNS = tuple(c for c in FILTER_COLUMNS if c in COLUMN_NAMES)

_ARROW_TYPES = {"text": pa.string(), "int": pa.int64(), "bytes": pa.int64(), "float": pa.float64(),
                "bool": pa.bool_(), "json": pa.string(), "timestamp": pa.timestamp("us")}
ARROW_SCHEMA = pa.schema([pa.field(c.name, _ARROW_TYPES[c.kind], nullable=not c.required) for c in COLUMNS])


class IngestError(ValueError):
    """A whole file cannot be read (missing, too large, unknown format, unreadable header)."""


@dataclass(frozen=True)
class RawRow:
    line: int                 # 1-based line in the file (JSONL, CSV), or row number (Parquet)
    data: dict | None         # column -> value as read; None when the line could not be parsed
    error: str = ""           # why it could not be parsed


@dataclass(frozen=True)
class IngestReport:
    inserted: int                               # rows written
    duplicates: int                             # rows skipped: run_id already stored or repeated in the file
    rejected: tuple[tuple[str, int, str], ...]  # (file, line, reason); line 0 = the whole file
    n_rejected: int                             # invalid rows (may exceed len(rejected), which is capped)
    written: bool                               # False when an invalid row stopped the whole ingest


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise IngestError(f"no such file: {path}")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise IngestError(f"{size} bytes; at most {MAX_FILE_BYTES} ({MAX_FILE_BYTES // 2**20} MiB) per file")


def _file_format(path: Path) -> str:
    suffix = path.suffix.lower()
    fmt = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}.get(suffix)
    if fmt is None:
        raise IngestError(f"unknown file type {suffix!r}; use .jsonl, .csv or .parquet")
    return fmt


def _check_header(names: list[str]) -> None:
    unknown = [n for n in names if n not in COLUMN_NAMES]
    if unknown:
        shown = ", ".join(repr(n[:40]) for n in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise IngestError(f"unknown column(s) {shown}; allowed columns are those of bench.store.rows.COLUMNS")
    if len(set(names)) != len(names):
        raise IngestError("header repeats a column name")


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    with open(path, "rb") as f:
        line_no = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            line_no += 1
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # skip the rest of the over-long line
                    line = f.readline(2**20)
                yield RawRow(line_no, None, f"line longer than {MAX_LINE_BYTES} bytes")
                continue
            if not line.strip():
                continue
            try:
                data = parse_json_text(line.decode("utf-8"))
            except UnicodeDecodeError:
                yield RawRow(line_no, None, "not UTF-8 text")
                continue
            except json.JSONDecodeError as e:
                yield RawRow(line_no, None, f"malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})")
                continue
            except (ValueError, RecursionError) as e:
                yield RawRow(line_no, None, f"malformed JSON ({str(e)[:80] or 'nested too deeply'})")
                continue
            if not isinstance(data, dict):
                yield RawRow(line_no, None, f"must be a JSON object of column: value, got {type(data).__name__}")
                continue
            yield RawRow(line_no, data)


def _read_csv(path: Path) -> Iterator[RawRow]:
    csv.field_size_limit(MAX_LINE_BYTES)
    with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: tolerate the BOM spreadsheets write
        reader = csv.reader(f, strict=True)
        try:
            header = next(reader, None)
            if header is None:
                return
            _check_header(header)
            for rec in reader:
                if not rec:  # a blank line
                    continue
                if len(rec) != len(header):
                    yield RawRow(reader.line_num, None, f"{len(rec)} fields; the header has {len(header)}")
                else:
                    yield RawRow(reader.line_num, dict(zip(header, rec)))
        except (csv.Error, UnicodeDecodeError) as e:
            # After a CSV syntax error the reader's position is unreliable: stop this file here.
            yield RawRow(reader.line_num + 1, None, f"unreadable CSV: {str(e)[:80]}")


def _read_parquet(path: Path) -> Iterator[RawRow]:
    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
    except (pa.ArrowException, OSError) as e:
        raise IngestError(f"not a readable Parquet file ({str(e)[:80]})") from None
    _check_header(list(pf.schema_arrow.names))
    expanded = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if expanded > MAX_PARQUET_UNCOMPRESSED_BYTES:
        raise IngestError(f"columns expand to {expanded} bytes; at most {MAX_PARQUET_UNCOMPRESSED_BYTES}")
    row_no = 0
    try:
        for batch in pf.iter_batches(batch_size=CHUNK_ROWS):
            for rec in batch.to_pylist():
                row_no += 1
                yield RawRow(row_no, rec)
    except (pa.ArrowException, OSError) as e:
        yield RawRow(row_no + 1, None, f"unreadable Parquet data ({str(e)[:80]})")


def read_rows(path: str | Path) -> Iterator[RawRow]:
    """Parse a .jsonl / .csv / .parquet file into RawRows. Raises IngestError if the file as a whole is unusable."""
    path = Path(path)
    reader = {"jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet}[_file_format(path)]
    _check_file(path)
    return reader(path)


def _to_arrow(rows: list[dict]) -> pa.Table:
    return pa.table({name: [r[name] for r in rows] for name in COLUMN_NAMES}, schema=ARROW_SCHEMA)


@dataclass(frozen=True)
class _Prepared:
    label: str
    table: pa.Table | None    # the valid, de-duplicated rows (None when nothing is to be written)
    in_file_duplicates: int
    rejected: list
    n_rejected: int


def prepare_rows(label: str, raw_rows: Iterable[RawRow], keep_valid: bool) -> _Prepared:
    """Validate rows; collect the valid unique ones as Arrow (unless an error means they will not be kept)."""
    seen, chunk, batches, rejected = set(), [], [], []
    duplicates = n_rejected = 0
    for raw in raw_rows:
        row, errors = (None, [raw.error]) if raw.error else validate_row(raw.data)
        if errors:
            n_rejected += 1
            if len(rejected) < MAX_ERRORS_PER_FILE:
                rejected.append((label, raw.line, "; ".join(errors)))
            continue
        if row["run_id"] in seen:
            duplicates += 1
            continue
        seen.add(row["run_id"])
        if keep_valid or not n_rejected:
            chunk.append(row)
            if len(chunk) >= CHUNK_ROWS:
                batches.append(_to_arrow(chunk))
                chunk = []
    if n_rejected > len(rejected):
        rejected.append((label, 0, f"... and {n_rejected - len(rejected)} more rejected rows"))
    if n_rejected and not keep_valid:
        return _Prepared(label, None, duplicates, rejected, n_rejected)
    batches.append(_to_arrow(chunk))
    return _Prepared(label, pa.concat_tables(batches), duplicates, rejected, n_rejected)


def _write(prepared: list[_Prepared], db_path, wait_s: float, replace: bool = False) -> int:
    """Insert each prepared table in its own transaction; returns rows inserted. With `replace`, stored traced
    rows with an incoming traced row's run_id are deleted first, in the same transaction."""
    inserted = 0
    with connect(db_path, read_only=False, wait_s=wait_s) as con:
        for p in prepared:
            if p.table is None or p.table.num_rows == 0:
                continue
            with incoming_runs(con, p.table):
                if replace:
                    con.execute(load_sql("delete_replaced_runs"))
                inserted += con.execute(load_sql("insert_runs")).fetchone()[0]
    return inserted


def _finish(prepared: list[_Prepared], db_path, skip_invalid: bool, wait_s: float,
            replace: bool = False) -> IngestReport:
    rejected = tuple(r for p in prepared for r in p.rejected)
    n_rejected = sum(p.n_rejected for p in prepared)
    if n_rejected and not skip_invalid:
        return IngestReport(0, 0, rejected, n_rejected, written=False)
    to_insert = sum(p.table.num_rows for p in prepared if p.table is not None)
    inserted = _write(prepared, db_path, wait_s, replace)
    duplicates = sum(p.in_file_duplicates for p in prepared) + (to_insert - inserted)
    return IngestReport(inserted, duplicates, rejected, n_rejected, written=True)


def ingest_files(paths: Iterable[str | Path], db_path=None, skip_invalid: bool = False,
                 wait_s: float = DEFAULT_WAIT_S, replace: bool = False) -> IngestReport:
    """Validate every file, then write each (one transaction per file). See the module docstring. `replace`:
    an incoming traced row replaces the stored traced row of the same run_id (a re-trace)."""
    prepared = []
    for path in paths:
        try:
            prepared.append(prepare_rows(str(path), read_rows(path), keep_valid=skip_invalid))
        except (IngestError, OSError) as e:  # the whole file is unusable: one rejection, line 0
            prepared.append(_Prepared(str(path), None, 0, [(str(path), 0, str(e))], 1))
    return _finish(prepared, db_path, skip_invalid, wait_s, replace)


def ingest_rows(rows: Iterable[dict], db_path=None, label: str = "<rows>", skip_invalid: bool = False,
                wait_s: float = DEFAULT_WAIT_S) -> IngestReport:
    """Validate and insert in-memory rows (e.g. from `trace` / `measure`) as one transaction."""
    raw = (RawRow(i, r) for i, r in enumerate(rows, start=1))
    return _finish([prepare_rows(label, raw, keep_valid=skip_invalid)], db_path, skip_invalid, wait_s)


def _export_table(db_path, filters: dict | None, wait_s: float) -> pa.Table:
    clause, params = filter_clause(filters, EXPORT_FILTER_COLUMNS)
    sql = load_sql("export_runs").replace("/*filters*/", clause)
    with connect(db_path, read_only=True, wait_s=wait_s) as con:
        return con.sql(sql, params=params).to_arrow_table()


def _write_jsonl(table: pa.Table, out) -> None:
    json_cols = [c.name for c in COLUMNS if c.kind == "json"]
    for batch in table.to_batches(max_chunksize=CHUNK_ROWS):
        for rec in batch.to_pylist():
            for name in json_cols:  # embed JSON columns as JSON, not as strings of JSON
                if rec[name] is not None:
                    rec[name] = json.loads(rec[name])
            rec["created_at"] = rec["created_at"].isoformat()
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")


def export(db_path, out_path: str | Path, fmt: str, filters: dict | None = None,
           wait_s: float = DEFAULT_WAIT_S) -> int:
    """Write the runs matching `filters` to out_path as parquet, csv or jsonl; returns the row count.

    The output holds exactly the `runs` columns, so it can be ingested again unchanged.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format: {fmt!r} not allowed; choose one of {', '.join(FORMATS)}")
    table = _export_table(db_path, filters, wait_s)
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    try:
        if fmt == "parquet":
            pq.write_table(table, tmp, compression="zstd")
        elif fmt == "csv":
            pacsv.write_csv(table, tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                _write_jsonl(table, f)
        os.replace(tmp, out_path)  # never leave a half-written export under the real name
    finally:
        tmp.unlink(missing_ok=True)
    return table.num_rows


__all__ = ["ARROW_SCHEMA", "FORMATS", "IngestError", "IngestReport", "RawRow", "export", "ingest_files",
           "ingest_rows", "read_rows"]
