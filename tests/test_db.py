"""The DuckDB schema, migrations, views and read helpers of bench/store/db.py."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from bench.store import db
from bench.store.ingest import ARROW_SCHEMA, ingest_rows
from bench.store.rows import COLUMNS, COLUMN_NAMES
from bench.store.validate import validate_row
from rowfactory import make_row

SQL_TYPES = {"text": "VARCHAR", "int": "BIGINT", "bytes": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN",
             "json": "JSON", "timestamp": "TIMESTAMP"}
SCHEMA_SQL = Path(db.__file__).with_name("schema.sql")


def schema_dump(path) -> dict:
    """Everything that defines the schema, from DuckDB's catalog (not from our SQL text)."""
    with duckdb.connect(str(path), read_only=True) as con:
        q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
        return {
            "tables": q("SELECT table_name, table_type FROM information_schema.tables ORDER BY ALL"),
            "columns": q("SELECT table_name, ordinal_position, column_name, data_type, is_nullable, column_default "
                         "FROM information_schema.columns ORDER BY table_name, ordinal_position"),
            "constraints": q("SELECT table_name, constraint_type, constraint_text FROM duckdb_constraints() "
                             "ORDER BY ALL"),
            "views": q("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal ORDER BY view_name"),
            "indexes": q("SELECT index_name, table_name, sql FROM duckdb_indexes() ORDER BY ALL"),
        }


def applied_versions(path) -> list[int]:
    with duckdb.connect(str(path), read_only=True) as con:
        return [v for (v,) in con.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()]


@pytest.fixture
def fresh_db(tmp_path) -> Path:
    path = tmp_path / "fresh.duckdb"
    with db.connect(path):
        pass
    return path


def test_runs_columns_equal_rows_columns_in_order_and_type(fresh_db):
    with duckdb.connect(str(fresh_db), read_only=True) as con:
        got = con.execute("SELECT column_name, data_type, is_nullable FROM information_schema.columns "
                          "WHERE table_name = 'runs' ORDER BY ordinal_position").fetchall()
    assert tuple(name for name, _, _ in got) == COLUMN_NAMES
    expected = [(c.name, SQL_TYPES[c.kind], "NO" if c.required else "YES") for c in COLUMNS]
    assert got == expected


def test_at_least_two_migrations_and_head_recorded(fresh_db):
    assert db.HEAD_VERSION >= 2
    assert applied_versions(fresh_db) == list(range(1, db.HEAD_VERSION + 1))


def test_db_migrated_from_001_equals_fresh_db(tmp_path, fresh_db):
    old = tmp_path / "old.duckdb"
    row, errors = validate_row(make_row())
    assert errors == []
    with duckdb.connect(str(old)) as con:
        assert db.migrate(con, upto=1) == [1]
        # a row stored under the old schema must survive the upgrade
        old_columns = [name for (name,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'runs'").fetchall()]
        # the row as the old schema knew it: the columns later migrations added did not exist yet
        incoming = pa.Table.from_pylist([row], schema=ARROW_SCHEMA).select(old_columns)  # noqa: F841
        con.execute("INSERT INTO runs BY NAME SELECT * FROM incoming")
    assert applied_versions(old) == [1]
    assert schema_dump(old) != schema_dump(fresh_db)
    with db.connect(old):  # opening for write migrates to head
        pass
    assert applied_versions(old) == applied_versions(fresh_db)
    assert schema_dump(old) == schema_dump(fresh_db)
    assert db.count_runs(old) == 1


def test_schema_sql_describes_the_migrated_schema(tmp_path, fresh_db):
    documented = tmp_path / "documented.duckdb"
    with duckdb.connect(str(documented)) as con:
        con.execute(SCHEMA_SQL.read_text())
    assert schema_dump(documented) == schema_dump(fresh_db)


def test_migrations_are_idempotent(fresh_db):
    before = schema_dump(fresh_db)
    with duckdb.connect(str(fresh_db)) as con:
        assert db.migrate(con) == []
    assert schema_dump(fresh_db) == before
    assert applied_versions(fresh_db) == list(range(1, db.HEAD_VERSION + 1))


def test_failed_migration_is_rolled_back_whole(tmp_path, monkeypatch, fresh_db):
    migrations = tmp_path / "migrations"
    migrations.mkdir()
    for _, _, path in db.migration_files():
        (migrations / path.name).write_text(path.read_text())
    bad = f"{db.HEAD_VERSION + 1:03d}_broken.sql"
    (migrations / bad).write_text("CREATE TABLE half_done (a INTEGER);\nCREATE TABLE runs (a INTEGER);\n")
    monkeypatch.setattr(db, "MIGRATIONS_DIR", migrations)
    before = schema_dump(fresh_db)
    with pytest.raises(duckdb.CatalogException):
        with db.connect(fresh_db):
            pass
    assert schema_dump(fresh_db) == before  # half_done was not left behind
    assert applied_versions(fresh_db) == list(range(1, db.HEAD_VERSION + 1))


def test_reader_of_missing_db_gets_an_empty_migrated_one(tmp_path):
    path = tmp_path / "sub" / "new.duckdb"
    assert db.query_df("summary", db_path=path).empty
    assert applied_versions(path) == list(range(1, db.HEAD_VERSION + 1))


def test_default_db_path_honours_env(monkeypatch, tmp_path):
    monkeypatch.delenv("WILLITFIT_DB", raising=False)
    assert db.default_db_path() == db.REPO_DIR / "data" / "benchmarks.duckdb"
    monkeypatch.setenv("WILLITFIT_DB", str(tmp_path / "x.duckdb"))
    assert db.default_db_path() == tmp_path / "x.duckdb"


@pytest.fixture
def filled_db(tmp_path) -> Path:
    path = tmp_path / "filled.duckdb"
    rows = [make_row(batch=1, peak_alloc_bytes=3 * 2**30, peak_reserved_bytes=4 * 2**30),
            make_row(batch=2, model_name="tiny-qwen", model_type="qwen2_moe"),
            make_row(batch=3, source="measured", gpu_name="NVIDIA H100 80GB HBM3", oom=True,
                     oom_stage="backward", gpu_total_bytes=85_520_809_984)]
    assert ingest_rows(rows, path).inserted == 3
    return path


def test_v_runs_gib_columns_and_family(filled_db):
    df = db.fetch_runs({"batch": 1}, filled_db)
    assert len(df) == 1
    assert df.loc[0, "peak_alloc_gib"] == 3.0      # 3 * 2**30 bytes / 2**30
    assert df.loc[0, "peak_reserved_gib"] == 4.0
    assert df.loc[0, "family"] == "llama"
    assert db.fetch_runs({"batch": 2}, filled_db).loc[0, "family"] == "moe"  # qwen2_moe -> moe (FAMILIES)
    measured = db.fetch_runs({"source": "measured"}, filled_db)
    assert measured.loc[0, "gpu_total_gib"] == 85_520_809_984 / 2**30  # 79.65 GiB: the "80 GB" H100


def test_v_summary_counts(filled_db):
    df = db.query_df("summary", db_path=filled_db)
    assert df["n_runs"].sum() == 3
    key = df.set_index(["source", "model_name", "oom"])["n_runs"]
    assert key[("traced", "tiny-llama", False)] == 1
    assert key[("measured", "tiny-llama", True)] == 1


def test_fetch_runs_filters_are_bound_and_whitelisted(filled_db):
    assert set(db.fetch_runs({"batch": [1, 3]}, filled_db)["batch"]) == {1, 3}
    assert len(db.fetch_runs({"batch": [], "source": None}, filled_db)) == 3  # empty = no filter
    assert len(db.fetch_runs({"model_name": "tiny-llama' OR '1'='1"}, filled_db)) == 0
    assert len(db.fetch_runs(None, filled_db, limit=2)) == 2
    with pytest.raises(ValueError, match="filters: unknown column 'batch; DROP TABLE runs'"):
        db.fetch_runs({"batch; DROP TABLE runs": 1}, filled_db)
    with pytest.raises(ValueError, match="limit"):
        db.fetch_runs(None, filled_db, limit=-1)
    assert db.count_runs(filled_db) == 3


def test_get_run_and_query_by_path(filled_db):
    row = make_row(batch=1)
    got = db.get_run(row["run_id"], filled_db)
    assert got["batch"] == 1 and got["model_name"] == "tiny-llama"
    assert db.get_run("0" * 64, filled_db) is None
    df = db.query_df(Path(db.QUERIES_DIR) / "run_detail.sql", [row["run_id"]], filled_db)
    assert list(df["run_id"]) == [row["run_id"]]


def test_load_sql_refuses_paths_that_are_not_sql(tmp_path):
    (tmp_path / "x.txt").write_text("SELECT 1")
    with pytest.raises(ValueError, match="sql:"):
        db.load_sql(tmp_path / "x.txt")
    with pytest.raises(ValueError, match="sql:"):
        db.load_sql("../schema")


def test_fingerprint_changes_when_a_writer_commits(filled_db, tmp_path):
    assert db.db_fingerprint(tmp_path / "absent.duckdb") == (0, 0)
    before = db.db_fingerprint(filled_db)
    assert ingest_rows([make_row(batch=9)], filled_db).inserted == 1
    assert db.db_fingerprint(filled_db) != before


def test_calibrations_latest_per_key(tmp_path):
    path = tmp_path / "cal.duckdb"
    base = dict(architecture="llama", n_points=2, run_ids=("a" * 64, "b" * 64), method="ols", attention="sdpa",
                checkpointing="none")
    old = db.Calibration(k=1.0, created_at=datetime(2025, 1, 1), **base)
    new = db.Calibration(k=2.0, k_ci_low=1.5, k_ci_high=2.5, r2=0.99, residual_std_bytes=1.5e6,
                         params={"context_bytes": 536_870_912}, created_at=datetime(2025, 2, 1), **base)
    other = db.Calibration(k=3.0, created_at=datetime(2024, 1, 1), **{**base, "attention": "eager"})
    ids = {db.insert_calibration(c, path) for c in (old, new, other)}
    assert len(ids) == 3
    assert db.insert_calibration(new, path) in ids  # storing the identical record again is a no-op
    # ordered by architecture, attention: 'eager' before 'sdpa'; the Feb fit replaces the Jan one
    assert db.latest_calibrations(db_path=path) == [other, new]
    assert db.latest_calibrations("mistral", db_path=path) == []
    assert len(db.query_df("latest_calibrations", {"architecture": "llama"}, path)) == 2


@pytest.mark.parametrize("bad, message", [
    (dict(k=float("nan")), "k: must be a finite number"),
    (dict(attention="paged"), "attention: 'paged' not allowed; choose one of sdpa, flash, eager"),
    (dict(n_points=0), "n_points: must be an integer >= 1"),
    (dict(run_ids=()), "run_ids: must be a non-empty tuple"),
    (dict(k_ci_low=3.0, k_ci_high=4.0), r"k_ci_low: interval \[3.0, 4.0\] must contain k=1.0"),
    (dict(params={"x": float("inf")}), "params: must be JSON-serialisable"),
    (dict(architecture="llama; DROP"), "architecture: 'llama; DROP' is not a model_type"),
])
def test_calibration_validation(bad, message):
    fields = dict(architecture="llama", k=1.0, n_points=1, run_ids=("a",), method="ols")
    with pytest.raises(ValueError, match=message):
        db.Calibration(**{**fields, **bad})


def test_v_runs_family_matches_estimator_families(tmp_path):
    """The view's family column groups model types exactly as estimator.families.FAMILIES does."""
    from estimator.families import FAMILIES
    from tests.rowfactory import make_row

    from bench.store import ingest

    path = tmp_path / "fam.duckdb"
    rows = [make_row(model_type=mt, model_name=f"m-{mt}", batch=i + 1) for i, mt in enumerate(sorted(FAMILIES))]
    report = ingest.ingest_rows(rows, path)
    assert report.inserted == len(FAMILIES)
    with db.connect(path, read_only=True) as con:
        got = dict(con.execute("SELECT model_type, family FROM v_runs").fetchall())
    assert got == FAMILIES


def test_the_shipped_database_is_at_the_head_migration():
    """Opening the shipped file must not migrate it (a user's first start, or a test run, would change a tracked
    file): it is committed at the last migration."""
    import duckdb

    con = duckdb.connect(str(db.REPO_DIR / "data" / "benchmarks.duckdb"), read_only=True)
    try:
        assert db.schema_version(con) == len(db.migration_files())
    finally:
        con.close()
