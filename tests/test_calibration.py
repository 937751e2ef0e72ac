"""Calibration of the activation constant k: the regression math, the points taken from run rows, the stored fit.

The math is checked on a hand-worked two-point fit, on noise-free data (exact), and on synthetic data with a
known k and a fixed seed (CI contains k; ~95% of new points fall in the prediction interval).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from bench.accuracy import calibrate

from bench.store import db
from bench.__main__ import main
from bench.store.ingest import ingest_files
from offline.calibration import fit_k, fit_residual, t_quantile
from estimator.estimate import estimate
from estimator.model import from_hf_config
from estimator.spec import Workload
from estimator.units import GiB, MiB
from rowfactory import TINY_LLAMA_CONFIG, make_row

# ------------------------------------------------------------------------------------------ the math


def test_two_point_fit_by_hand():
    # x = (1, 2), y = (1, 3): k = sum(xy)/sum(x^2) = (1 + 6)/(1 + 4) = 1.4
    # residuals (1 - 1.4, 3 - 2.8) = (-0.4, 0.2): SSE = 0.2, s = sqrt(0.2 / (n-1)) = sqrt(0.2)
    # se_k = s / sqrt(5) = 0.2; t_{0.975, 1} = 12.7062047...; uncentered R^2 = k^2 * 5 / (1 + 9) = 0.98
    fit = fit_k([1, 2], [1, 3])
    assert math.isclose(fit.k, 1.4, rel_tol=1e-12)
    assert math.isclose(fit.residual_std_bytes, math.sqrt(0.2), rel_tol=1e-12)
    assert math.isclose(fit.se_k, 0.2, rel_tol=1e-12)
    assert math.isclose(fit.t_value, 12.706204736174698, rel_tol=1e-9)
    assert math.isclose(fit.k_ci_low, 1.4 - 0.2 * 12.706204736174698, rel_tol=1e-9)
    assert math.isclose(fit.k_ci_high, 1.4 + 0.2 * 12.706204736174698, rel_tol=1e-9)
    assert math.isclose(fit.r2, 0.98, rel_tol=1e-12)
    # prediction at x0 = 3: 4.2 -/+ t * s * sqrt(1 + 9/5)
    low, high = fit.prediction_interval(3)
    half = 12.706204736174698 * math.sqrt(0.2) * math.sqrt(1 + 9 / 5)
    assert math.isclose(low, 4.2 - half, rel_tol=1e-9) and math.isclose(high, 4.2 + half, rel_tol=1e-9)


def test_t_quantile_reference_values():
    # Student t table (any regression text's appendix): t_{0.975, 10} = 2.228, t_{0.975, inf} -> 1.960
    assert math.isclose(t_quantile(0.975, 10), 2.2281388519649385, rel_tol=1e-9)
    assert math.isclose(t_quantile(0.975, 10**7), 1.959964, rel_tol=1e-5)


def test_noise_free_fit_is_exact():
    x = np.array([b * s * 4096 * 32 * 2 for b in (1, 2, 4, 8) for s in (512, 1024, 2048)], dtype=np.int64)
    fit = fit_k(x, 24 * x)
    assert math.isclose(fit.k, 24.0, rel_tol=1e-12)
    assert math.isclose(fit.r2, 1.0, rel_tol=1e-12)
    assert fit.residual_std_bytes < 1e-3  # bytes, on y values of ~1e11
    assert fit.k_ci_high - fit.k_ci_low < 1e-9


def test_known_k_recovered_within_its_interval():
    rng = np.random.default_rng(20250115)
    x = rng.uniform(0.1, 10.0, 200) * GiB
    y = 18.5 * x + rng.normal(0.0, 2.0 * GiB, x.size)
    fit = fit_k(x, y)
    assert fit.k_ci_low < 18.5 < fit.k_ci_high
    assert fit.k_ci_high - fit.k_ci_low < 0.5       # 200 points pin k down
    assert 1.8 * GiB < fit.residual_std_bytes < 2.2 * GiB  # recovers the noise level


def test_prediction_interval_covers_95_percent_of_new_points():
    # Unconditional coverage: many training sets of 12 points, one new point each (seeded, deterministic).
    rng = np.random.default_rng(7)
    inside, reps = 0, 2000
    for _ in range(reps):
        x = rng.uniform(1.0, 50.0, 12)
        fit = fit_k(x, 30.0 * x + rng.normal(0.0, 20.0, x.size))
        x0 = rng.uniform(1.0, 80.0)
        low, high = fit.prediction_interval(x0)
        inside += low <= 30.0 * x0 + rng.normal(0.0, 20.0) <= high
    assert 0.93 <= inside / reps <= 0.97     # binomial sd at 2000 draws: 0.5 percentage points
    mean_low, mean_high = fit.mean_interval(x0)
    assert low < mean_low < mean_high < high  # the mean is known better than one new observation


def test_fit_k_rejects_bad_input():
    with pytest.raises(ValueError, match="points"):
        fit_k([1.0], [2.0])
    with pytest.raises(ValueError, match="x:"):
        fit_k([1.0, 0.0], [2.0, 0.0])
    with pytest.raises(ValueError, match="level"):
        fit_k([1.0, 2.0], [2.0, 4.0], level=1.0)


def test_residual_fit_recovers_alpha_and_context():
    # A 95% interval misses 1 draw in 20 (seeds 3 and 4 here do); the seed is fixed so the test is deterministic.
    rng = np.random.default_rng(0)
    analytic = rng.uniform(1, 70, 60) * GiB
    exact = fit_residual(analytic, 1.04 * analytic + 520 * MiB)
    assert math.isclose(exact.alpha, 0.04, abs_tol=1e-9)
    assert math.isclose(exact.context_bytes, 520 * MiB, rel_tol=1e-6)
    noisy = fit_residual(analytic, 1.04 * analytic + 520 * MiB + rng.normal(0, 64 * MiB, analytic.size))
    assert noisy.alpha_ci_low < 0.04 < noisy.alpha_ci_high
    assert noisy.context_ci_low < 520 * MiB < noisy.context_ci_high
    assert 0.99 < noisy.r2 <= 1.0
    with pytest.raises(ValueError, match="analytic_allocated"):
        fit_residual([GiB] * 3, [2 * GiB] * 3)


# ------------------------------------------------------------------------------------------ points from run rows

TINY = from_hf_config(TINY_LLAMA_CONFIG, "tiny-llama")
H100 = "NVIDIA H100 80GB HBM3"


def predicted_row(source: str = "traced", stage_columns: bool = True, **workload) -> dict:
    """A run row whose peaks are exactly what estimate() predicts for the tiny Llama.

    A stage's allocated peak is its Breakdown total minus `overhead` (never allocated through torch), plus the
    cuBLAS workspace for a GPU run (allocated through the caching allocator; a traced run never sees it)."""
    w = Workload(**workload)
    est = estimate(TINY, w)
    workspace = est.allocator_overhead_bytes if source == "measured" else 0
    stage_peaks = {f"{name}_peak_alloc_bytes": b.tensor_bytes + workspace for name, b in est.stages}
    peak_stage = stage_peaks[f"{est.peak_stage}_peak_alloc_bytes"]
    assert peak_stage == est.allocated_bytes - est.allocator_overhead_bytes + workspace
    row = make_row(source=source, batch=w.batch, seq=w.seq, checkpointing=w.checkpointing, attention=w.attention,
                   gpu_name=H100 if source == "measured" else "fake-cpu",
                   peak_alloc_bytes=max(stage_peaks.values()),
                   **(stage_peaks if stage_columns else {f"{n}_peak_alloc_bytes": None for n, _ in est.stages}))
    return row


def build_db(path, rows):
    jsonl = path.parent / f"{path.stem}.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = ingest_files([jsonl], db_path=path)
    assert report.written and report.inserted == len(rows), report
    return path


CASES = [dict(batch=b, seq=s, checkpointing=c) for b in (1, 2) for s in (16, 128, 1024) for c in ("none", "full")]


def test_points_from_predicted_rows_give_back_the_detailed_activations(tmp_path):
    rows = [predicted_row(src, **case) for src in ("traced", "measured") for case in CASES]
    pts = calibrate.collect_points(build_db(tmp_path / "p.duckdb", rows))
    assert len(pts) == len(rows) and not pts.attrs["skipped"]
    assert (pts["y"] == pts["predicted_detailed"]).all()   # exact, to the byte
    # the detailed activations are the saved set: per-layer * L + head (activation_profile)
    assert (pts["predicted_detailed"] > 0).all()
    # x = b*s*h*L*bytes: h = 64, L = 2, bf16
    assert (pts["x"] == pts["batch"] * pts["seq"] * 64 * 2 * 2).all()
    # the forward stage is read whenever the row has it, wherever the step peaks (seq 16: in the optimizer)
    assert set(pts["stage"]) == {"forward"}


def test_row_without_stage_columns_uses_its_overall_peak_only_where_that_holds_activations(tmp_path):
    # A row with only its overall peak: usable when the estimator puts that peak in the forward stage (every
    # saved activation alive); here the step peaks in backward (seq 1024: the logits' gradients) or in the
    # optimizer step (seq 16), so neither row gives a point.
    rows = [predicted_row(stage_columns=False, batch=2, seq=1024), predicted_row(stage_columns=False, batch=2, seq=16)]
    pts = calibrate.collect_points(build_db(tmp_path / "s.duckdb", rows))
    assert pts.empty and pts.attrs["skipped"] == {"no activation stage": 2}
    with_forward = predicted_row(batch=2, seq=1024)   # the same run with its per-stage peaks: one point
    assert len(calibrate.collect_points(build_db(tmp_path / "t.duckdb", [with_forward]))) == 1


def test_collect_points_keeps_usable_training_rows_and_counts_the_rest(tmp_path):
    rows = [make_row(batch=b, seq=s) for b in (1, 2) for s in (128, 256)]
    rows += [make_row(batch=3, config={"model_type": "led", "d_model": 8}),  # a model_type not priced
             make_row(batch=3, config={"model_type": "llama", "hidden_size": "big"}),  # not a size
             make_row(batch=3, method="lora", lora_targets="c_attn"),         # no such module in a Llama
             make_row(batch=4, mode="infer"),                                 # not training
             make_row(batch=5, oom=True, oom_stage="backward")]               # OOM: its peak is no peak
    path = build_db(tmp_path / "c.duckdb", rows)
    pts = calibrate.collect_points(path)
    assert sorted(zip(pts.batch, pts.seq)) == [(1, 128), (1, 256), (2, 128), (2, 256)]
    assert pts.attrs["skipped"] == {"config": 2, "workload": 1}
    assert list(pts.columns) == list(calibrate.POINT_COLUMNS)
    assert calibrate.collect_points(path, sources=("measured",)).empty
    assert len(calibrate.collect_points(path, family="llama", attention="sdpa", checkpointing="none")) == 4
    assert calibrate.collect_points(path, family="gpt2").empty
    with pytest.raises(ValueError, match="family"):
        calibrate.collect_points(path, family="nope")
    with pytest.raises(ValueError, match="sources"):
        calibrate.collect_points(path, sources=("guessed",))


def test_fit_of_rows_with_known_k_and_the_context_fit(tmp_path):
    # Rows whose activations are exactly 20 * b*s*h*L*bytes on top of the estimated rest, measured on a GPU
    # whose device total is 1.05 * allocated + 500 MiB: k = 20 and alpha = 0.05, context = 500 MiB come back.
    rows = []
    for b, s in [(1, 128), (2, 256), (4, 512), (8, 1024)]:
        base = predicted_row("measured", batch=b, seq=s)
        extra = 20 * b * s * 64 * 2 * 2 - calibrate.activation_bytes_from_row(
            base, TINY, Workload(batch=b, seq=s), calibrate.parallel_from_row(base))["predicted_detailed"]
        peaks = {f"{st}_peak_alloc_bytes": base[f"{st}_peak_alloc_bytes"] + extra for st in ("forward", "backward")}
        est = estimate(TINY, Workload(batch=b, seq=s))
        rows.append(make_row(**{**{k: v for k, v in base.items() if k != "run_id"}, **peaks,
                                "peak_alloc_bytes": max(peaks.values()),
                                "nvml_used_bytes": int(1.05 * est.allocated_bytes) + 500 * MiB}))
    pts = calibrate.collect_points(build_db(tmp_path / "k.duckdb", rows))
    fit = calibrate.fit_family(pts, "llama")
    assert math.isclose(fit.k, 20.0, rel_tol=1e-12) and math.isclose(fit.r2, 1.0, rel_tol=1e-12)
    ctx = calibrate.fit_context(pts)
    assert math.isclose(ctx.alpha, 0.05, abs_tol=1e-6)
    assert math.isclose(ctx.context_bytes, 500 * MiB, rel_tol=1e-4)
    assert calibrate.fit_context(pts[pts.source == "traced"]) is None


# ------------------------------------------------------------------------------------------ storing the fit

@pytest.fixture
def fitted(tmp_path):
    """A database of predicted rows (traced, sdpa, no checkpointing), its points and their fit."""
    rows = [predicted_row(batch=b, seq=s) for b in (1, 2, 4) for s in (128, 512, 1024)]
    path = build_db(tmp_path / "f.duckdb", rows)
    pts = calibrate.collect_points(path)
    return path, pts, calibrate.fit_family(pts)


def test_save_then_load_round_trips(fitted, tmp_path):
    from estimator.calibration_file import load_calibration
    path, pts, fit = fitted
    out = tmp_path / "cal.json"
    cid = calibrate.save_calibration(fit, pts, path, out)
    [stored] = db.latest_calibrations("llama", db_path=path)
    assert (stored.k, stored.n_points, stored.attention, stored.checkpointing) == (fit.k, 9, "sdpa", "none")
    assert set(stored.run_ids) == set(pts["run_id"]) and stored.method == calibrate.METHOD
    assert stored.params["implied_k_detailed_median"] == pts["implied_k"].median()
    entry = load_calibration(out, "sdpa", "none")["llama"]
    assert (entry.k, entry.k_ci_low, entry.k_ci_high) == (fit.k, fit.k_ci_low, fit.k_ci_high)
    assert (entry.residual_std_bytes, entry.n_points) == (fit.residual_std_bytes, 9)
    assert entry.created_at == stored.created_at and entry.context_bytes is None
    assert load_calibration(out, "eager", "none") == {}   # a fit for sdpa says nothing about eager
    assert len(cid) == 64


def test_json_follows_the_environment_and_keeps_the_newest_fit(fitted, tmp_path, monkeypatch):
    from estimator.calibration_file import load_entries
    path, pts, fit = fitted
    monkeypatch.setenv("WILLITFIT_CALIBRATION", str(tmp_path / "env.json"))
    calibrate.save_calibration(fit, pts, path)
    refit = calibrate.fit_family(pts.iloc[:5])
    calibrate.save_calibration(refit, pts.iloc[:5], path)
    [entry] = load_entries()   # one (family, attention, checkpointing): only the newest fit is exported
    assert entry.k == refit.k and entry.n_points == 5


def test_json_is_replaced_atomically(fitted, tmp_path, monkeypatch):
    path, pts, fit = fitted
    out = tmp_path / "cal.json"
    out.write_text('{"version": 1, "calibrations": []}\n')
    before = out.read_text()

    def failing_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(calibrate.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        calibrate.write_calibration_json(path, out)
    assert out.read_text() == before                     # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp file left
    monkeypatch.undo()
    calibrate.save_calibration(fit, pts, path, out)
    assert json.loads(out.read_text())["calibrations"][0]["k"] == fit.k
    assert sorted(os.listdir(tmp_path)) == sorted(["cal.json", "f.duckdb", "f.jsonl"])


def test_save_refuses_what_the_loader_could_not_use(fitted, tmp_path):
    path, pts, fit = fitted
    negative = calibrate.fit_family(pts.assign(y=-pts["y"]))
    with pytest.raises(ValueError, match="k:"):
        calibrate.save_calibration(negative, pts, path, tmp_path / "cal.json")
    with pytest.raises(ValueError, match="points"):
        calibrate.save_calibration(fit, pts.iloc[:3], path, tmp_path / "cal.json")
    # a k <= 0 stored by another tool is left out of the file, with the reason, instead of breaking it
    db.insert_calibration(db.Calibration("gpt2", k=-1.0, n_points=2, run_ids=("a", "b"), method="manual"), path)
    calibrate.save_calibration(fit, pts, path, tmp_path / "cal.json")
    doc = json.loads((tmp_path / "cal.json").read_text())
    assert [e["family"] for e in doc["calibrations"]] == ["llama"]
    assert doc["left_out"][0]["family"] == "gpt2" and "k" in doc["left_out"][0]["reason"]


# ------------------------------------------------------------------------------------------ the CLI

def test_cli_prints_the_fit_and_saves(fitted, tmp_path, capsys):
    path, pts, fit = fitted
    assert main(["calibrate", "--db", str(path), "--source", "traced"]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and f"{fit.k:.3f}" in out and "seed k" in out
    assert f"{pts['implied_k'].median():.3f}" in out
    assert db.latest_calibrations(db_path=path) == []     # nothing stored without --save
    out_json = tmp_path / "c.json"
    assert main(["calibrate", "--db", str(path), "--save", "--json-out", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["calibrations"][0]["n_points"] == 9


def test_cli_bad_input_exits_2_with_one_line(fitted, capsys):
    path, _, _ = fitted
    assert main(["calibrate", "--db", str(path), "--family", "nope"]) == 2
    assert capsys.readouterr().err.startswith("family: 'nope' is not known")
    assert main(["calibrate", "--db", str(path), "--json-out", "x.json"]) == 2
    assert "json-out" in capsys.readouterr().err
    assert main(["calibrate", "--db", str(path), "--source", "measured"]) == 1  # no measured runs stored
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--source", "guessed"])
    assert e.value.code == 2
