"""Validation, ingest and export: bad files get a clear error and leave the database untouched."""
from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.store import db

from bench.store import ingest
from bench.__main__ import main
from bench.store.rows import COLUMN_NAMES, MAX_NOTES
from bench.store.validate import validate_row
from rowfactory import make_row

REPO = Path(__file__).resolve().parent.parent


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:  # CSV carries every value as text; None becomes an empty cell
            w.writerow({k: "" if v is None else str(v).lower() if isinstance(v, bool) else v for k, v in r.items()})
    return path


def stored_rows(path: Path) -> list[tuple]:
    with db.connect(path, read_only=True) as con:
        return con.execute("SELECT * FROM runs ORDER BY run_id").fetchall()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def seeded_db(tmp_path) -> Path:
    """A database already holding three runs (batch 1..3)."""
    path = tmp_path / "seeded.duckdb"
    report = ingest.ingest_files([write_jsonl(tmp_path / "seed.jsonl", [make_row(batch=b) for b in (1, 2, 3)])], path)
    assert (report.inserted, report.duplicates, report.n_rejected) == (3, 0, 0)
    return path


# --- validate_row ----------------------------------------------------------------------------------

def test_valid_row_is_coerced_and_completed():
    raw = make_row()
    row, errors = validate_row(raw)
    assert errors == []
    assert list(row) == list(COLUMN_NAMES)
    assert row["created_at"] == datetime(2025, 1, 15, 12, 0)  # 'Z' converted to naive UTC
    assert row["run_id"] == raw["run_id"]
    del raw["run_id"]
    assert validate_row(raw)[0]["run_id"] == row["run_id"]  # computed when absent


def test_csv_strings_are_coerced():
    raw = {k: ("" if v is None else str(v)) for k, v in make_row().items()}
    raw["created_at"] = "2025-01-15T14:00:00+02:00"
    row, errors = validate_row(raw)
    assert errors == []
    assert row["batch"] == 1 and row["oom"] is False and row["peak_alloc_bytes"] == 2_500_000
    assert row["created_at"] == datetime(2025, 1, 15, 12, 0)
    assert row["lora_rank"] is None  # empty cell = missing


@pytest.mark.parametrize("overrides, message", [
    (dict(optimizer="adamx"), "optimizer: 'adamx' not allowed; choose one of adamw, adam,"),
    (dict(precision="fp12"), "precision: 'fp12' not allowed; choose one of bf16, fp16, fp32"),
    (dict(batch=2.5), "batch: must be an integer, got 2.5"),
    (dict(batch=True), "batch: must be an integer, got True"),
    (dict(seq="1e3"), "seq: must be an integer, got '1e3'"),
    (dict(peak_alloc_bytes=-1), "peak_alloc_bytes: -1 out of range; allowed 0..1125899906842624"),
    (dict(peak_alloc_bytes=2**51, peak_reserved_bytes=2**51), "peak_alloc_bytes: 2251799813685248 out of range"),
    (dict(model_name=None), "model_name: required; missing"),
    (dict(model_name=123), "model_name: must be text, got 123"),
    (dict(notes="x" * (MAX_NOTES + 1)), f"notes: {MAX_NOTES + 1} characters; at most {MAX_NOTES}"),
    (dict(config_json="[1, 2"), "config_json: not valid JSON"),
    (dict(config_json='"just a string"'), "config_json: must be a JSON object or array"),
    (dict(breakdown_json='{"a": NaN}'), "breakdown_json: not valid JSON (NaN is not valid JSON)"),
    (dict(created_at="yesterday"), "created_at: 'yesterday' is not an ISO-8601 time"),
    (dict(oom="maybe"), "oom: must be true or false"),
    (dict(step_time_s=float("inf")), "step_time_s: must be a finite number"),
    (dict(gpu_total_bytes=1_000_000), "peak_alloc_bytes: 2500000 exceeds gpu_total_bytes 1000000"),
    (dict(forward_peak_alloc_bytes=3_000_000), "forward_peak_alloc_bytes: 3000000 exceeds peak_alloc_bytes"),
    (dict(oom_stage="forward"), "oom_stage: set, but oom is false"),
    (dict(run_id="f" * 64), "run_id: 'ffffffffffffffffffffffffffffffffffff... does not match"),
    (dict(contributor="a\x00b"), "contributor: contains control characters"),
    (dict(alloc_conf="expandable_segments:Maybe"), "alloc_conf: expandable_segments: expected True or False"),
])
def test_invalid_fields_are_named(overrides, message):
    raw = make_row()
    raw.update(overrides)  # after make_row computed run_id, so only the run_id case tests the hash
    if "run_id" not in overrides:
        raw.pop("run_id")
    row, errors = validate_row(raw)
    assert row is None
    assert any(e.startswith(message) for e in errors), errors


def test_unknown_columns_are_named():
    row, errors = validate_row({**make_row(), "vram_gb": 80, "colour": "red"})
    assert row is None and errors == [
        "unknown column(s) 'vram_gb', 'colour'; allowed columns are those of bench.store.rows.COLUMNS"]


def test_oom_run_may_exceed_the_gpu():
    raw = make_row(oom=True, oom_stage="optimizer", gpu_total_bytes=1_000_000)
    assert validate_row(raw)[1] == []


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(COLUMN_NAMES + ("bogus",)), json_values, max_size=12))
def test_validate_row_never_raises_on_untrusted_input(overrides):
    row, errors = validate_row({**make_row(), **overrides})
    assert (row is None) == bool(errors)
    assert all(isinstance(e, str) and len(e) < 500 for e in errors)


@settings(max_examples=100, deadline=None)
@given(batch=st.integers(1, 2**20), seq=st.integers(1, 2**24), oom=st.booleans(),
       notes=st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=50),
       step_time_s=st.floats(0, 1e7, allow_nan=False))
def test_csv_text_of_a_row_validates_to_the_same_row(batch, seq, oom, notes, step_time_s):
    raw = make_row(batch=batch, seq=seq, oom=oom, notes=notes or None, step_time_s=step_time_s)
    as_csv = {k: "" if v is None else str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, float)
              else str(v) for k, v in raw.items()}
    assert validate_row(as_csv) == validate_row(raw)


# --- ingest: bad files change nothing ---------------------------------------------------------------

def _bad_line(tmp_path, content: str) -> Path:
    good = [json.dumps(make_row(batch=b)) for b in (10, 11)]
    return write_jsonl(tmp_path / "bad.jsonl", [good[0], content, good[1]])


@pytest.mark.parametrize("content, message", [
    ('{"run_id": "abc", "source": ', "malformed JSON (Expecting value at column"),
    ("[1, 2, 3]", "must be a JSON object of column: value, got list"),
    ('{"a": 1, "a": 2}', "malformed JSON (duplicate keys)"),
    (json.dumps(make_row(batch=12, peak_alloc_bytes=-4096)), "peak_alloc_bytes: -4096 out of range"),
    (json.dumps(make_row(batch=12, precision="fp12")), "precision: 'fp12' not allowed"),
    (json.dumps(make_row(batch=12, notes="n" * 100_000)), "notes: 100000 characters; at most 4096"),
    (json.dumps({**make_row(batch=12), "gpu_mem": 1}), "unknown column(s) 'gpu_mem'"),
])
def test_bad_jsonl_line_rejects_file_and_leaves_db_unchanged(tmp_path, seeded_db, content, message):
    before_rows, before_digest = stored_rows(seeded_db), file_digest(seeded_db)
    report = ingest.ingest_files([_bad_line(tmp_path, content)], seeded_db)
    assert not report.written and report.inserted == 0
    assert report.n_rejected == 1
    (file, line, reason), = report.rejected
    assert (Path(file).name, line) == ("bad.jsonl", 2)
    assert reason.startswith(message), reason
    assert file_digest(seeded_db) == before_digest  # byte-identical: the file was not even opened
    assert stored_rows(seeded_db) == before_rows


def test_over_long_line_is_rejected_without_reading_it_whole(tmp_path, seeded_db, monkeypatch):
    limit = len(json.dumps(make_row(batch=10))) + 100  # the good lines fit, a 4000-character note does not
    monkeypatch.setattr(ingest, "MAX_LINE_BYTES", limit)
    path = _bad_line(tmp_path, json.dumps(make_row(batch=12, notes="n" * 4000)))
    report = ingest.ingest_files([path], seeded_db)
    assert not report.written
    assert report.rejected == ((str(path), 2, f"line longer than {limit} bytes"),)


@pytest.mark.parametrize("name, content, message", [
    ("missing.jsonl", None, "no such file"),
    ("runs.txt", "x", "unknown file type '.txt'; use .jsonl, .csv or .parquet"),
    ("runs.parquet", "not parquet", "not a readable Parquet file"),
    ("runs.csv", "run_id,colour\nabc,red\n", "unknown column(s) 'colour'"),
])
def test_unusable_file_is_one_clear_error(tmp_path, seeded_db, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    before = file_digest(seeded_db)
    report = ingest.ingest_files([path], seeded_db)
    assert not report.written
    (file, line, reason), = report.rejected
    assert line == 0 and message in reason
    assert file_digest(seeded_db) == before


def test_file_size_is_bounded(tmp_path, seeded_db, monkeypatch):
    monkeypatch.setattr(ingest, "MAX_FILE_BYTES", 100)
    report = ingest.ingest_files([write_jsonl(tmp_path / "big.jsonl", [make_row(batch=20)])], seeded_db)
    assert not report.written and "bytes; at most 100" in report.rejected[0][2]


def test_one_bad_file_means_nothing_is_written(tmp_path, seeded_db):
    good = write_jsonl(tmp_path / "good.jsonl", [make_row(batch=30)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [make_row(batch=31, optimizer="adamx")])
    before = stored_rows(seeded_db)
    report = ingest.ingest_files([good, bad], seeded_db)
    assert not report.written
    assert stored_rows(seeded_db) == before


def test_duplicates_are_counted_not_rejected(tmp_path, seeded_db):
    rows = [make_row(batch=1), make_row(batch=40), make_row(batch=40), make_row(batch=41)]
    report = ingest.ingest_files([write_jsonl(tmp_path / "dups.jsonl", rows)], seeded_db)
    # batch=1 is already stored, the second batch=40 repeats the first
    assert (report.inserted, report.duplicates, report.n_rejected, report.written) == (2, 2, 0, True)
    assert db.count_runs(seeded_db) == 5


def test_skip_invalid_writes_the_valid_rows(tmp_path, seeded_db):
    rows = [make_row(batch=50), "{oops", make_row(batch=51, seq=0), make_row(batch=52)]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    report = ingest.ingest_files([path], seeded_db, skip_invalid=True)
    assert (report.inserted, report.duplicates, report.n_rejected, report.written) == (2, 0, 2, True)
    (_, line2, reason2), (_, line3, reason3) = report.rejected
    assert (line2, line3) == (2, 3)
    assert reason2.startswith("malformed JSON") and reason3.startswith("seq: 0 out of range; allowed 1..")
    assert db.count_runs(seeded_db) == 5


def test_duplicate_only_file_leaves_rows_unchanged(tmp_path, seeded_db):
    before = stored_rows(seeded_db)
    again = write_jsonl(tmp_path / "again.jsonl", [make_row(batch=b) for b in (3, 2, 1, 1)])
    report = ingest.ingest_files([again], seeded_db)
    assert (report.inserted, report.duplicates, report.n_rejected) == (0, 4, 0)
    assert stored_rows(seeded_db) == before


def test_bad_csv_and_parquet_rows_are_located(tmp_path, seeded_db):
    rows = [make_row(batch=70), make_row(batch=71, attention="paged"), make_row(batch=72)]
    bad_csv = write_csv(tmp_path / "bad.csv", rows)
    bad_csv.write_bytes(b"\xef\xbb\xbf" + bad_csv.read_bytes())  # a spreadsheet's BOM is tolerated
    valid = [validate_row(make_row(batch=b))[0] for b in (73, 74)]
    valid[1]["peak_alloc_bytes"] = -1
    pq.write_table(pa.Table.from_pylist(valid, schema=ingest.ARROW_SCHEMA), tmp_path / "bad.parquet")
    before = file_digest(seeded_db)
    report = ingest.ingest_files([bad_csv, tmp_path / "bad.parquet"], seeded_db)
    assert not report.written
    assert [(Path(f).name, line, reason.split(":")[0]) for f, line, reason in report.rejected] == [
        ("bad.csv", 3, "attention"), ("bad.parquet", 2, "peak_alloc_bytes")]
    assert file_digest(seeded_db) == before


def test_csv_and_parquet_happy_paths(tmp_path):
    path = tmp_path / "x.duckdb"
    csv_rows = [make_row(batch=b) for b in (1, 2)]
    report = ingest.ingest_files([write_csv(tmp_path / "runs.csv", csv_rows)], path)
    assert (report.inserted, report.n_rejected) == (2, 0)
    parquet_rows = [validate_row(make_row(batch=b))[0] for b in (2, 3, 4)]
    pq.write_table(pa.Table.from_pylist(parquet_rows, schema=ingest.ARROW_SCHEMA), tmp_path / "runs.parquet")
    report = ingest.ingest_files([tmp_path / "runs.parquet"], path)
    assert (report.inserted, report.duplicates, report.n_rejected) == (2, 1, 0)
    assert sorted(db.fetch_runs(None, path)["batch"]) == [1, 2, 3, 4]


@pytest.mark.parametrize("fmt", ingest.FORMATS)
def test_export_round_trip(tmp_path, fmt):
    src = tmp_path / "src.duckdb"
    rows = [make_row(batch=1), make_row(batch=2, source="measured", gpu_name="NVIDIA A100-SXM4-80GB",
                                        gpu_total_bytes=85_899_345_920, notes='quote " comma , newline\nend',
                                        step_time_s=0.125, lora_targets=None),
            make_row(batch=3, model_name="other", oom=True, oom_stage="forward", oom_message="CUDA out of memory")]
    assert ingest.ingest_rows(rows, src).inserted == 3
    out = tmp_path / f"runs.{fmt}"
    assert ingest.export(src, out, fmt) == 3
    dst = tmp_path / "dst.duckdb"
    report = ingest.ingest_files([out], dst)
    assert (report.inserted, report.n_rejected) == (3, 0)
    assert stored_rows(dst) == stored_rows(src)


def test_export_filters(tmp_path, seeded_db):
    ingest.ingest_rows([make_row(batch=7, source="measured"), make_row(batch=8, model_name="other")], seeded_db)
    out = tmp_path / "m.jsonl"
    assert ingest.export(seeded_db, out, "jsonl", {"source": ["measured"]}) == 1
    assert json.loads(out.read_text())["batch"] == 7
    assert ingest.export(seeded_db, out, "jsonl", {"model_name": ["other"], "source": None}) == 1
    with pytest.raises(ValueError, match="format: 'xlsx' not allowed"):
        ingest.export(seeded_db, out, "xlsx")


# --- CLI ----------------------------------------------------------------------------------------------

def test_cli_ingest_and_export(tmp_path, capsys):
    path = tmp_path / "cli.duckdb"
    runs = write_jsonl(tmp_path / "runs.jsonl", [make_row(batch=b) for b in (1, 2, 2)])
    assert main(["ingest", str(runs), "--db", str(path)]) == 0
    assert "inserted 2, duplicates 1, rejected 0" in capsys.readouterr().out
    out = tmp_path / "out.parquet"
    assert main(["export", "--format", "parquet", "--out", str(out), "--db", str(path), "--model", "tiny-llama"]) == 0
    assert "exported 2 run(s)" in capsys.readouterr().out
    assert pq.read_table(out).num_rows == 2


def test_cli_ingest_rejects_and_writes_nothing(tmp_path, seeded_db, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [make_row(batch=60), make_row(batch=61, optimizer="adamx"), "{"])
    before = file_digest(seeded_db)
    assert main(["ingest", str(bad), "--db", str(seeded_db)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"{bad}:2: optimizer: 'adamx' not allowed; choose one of adamw")
    assert err[1].startswith(f"{bad}:3: malformed JSON")
    assert "nothing written" in err[2]
    assert file_digest(seeded_db) == before
    assert main(["ingest", str(bad), "--db", str(seeded_db), "--skip-invalid"]) == 0
    assert "inserted 1, duplicates 0, rejected 2" in capsys.readouterr().out


def test_cli_ingest_of_a_missing_file_is_not_called_an_invalid_row(tmp_path, capsys):
    assert main(["ingest", str(tmp_path / "missing.jsonl"), "--db", str(tmp_path / "x.duckdb")]) == 2
    err = capsys.readouterr().err
    assert "1 file(s) could not be read; nothing written" in err and "invalid row" not in err


def test_a_malformed_json_column_is_reported_at_its_column():
    bad = '{"model_type": "llama", "x": "' + "y" * 170 + '", "hidden_size": 64,, "z": 1}'
    _, errors = validate_row({**make_row(), "config_json": bad})
    assert errors and f"at column {bad.index(',,') + 2}" in errors[0], errors


def test_cli_export_of_missing_db_is_an_error(tmp_path, capsys):
    assert main(["export", "--format", "csv", "--out", str(tmp_path / "o.csv"), "--db", str(tmp_path / "no.duckdb")]) == 2
    assert capsys.readouterr().err.startswith("db: no database at")


def test_cli_reports_a_file_that_is_not_a_database(tmp_path, capsys):
    not_db = tmp_path / "not.duckdb"
    not_db.write_text("hello")
    runs = write_jsonl(tmp_path / "runs.jsonl", [make_row()])
    assert main(["ingest", str(runs), "--db", str(not_db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"db: cannot write {not_db}")
    assert not_db.read_text() == "hello"


def test_failed_export_leaves_no_partial_file(tmp_path, seeded_db, capsys):
    out = tmp_path / "a_directory"  # the data is written to a_directory.tmp, then cannot replace a directory
    out.mkdir()
    assert main(["export", "--format", "csv", "--out", str(out), "--db", str(seeded_db)]) == 2
    assert capsys.readouterr().err.startswith(f"out: cannot write {out}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_directory", "seed.jsonl", "seeded.duckdb"]


def test_every_cli_option_has_help():
    import argparse
    from bench.commands import db as cmd_db
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cmd_db.register(sub)
    for name in ("ingest", "export"):
        for action in sub.choices[name]._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"


def test_python_m_bench_ingest_subprocess(tmp_path):
    path = tmp_path / "sub.duckdb"
    runs = write_jsonl(tmp_path / "runs.jsonl", [make_row(batch=b) for b in (1, 2)])
    done = subprocess.run([sys.executable, "-m", "bench", "ingest", str(runs), "--db", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "inserted 2, duplicates 0, rejected 0" in done.stdout
    assert db.count_runs(path) == 2
