"""Database reads for the Streamlit app, and the analytic numbers it shows beside stored runs.

No Streamlit here: the pages wrap these in `st.cache_data` keyed on `bench.store.db.db_fingerprint` (see
pages/_common.py), so this module is testable on its own. Every read opens a short-lived connection through
`bench.store.db` and closes it before returning (DuckDB allows one writer or many readers per file, never both).

A missing database is not an error: reads return empty frames and the pages say so, and nothing is created
on disk just by looking (bench.store.db.connect would create and migrate a missing file).
"""
from __future__ import annotations

import tempfile
from dataclasses import fields
from pathlib import Path

import pandas as pd

from bench.accuracy import calibrate

from bench.store import db
from bench.accuracy.calibrate import parallel_from_row, workload_from_row
from bench.store.ingest import export, read_rows
from bench.store.rows import config_hash
from bench.store.validate import validate_row
from estimator.estimate import Estimate, Options, estimate
from estimator.families import FAMILIES
from estimator.model import Model
from estimator.spec import Parallel, Workload
from bench.accuracy.published import COMPARED_WITH
from bench.published.importer import estimate_row

# Columns the Benchmarks page filters on; all are columns of `runs` (bench.store.db.FILTER_COLUMNS allows them).
BENCH_FILTERS = ("source", "metric", "gpu_name", "model_name", "mode", "method", "precision", "oom")
TABLE_LIMIT = 1_000        # rows the Benchmarks table shows; the download has them all
POINTS_LIMIT = 20_000      # points a chart draws (Vega-Lite in the browser slows down beyond this)
CLOSEST_LIMIT = 8
EXPORT_FORMATS = ("csv", "parquet")
# Columns of a stored run that decide its analytic estimate (bench.accuracy.calibrate.workload_from_row/parallel_from_row).
SPEC_COLUMNS = (*(f.name for f in fields(Workload)), "strategy", "world_size")
# Columns of `runs` the app's queries may filter on; names only ever come from this tuple (bench.store.db.filter_clause).
APP_FILTER_COLUMNS = tuple(c for c in db.FILTER_COLUMNS if c != "family") + ("grad_accum", "gen_tokens", "lora_rank")


def db_exists(db_path: str | Path) -> bool:
    return Path(db_path).is_file()


def _filtered(sql_name: str, filters: dict | None, allowed: tuple[str, ...] = APP_FILTER_COLUMNS) -> tuple[str, list]:
    clause, params = db.filter_clause(filters, allowed)
    return db.load_sql(sql_name).replace("/*filters*/", clause), params


def _read(sql: str, params, db_path: str | Path) -> pd.DataFrame:
    with db.connect(db_path, read_only=True) as con:
        return con.execute(sql, params).df()


def count_runs(db_path: str | Path) -> int:
    return db.count_runs(db_path) if db_exists(db_path) else 0


def filter_values(db_path: str | Path) -> dict[str, list]:
    """{column: [distinct values]} for the Benchmarks filters (oom is always [False, True])."""
    out: dict[str, list] = {c: [] for c in BENCH_FILTERS}
    out["oom"] = [False, True]
    if not db_exists(db_path):
        return out
    df = db.query_df("app_filter_values", None, db_path)
    for col, group in df.groupby("col"):
        out[col] = sorted(group["value"].tolist())
    return out


def published_estimates(db_path: str | Path, run_ids: tuple[str, ...]) -> dict[str, int]:
    """{run_id: the estimator's bytes for the published number's metric} of the given published runs (shipped
    profiles only; bench/accuracy/published.py decides which estimate a metric is compared with)."""
    if not db_exists(db_path) or not run_ids:
        return {}

    df = db.query_df("published_runs", None, db_path)
    out = {}
    for row in df[df["run_id"].isin(run_ids)].to_dict("records"):
        est = estimate_row(row)
        col = COMPARED_WITH.get(row["metric"])
        if est is not None and col and est.get(col) is not None:
            out[row["run_id"]] = int(est[col])
    return out


def counts(db_path: str | Path, filters: dict | None = None) -> pd.DataFrame:
    """Runs, OOMs, GPUs, models per source among the filtered runs."""
    if not db_exists(db_path):
        return pd.DataFrame(columns=["source", "n_runs", "n_oom", "n_gpus", "n_models", "last_created_at"])
    sql, params = _filtered("app_counts", filters)
    return _read(sql, params, db_path)


def runs_table(db_path: str | Path, filters: dict | None = None, limit: int = TABLE_LIMIT) -> pd.DataFrame:
    """The newest `limit` filtered runs, display columns only (sizes in GiB, GiB = 2**30 bytes)."""
    if not db_exists(db_path):
        return pd.DataFrame()
    sql, params = _filtered("app_runs_table", filters)
    return _read(sql, [*params, limit], db_path)


def run_detail(db_path: str | Path, run_id: str) -> dict | None:
    """Every column of one run (provenance, config JSON, per-stage peaks), or None."""
    if not db_exists(db_path):
        return None
    return db.get_run(run_id, db_path)


def export_bytes(db_path: str | Path, filters: dict | None, fmt: str) -> bytes:
    """The filtered runs as a CSV or Parquet file (every `runs` column, so it can be ingested again)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format: {fmt!r} not allowed; choose one of {', '.join(EXPORT_FORMATS)}")
    with tempfile.TemporaryDirectory(prefix="willitfit-export-") as tmp:
        out = Path(tmp) / f"runs.{fmt}"
        export(db_path, out, fmt, filters)
        return out.read_bytes()


def model_match(config: dict, model_name: str | None) -> tuple[str, str | None]:
    """(config_hash, preset name) identifying a model's rows; a custom config matches by hash only."""
    return config_hash(config), model_name


def closest_runs(db_path: str | Path, config: dict, model_name: str | None, workload: Workload,
                 parallel: Parallel, limit: int = CLOSEST_LIMIT,
                 sources: tuple[str, ...] = ("measured", "traced")) -> pd.DataFrame:
    """Runs of this model from `sources` nearest to `workload` (see bench/store/queries/app_closest_runs.sql)."""
    if not db_exists(db_path):
        return pd.DataFrame()
    chash, name = model_match(config, model_name)
    params = {
        "config_hash": chash, "model_name": name, "mode": workload.mode, "method": workload.method,
        "recipe": workload.recipe, "precision": workload.precision, "weight_format": workload.weight_format,
        "optimizer": workload.optimizer, "checkpointing": workload.checkpointing, "attention": workload.attention,
        "strategy": parallel.strategy, "batch": workload.batch, "seq": workload.seq, "gpus": parallel.gpus,
        "limit": limit, "sources": list(sources),
    }
    return db.query_df("app_closest_runs", params, db_path)


def points(db_path: str | Path, config: dict, model_name: str | None, batch: int, seq: int,
           filters: dict | None = None, limit: int = POINTS_LIMIT) -> pd.DataFrame:
    """Measured and traced runs of this model with this batch or this seq (the two curves through a
    workload), matching `filters` (columns of `runs`), for charts."""
    if not db_exists(db_path):
        return pd.DataFrame()
    chash, name = model_match(config, model_name)
    sql, params = _filtered("app_points", filters)
    return _read(sql, [chash, name, batch, seq, *params, limit], db_path)


def comparable_allocated_bytes(est: Estimate, source: str) -> int:
    """The analytic number to set beside a run's peak_alloc_bytes.

    A GPU run's torch.cuda.max_memory_allocated includes the cuBLAS workspace (allocated through the caching
    allocator); a traced run on fake CPU tensors never allocates it (same rule as bench.accuracy.calibrate).
    """
    return est.allocated_bytes - (est.allocator_overhead_bytes if source == "traced" else 0)


def _estimate_or_none(model: Model, key, options: Options) -> Estimate | None:
    """The estimate for a stored run's (workload, parallel), or None when the row's settings do not apply to
    this model (e.g. LoRA targets it lacks) or contradict each other."""
    if key is None:
        return None
    try:
        return estimate(model, *key, options)
    except ValueError:
        return None


def with_estimates(df: pd.DataFrame, model: Model, options: Options = Options(derive=False)) -> pd.DataFrame:
    """Add the analytic numbers for each run's own settings beside its measured/traced ones.

    Columns added (bytes): est_total_bytes (per-GPU peak incl. CUDA context, vs the GPU's memory) and
    est_allocated_bytes (what the run's peak_alloc_bytes should be: `comparable_allocated_bytes`), and
    rel_error = (peak_alloc_bytes - est_allocated_bytes) / est_allocated_bytes (NaN for OOM rows).
    """
    out = df.copy()
    if out.empty:
        return out.assign(est_total_bytes=pd.Series(dtype="Int64"), est_allocated_bytes=pd.Series(dtype="Int64"),
                          rel_error=pd.Series(dtype="Float64"))
    # Stored runs repeat settings (sources, GPUs, reruns): estimate each distinct setting once.
    keys = [c for c in SPEC_COLUMNS if c in out.columns]
    group = out.groupby(keys, dropna=False, sort=False).ngroup().to_numpy()
    first = pd.Series(range(len(out))).groupby(group).first()
    per_group = {}
    for g, i in first.items():
        row = out.iloc[i].to_dict()
        try:
            key = (workload_from_row(row), parallel_from_row(row))
        except (ValueError, TypeError, KeyError):
            key = None
        per_group[g] = _estimate_or_none(model, key, options)
    totals, allocated = [], []
    for g, source in zip(group, out["source"].astype(str) if "source" in out else [""] * len(out)):
        est = per_group[g]
        totals.append(est.total_bytes if est else None)
        allocated.append(comparable_allocated_bytes(est, source) if est else None)
    out["est_total_bytes"] = pd.array(totals, dtype="Int64")
    out["est_allocated_bytes"] = pd.array(allocated, dtype="Int64")
    measured = pd.to_numeric(out.get("peak_alloc_bytes"), errors="coerce").astype("Float64")
    rel = (measured - out["est_allocated_bytes"]) / out["est_allocated_bytes"]
    out["rel_error"] = rel.mask(out["oom"].astype(bool)) if "oom" in out else rel  # an OOM row has no full peak
    return out


# ---------------------------------------------------------------- calibration points

CALIBRATION_SAMPLE = 1_000   # runs the Calibrate page fits at most (python -m bench calibrate fits them all)


def calibration_filters(family: str, sources: tuple[str, ...]) -> dict:
    """The v_runs filters of bench.accuracy.calibrate.collect_points for one family (mode=train and no OOM are in the SQL)."""
    model_types = sorted(mt for mt, f in FAMILIES.items() if f == family)
    if not model_types:
        raise ValueError(f"family: {family!r} is not known; choose one of {', '.join(sorted(set(FAMILIES.values())))}")
    return {"source": list(sources), "model_type": model_types}


def count_calibration_runs(db_path: str | Path, family: str, sources: tuple[str, ...]) -> int:
    if not db_exists(db_path):
        return 0
    sql, params = _filtered("app_calibration_count", calibration_filters(family, sources), db.FILTER_COLUMNS)
    return int(_read(sql, params, db_path)["n_runs"].iloc[0])


def calibration_points(db_path: str | Path, family: str, sources: tuple[str, ...],
                       max_runs: int = CALIBRATION_SAMPLE) -> pd.DataFrame:
    """bench.accuracy.calibrate.collect_points for one family, on at most `max_runs` of its runs; the number of runs
    that match (sampled or not) is in `.attrs["n_runs"]`.

    With no more runs than that, this IS collect_points. Beyond it, the same per-row steps (bench.accuracy.calibrate's
    model_from_row, workload_from_row, parallel_from_row, activation_bytes_from_row) run on a fixed
    pseudo-random sample (bench/store/queries/app_calibration_runs.sql), so the page stays interactive on a
    database of millions of runs; the model is built once per distinct config.
    """
    if not db_exists(db_path):
        return _with_count(pd.DataFrame(columns=list(calibrate.POINT_COLUMNS)), 0)
    n_runs = count_calibration_runs(db_path, family, sources)
    if n_runs <= max_runs:
        return _with_count(calibrate.collect_points(db_path, family, sources, derive=False), n_runs)
    sql, params = _filtered("app_calibration_runs", calibration_filters(family, sources), db.FILTER_COLUMNS)
    runs = _read(sql, [*params, max_runs], db_path)
    models, points, skipped = {}, [], {}
    for row in runs.to_dict("records"):
        try:
            if row["config_hash"] not in models:
                models[row["config_hash"]] = calibrate.model_from_row(row)
            model = models[row["config_hash"]]
            workload, parallel = workload_from_row(row), parallel_from_row(row)
        except (ValueError, TypeError):
            skipped["config or workload"] = skipped.get("config or workload", 0) + 1
            continue
        point = calibrate.activation_bytes_from_row(row, model, workload, parallel, derive=False)
        if point is None:
            skipped["no activation stage"] = skipped.get("no activation stage", 0) + 1
            continue
        points.append({"run_id": row["run_id"], "source": row["source"], "family": model.family,
                       "model_name": row["model_name"], "model_type": model.model_type, "batch": workload.batch,
                       "seq": workload.seq, "attention": workload.attention, "checkpointing": workload.checkpointing,
                       **point})
    df = pd.DataFrame(points, columns=list(calibrate.POINT_COLUMNS))
    df.attrs["skipped"] = skipped
    return _with_count(df, n_runs)


def _with_count(df: pd.DataFrame, n_runs: int) -> pd.DataFrame:
    df.attrs["n_runs"] = n_runs
    return df


# ---------------------------------------------------------------- contributed files

REPORT_COLUMNS = ("line", "valid", "run_id", "source", "model_name", "gpu_name", "mode", "method", "batch", "seq",
                  "peak_alloc_bytes", "oom", "problems")
MAX_REPORT_ROWS = 10_000   # rows listed in a validation report (all rows are still counted and checked)


def validation_report(path: str | Path) -> tuple[pd.DataFrame, int, int]:
    """Check every row of a .jsonl/.csv/.parquet file exactly as `ingest_files` will; nothing is written.

    Returns (report of the first MAX_REPORT_ROWS rows, number of valid rows, number of invalid rows).
    Raises bench.store.ingest.IngestError when the file as a whole is unusable (size, type, header).
    """
    rows, n_valid, n_invalid = [], 0, 0
    for raw in read_rows(path):
        row, errors = (None, [raw.error]) if raw.error else validate_row(raw.data)
        n_valid += not errors
        n_invalid += bool(errors)
        if len(rows) < MAX_REPORT_ROWS:
            shown = row if row is not None else (raw.data or {})
            rows.append({c: shown.get(c) if isinstance(shown, dict) else None for c in REPORT_COLUMNS[2:-1]}
                        | {"line": raw.line, "valid": not errors, "problems": "; ".join(errors)})
    df = pd.DataFrame(rows, columns=list(REPORT_COLUMNS))
    for c in REPORT_COLUMNS[2:-1]:  # untrusted values of any JSON type: show them as text
        df[c] = df[c].map(lambda v: None if v is None else str(v))
    return df, n_valid, n_invalid


__all__ = ["APP_FILTER_COLUMNS", "BENCH_FILTERS", "CALIBRATION_SAMPLE", "EXPORT_FORMATS", "calibration_points",
           "closest_runs", "comparable_allocated_bytes", "count_calibration_runs", "count_runs", "counts", "db_exists", "export_bytes", "filter_values", "points",
           "run_detail", "runs_table", "validation_report", "with_estimates"]
