"""bench.store.app_data (the app's reads), the URL-state fields and the chart builders, without running the app."""
from __future__ import annotations

import io
import json
import math

import pandas as pd
import pyarrow.parquet as pq
import pytest

from bench.store import app_data

from bench.accuracy import calibrate

from bench.store import db
from bench.accuracy.calibrate import parallel_from_row, workload_from_row
from bench.store.ingest import ingest_files
from estimator.estimate import estimate
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.spec import MAX_BATCH, Parallel, Workload
from pages import _charts as charts
from pages import _state as state, _inputs as ui
from rowfactory import make_row
from test_app_pages import MODEL, model_rows, write_jsonl


@pytest.fixture(scope="module")
def dbp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("appdata")
    path = tmp / "bench.duckdb"
    assert ingest_files([write_jsonl(tmp / "rows.jsonl", model_rows())], path).written
    return path


@pytest.fixture(scope="module")
def model():
    name, cfg = load_config(MODEL)
    return from_hf_config(cfg, name)


def test_missing_database_reads_are_empty_and_create_nothing(tmp_path):
    path = tmp_path / "none.duckdb"
    assert app_data.count_runs(path) == 0
    assert app_data.counts(path).empty and app_data.runs_table(path).empty
    assert app_data.filter_values(path)["source"] == []
    assert app_data.closest_runs(path, {}, None, Workload(), Parallel()).empty
    assert app_data.points(path, {}, None, 1, 1).empty and app_data.run_detail(path, "x") is None
    assert app_data.calibration_points(path, "llama", ("traced",)).empty
    assert app_data.count_calibration_runs(path, "llama", ("traced",)) == 0
    assert not path.exists()


def test_filters_counts_and_table_agree_with_fetch_runs(dbp):
    values = app_data.filter_values(dbp)
    assert values["source"] == ["measured", "traced"] and MODEL in values["model_name"]
    for filters in ({}, {"source": ["measured"]}, {"oom": True}, {"model_name": [MODEL], "precision": ["bf16"]}):
        expected = db.fetch_runs(filters, dbp, limit=None)
        assert app_data.counts(dbp, filters)["n_runs"].sum() == len(expected)
        table = app_data.runs_table(dbp, filters)
        assert sorted(table["run_id"]) == sorted(expected["run_id"])
        assert (table["peak_alloc_gib"].dropna() * 2**30).round().astype("int64").tolist() == \
            expected.set_index("run_id").loc[table.dropna(subset=["peak_alloc_gib"])["run_id"], "peak_alloc_bytes"].tolist()
    assert len(app_data.runs_table(dbp, {}, limit=3)) == 3
    with pytest.raises(ValueError, match="unknown column"):
        app_data.counts(dbp, {"notes; DROP TABLE runs": 1})


def test_export_round_trips_through_ingest(dbp, tmp_path):
    filters = {"source": ["measured"]}
    n = len(db.fetch_runs(filters, dbp, limit=None))
    table = pq.read_table(io.BytesIO(app_data.export_bytes(dbp, filters, "parquet")))
    assert table.num_rows == n
    csv = tmp_path / "runs.csv"
    csv.write_bytes(app_data.export_bytes(dbp, filters, "csv"))
    report = ingest_files([csv], tmp_path / "again.duckdb")
    assert report.written and report.inserted == n
    with pytest.raises(ValueError, match="format"):
        app_data.export_bytes(dbp, filters, "xlsx")


def test_closest_runs_put_the_exact_workload_first(dbp):
    _, cfg = load_config(MODEL)
    df = app_data.closest_runs(dbp, cfg, None, Workload(batch=4, seq=1024), Parallel())  # by config hash alone
    assert len(df) == app_data.CLOSEST_LIMIT
    assert set(df.iloc[:2][["batch", "seq"]].itertuples(index=False)) == {(4, 1024)}
    assert df.iloc[0]["n_differences"] == 0 and df.iloc[0]["doublings"] == 0
    assert list(df["doublings"]) == sorted(df["doublings"])
    assert app_data.closest_runs(dbp, {"model_type": "other"}, None, Workload(), Parallel()).empty


def test_with_estimates_calls_the_estimator_per_row(dbp, model):
    _, cfg = load_config(MODEL)
    pts = app_data.points(dbp, cfg, MODEL, 4, 1024, {"mode": "train"})
    assert {(r.batch == 4) or (r.seq == 1024) for r in pts.itertuples()} == {True}
    out = app_data.with_estimates(pts, model)
    for row in out.to_dict("records"):
        est = estimate(model, workload_from_row(row), parallel_from_row(row))
        assert row["est_total_bytes"] == est.total_bytes
        assert row["est_allocated_bytes"] == app_data.comparable_allocated_bytes(est, row["source"])
        if row["oom"]:
            assert pd.isna(row["rel_error"])
        else:
            assert math.isclose(row["rel_error"], row["peak_alloc_bytes"] / row["est_allocated_bytes"] - 1)
    bad = pd.DataFrame([{**pts.iloc[0].to_dict(), "method": "lora", "lora_targets": "no_such_module"}])
    assert pd.isna(app_data.with_estimates(bad, model)["est_total_bytes"].iloc[0])


def test_calibration_points_are_collect_points_or_a_sample_of_them(dbp):
    full = calibrate.collect_points(dbp, "llama", ("measured", "traced"))
    same = app_data.calibration_points(dbp, "llama", ("measured", "traced"))
    pd.testing.assert_frame_equal(same, full)
    assert app_data.count_calibration_runs(dbp, "llama", ("measured", "traced")) >= len(full)
    sample = app_data.calibration_points(dbp, "llama", ("measured", "traced"), max_runs=5)
    assert 0 < len(sample) <= 5
    by_id = full.set_index("run_id")
    for row in sample.to_dict("records"):
        assert row["y"] == by_id.loc[row["run_id"], "y"] and row["x"] == by_id.loc[row["run_id"], "x"]
    again = app_data.calibration_points(dbp, "llama", ("measured", "traced"), max_runs=5)
    assert again["run_id"].tolist() == sample["run_id"].tolist()  # the same sample every time
    with pytest.raises(ValueError, match="family"):
        app_data.calibration_points(dbp, "nope", ("traced",))


def test_validation_report_lists_every_row(tmp_path):
    rows = [make_row(batch=3), {**make_row(batch=4), "seq": -1}, "not json"]
    report, n_valid, n_invalid = app_data.validation_report(write_jsonl(tmp_path / "r.jsonl", rows))
    assert (n_valid, n_invalid) == (1, 2)
    assert report["valid"].tolist() == [True, False, False]
    assert "seq" in report["problems"].iloc[1] and "JSON" in report["problems"].iloc[2]


# ---------------------------------------------------------------- URL fields

@pytest.mark.parametrize("field, text, value", [
    (state.Field("batch", "int", 1, lo=1, hi=MAX_BATCH), "64", 64),
    (state.Field("mode", "choice", "train", ("train", "infer")), "infer", "infer"),
    (state.Field("calibrated", "bool", False), "true", True),
    (state.Field("calibrated", "bool", False), "0", False),
    (state.Field("lora_targets", "multi", ["q_proj"]), "q_proj,v_proj", ["q_proj", "v_proj"]),
    (state.Field("hf", "text", ""), "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"),
])
def test_url_fields_parse_and_dump_round_trip(field, text, value):
    assert field.parse(text) == value
    assert field.parse(field.dump(value)) == value


@pytest.mark.parametrize("field, text", [
    (state.Field("batch", "int", 1, lo=1, hi=MAX_BATCH), "0"),
    (state.Field("batch", "int", 1, lo=1, hi=MAX_BATCH), str(MAX_BATCH + 1)),
    (state.Field("batch", "int", 1, lo=1, hi=MAX_BATCH), "1e3"),
    (state.Field("batch", "int", 1, lo=1, hi=MAX_BATCH), "-4"),
    (state.Field("batch", "int", 1, lo=1, hi=MAX_BATCH), "²"),
    (state.Field("lora_targets", "multi", ["q_proj"]), "q_pröj"),
    (state.Field("mode", "choice", "train", ("train", "infer")), "TRAIN"),
    (state.Field("calibrated", "bool", False), "maybe"),
    (state.Field("lora_targets", "multi", ["q_proj"]), "q_proj,<script>"),
    (state.Field("hf", "text", ""), "x" * 201),
])
def test_url_fields_refuse_bad_values_naming_the_field(field, text):
    with pytest.raises(ValueError, match=f"^{field.name}:"):
        field.parse(text)


def test_workload_from_inputs_ignores_inputs_that_do_not_apply():
    values = {"mode": "infer", "method": "lora", "grad_accum": 8, "seq": 4096, "gen_tokens": 16, "batch": 2,
              "precision": "bf16", "weight_format": "auto", "attention": "sdpa", "kv_dtype": "fp8"}
    assert ui.workload_from_dict(values) == Workload(mode="infer", seq=4096, gen_tokens=16, batch=2, kv_dtype="fp8")
    with pytest.raises(ValueError, match="precision"):
        ui.workload_from_dict({"mode": "train", "method": "full", "recipe": "amp", "precision": "fp32"})


# ---------------------------------------------------------------- charts: valid Vega-Lite, units on the axes

def _axis_titles(spec) -> list[str]:
    found = []
    if isinstance(spec, dict):
        for k, v in spec.items():
            if k in ("x", "y") and isinstance(v, dict) and v.get("title"):
                found.append(v["title"])
            found += _axis_titles(v)
    elif isinstance(spec, list):
        for v in spec:
            found += _axis_titles(v)
    return found


def test_every_chart_is_valid_vega_lite_with_units_and_tooltips(model):
    est = estimate(model, Workload(batch=4), Parallel())
    cap = 80 * 2**30
    strategies = pd.DataFrame([{"strategy": s, "gpus": n, "component": "weights", "bytes": 2**30, "gib": 1.0,
                                "gb": 1.07} for s in ("ddp", "fsdp") for n in (1, 2)])
    traced = pd.DataFrame([{"strategy": "fsdp", "gpus": 2, "gib": 0.9, "gb": 0.97, "run_id": "r", "source": "traced"}])
    curve = pd.DataFrame([{"batch": b, "series": "estimate: total per GPU", "gib": b, "gb": b} for b in (1, 2)])
    pts = pd.DataFrame([{"batch": 1, "source": "measured", "gib": 1.0, "gb": 1.07, "oom": False, "run_id": "a",
                         "gpu_name": "g", "oom_stage": None},
                        {"batch": 2, "source": "measured", "gib": None, "gb": None, "oom": True, "run_id": "b",
                         "gpu_name": "g", "oom_stage": "forward"}])
    cal = pd.DataFrame([{"x_gib": 1.0, "y_gib": 2.0, "fitted_gib": 2.1, "resid_gib": -0.1, "resid_gb": -0.11,
                         "source": "traced", "model_name": "m", "batch": 1, "seq": 2, "run_id": "r"}])
    lines = pd.DataFrame([{"line": "k", "k": 2.0, "x_gib": 0.0, "y_gib": 0.0}])
    built = [charts.stages_chart(est.stages, cap, "GPU"), charts.peak_chart(est.components, "peak", cap, "GPU"),
             charts.strategy_chart(strategies, cap, "GPU", traced), charts.curve_chart(curve, pts, "batch", "Batch", cap, "GPU"),
             charts.calibration_chart(cal, lines), charts.residual_chart(cal)]
    for chart in built:
        spec = chart.to_dict()  # validates against the Vega-Lite schema
        titles = _axis_titles(spec)
        assert any("GiB" in t for t in titles), titles
        assert "tooltip" in json.dumps(spec)
