"""Calibrate the seeds' activation constant k from stored runs, and store the fit.

    python -m bench calibrate --source traced            # print k per family, nothing written
    python -m bench calibrate --family llama --save      # also store it and regenerate data/calibration.json

A point is one training run that did not OOM. Its x is the seeds' regressor b*s*h*L*bytes (bytes of the
activation dtype; L = the layers on the GPU that holds the peak), and its y is the activation bytes the run
actually held: the run's allocated peak minus every NON-activation component the estimator puts in the same
stage (`activation_bytes_from_row`). k is then fitted through the origin per family (`offline.calibration`).
The method and the formulas are in docs/calibration.md.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd

from bench.store import db
from bench.store.rows import SOURCES
from estimator import calibration_file
from offline.calibration import KFit, ResidualFit, fit_k, fit_residual
from estimator.estimate import Estimate, Options, estimate
from estimator.families import FAMILIES
from estimator.model import Model, from_hf_config
from estimator.parallel import shares
from estimator.presets import parse_config_text
from estimator.spec import Parallel, Workload
from estimator.knobs import workload_from_row  # noqa: F401  (run rows are read back here and by accuracy)
from estimator.store import ProfileMissing
from estimator.units import dtype_bytes

METHOD = "ols-origin"  # calibrations.method of fits made here
POINT_COLUMNS = ("run_id", "source", "family", "model_name", "model_type", "batch", "seq", "attention",
                 "checkpointing", "stage", "x", "y", "predicted_detailed", "implied_k",
                 "analytic_allocated_bytes", "measured_total_bytes")


def _present(v) -> bool:
    return v is not None and not (isinstance(v, float) and np.isnan(v)) and v is not pd.NA


def parallel_from_row(row: dict) -> Parallel:
    """Parallel(strategy, gpus=world_size); tp/pp degrees follow from the strategy as in estimator.spec."""
    return Parallel(strategy=str(row["strategy"]), gpus=int(row["world_size"]))


def model_from_row(row: dict) -> Model:
    """Model from the row's config_json. Raises ValueError for missing, invalid or unsupported configs."""
    if not _present(row.get("config_json")):
        raise ValueError("config_json: empty; the run row carries no config.json")
    cfg = parse_config_text(str(row["config_json"]))
    try:
        return from_hf_config(cfg, str(row.get("model_name") or "custom"))
    except (TypeError, KeyError, AttributeError, ArithmeticError) as e:  # a config with wrongly typed fields
        raise ValueError(f"config_json: cannot build the model ({type(e).__name__}: {e})") from None


def _allocated_besides_activations(est: Estimate, stage: str, source: str) -> int:
    """Bytes torch's allocator holds at `stage` that are not saved activations, per the estimator.

    Everything in the stage's Breakdown except `activations`, and except `overhead`, which torch never
    allocates -- but a GPU run does allocate the cuBLAS workspace through the caching allocator
    (est.workspace_at(stage), counted by max_memory_allocated), while a traced run never sees it.
    """
    b = est.stage(stage)
    workspace = est.workspace_at(stage) if source == "measured" else 0
    return b.tensor_bytes - b.activations + workspace


def _activation_stage(row: dict, est: Estimate) -> tuple[str, int] | None:
    """(stage, the row's allocated peak in it) for a stage where the estimator holds the FULL saved set.

    Forward first: its peak (the loss, at the end of the forward) is the one moment when every saved tensor
    is alive and the rest is simplest to model; in backward, tensors are freed while gradients arrive, and
    the estimator's backward-start moment is the rougher model (on traced Qwen2.5-0.5B runs the forward
    stage gives y within 0.02% of the detailed model, the backward stage 3-13% below it, see
    docs/calibration.md). Then the estimator's peak stage, then backward. A stage's peak comes from its
    `<stage>_peak_alloc_bytes` column; a row without that column stands in with its overall peak for the
    estimator's peak stage only.
    """
    saved = est.stage("forward").activations
    if saved <= 0:
        return None
    for stage in dict.fromkeys(("forward", est.peak_stage, "backward")):
        if est.stage(stage).activations != saved:
            continue  # optimizer/load hold none; the end of backward holds one layer's
        peak = row.get(f"{stage}_peak_alloc_bytes")
        if not _present(peak) and stage == est.peak_stage:
            peak = row.get("peak_alloc_bytes")
        if _present(peak):
            return stage, int(peak)
    return None


def activation_bytes_from_row(row: dict, model: Model, workload: Workload, parallel: Parallel,
                              derive: bool = True) -> dict | None:
    """One calibration point of a run row, or None when no stage of it holds the saved activations.

    y = (the row's allocated peak in a stage holding all saved activations) - (every other component the
    estimator puts in that stage: weights, gradients, optimizer states, master weights, KV cache, AND
    temporaries). Temporaries are subtracted too because estimate() adds them beside the activation term
    whichever activation model it uses (the logits' fp32 copy at the loss, autocast weight copies, gathered
    FSDP layers): the seeds' k * b*s*h*L*bytes replaces only the `activations` component, so a k fitted on
    y with the temporaries left in would count them twice once put back into estimate(Options(activation_k=k)).
    If the run's peak is exactly what the estimator predicts, y is exactly the detailed model's activations.
    """
    est = estimate(model, workload, parallel, Options(derive=derive))
    found = _activation_stage(row, est)
    if found is None:
        return None
    stage, peak = found
    x = activation_x(model, workload, parallel, est.pipeline_stage)
    detailed = est.stage(stage).activations
    total = row.get("nvml_used_bytes")
    return {"stage": stage, "x": x, "y": peak - _allocated_besides_activations(est, stage, str(row["source"])),
            "predicted_detailed": detailed, "implied_k": detailed / x,
            "analytic_allocated_bytes": est.allocated_bytes,
            "measured_total_bytes": float(total) if _present(total) else float("nan")}


def family_model_types(family: str) -> list[str]:
    """The config.json model_types of an estimator family (estimator.families.FAMILIES)."""
    types = sorted(mt for mt, f in FAMILIES.items() if f == family)
    if not types:
        raise ValueError(f"family: {family!r} is not known; choose one of {', '.join(sorted(set(FAMILIES.values())))}")
    return types


def activation_x(model: Model, workload: Workload, parallel: Parallel, pipeline_stage: str = "only") -> int:
    """x = b*s*h*L*bytes for the layers on this GPU (of `pipeline_stage`), exactly as estimate() scales the
    seeds' form: the regressor the k fit is made on."""
    stage_shares = shares(model.inventory, parallel)
    layers_local = next((sh.layers_local for sh in stage_shares if sh.stage == pipeline_stage),
                        stage_shares[0].layers_local)
    return workload.batch * workload.seq * model.hidden * layers_local * dtype_bytes(workload.precision)


def cpu_math_sdpa(source: str, model: Model, workload: Workload, notes: str | None = None) -> bool:
    """A traced training run with SDPA and attention dropout, traced before the tracer followed CUDA's kernels
    (rows noted "attention-probability dropout traced off", then "kernels cuda", tracer.kernels.note): on
    CPU, SDPA with dropout_p > 0 runs the math kernel, which materialises and saves the (b, heads, s, s)
    probabilities and the dropout mask; a GPU's flash / memory-efficient kernel saves neither, and the estimator
    follows the GPU (sdpa: q, k, v, out, lse). Such traced peaks are CPU-specific, so calibration leaves them out
    and the accuracy report flags them."""
    if notes and ("attention-probability dropout traced off" in notes or "kernels cuda" in notes):
        return False
    return source == "traced" and workload.mode == "train" and workload.attention == "sdpa" and model.inventory.extra.get("attention_dropout", 0.0) > 0


def collect_points(db_path=None, family: str | None = None, sources=("measured", "traced"),
                   attention: str | None = None, checkpointing: str | None = None,
                   wait_s: float = db.DEFAULT_WAIT_S, derive: bool = True) -> pd.DataFrame:
    """Calibration points (columns POINT_COLUMNS) of the stored training runs without OOM.

    Rows that cannot be used are counted, not raised: `df.attrs["skipped"]` maps a reason
    ('config', 'workload', 'no activation stage', 'cpu-math-sdpa': a CPU-only kernel artefact, 'cpu-kernels': traced
    with `--kernels cpu`) to a count.
    """
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources:
        raise ValueError(f"sources: {bad or 'none'} not allowed; choose from {', '.join(SOURCES)}")
    filters = {"source": list(sources), "mode": "train", "oom": False, "attention": attention,
               "checkpointing": checkpointing, "model_type": family_model_types(family) if family else None}
    runs = db.fetch_runs(filters, db_path=db_path, limit=None, wait_s=wait_s)
    points, skipped = [], {}
    models: dict[str, Model] = {}  # one Model per distinct config
    for row in runs.to_dict("records"):
        model = models.get(row.get("config_hash"))
        point, why = point_from_row(row, model, derive)
        if point is not None and row.get("config_hash"):
            models.setdefault(row["config_hash"], model or model_from_row(row))
        if point is None:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            points.append(point)
    df = pd.DataFrame(points, columns=list(POINT_COLUMNS))
    df.attrs["skipped"] = skipped
    return df


def point_from_row(row: dict, model: Model | None = None, derive: bool = True) -> tuple[dict | None, str]:
    """(the point, with every POINT_COLUMNS column, "") of one run row, or (None, why it is skipped:
    'config', 'workload', 'no profile' (derive=False and none on disk), 'cpu-math-sdpa', 'cpu-kernels' or 'no
    activation stage'). Pass `model` to reuse one built from the same config."""
    if row.get("kernels") == "cpu":  # the CPU's own kernels (bench trace --kernels cpu): not what a GPU keeps
        return None, "cpu-kernels"
    try:
        model = model or model_from_row(row)
    except ValueError:
        return None, "config"
    try:  # estimate() itself refuses e.g. LoRA targets that match no module of this model
        workload, parallel = workload_from_row(row), parallel_from_row(row)
        if cpu_math_sdpa(row["source"], model, workload, row.get("notes")):
            return None, "cpu-math-sdpa"
        point = activation_bytes_from_row(row, model, workload, parallel, derive)
    except ProfileMissing:
        return None, "no profile"
    except (ValueError, TypeError):
        return None, "workload"
    if point is None:
        return None, "no activation stage"
    return {"run_id": row["run_id"], "source": row["source"], "family": model.family,
            "model_name": row["model_name"], "model_type": model.model_type, "batch": workload.batch,
            "seq": workload.seq, "attention": workload.attention, "checkpointing": workload.checkpointing,
            **point}, ""


def groups(points: pd.DataFrame) -> list[tuple[str, str, str]]:
    """The (family, attention, checkpointing) combinations present: each gets a k of its own, since eager
    attention adds an s^2 term and checkpointing drops most saved tensors; one k across them would fit none."""
    keys = points[["family", "attention", "checkpointing"]].drop_duplicates()
    return sorted(keys.itertuples(index=False, name=None))


def fit_family(points: pd.DataFrame, family: str | None = None, level: float = 0.95) -> KFit:
    """k through the origin over `points` (of `family` if given). The points must be of one family."""
    if family is not None:
        points = points[points["family"] == family]
    families = sorted(points["family"].unique())
    if len(families) > 1:
        raise ValueError(f"family: points of {', '.join(families)}; fit one family at a time")
    return fit_k(points["x"].to_numpy(np.float64), points["y"].to_numpy(np.float64), level)


def fit_context(points: pd.DataFrame, level: float = 0.95) -> ResidualFit | None:
    """alpha and the context constant from the measured points that carry an NVML total (None if < 3)."""
    m = points[points["measured_total_bytes"].notna()]
    if len(m) < 3 or m["analytic_allocated_bytes"].nunique() < 2:
        return None
    return fit_residual(m["analytic_allocated_bytes"].to_numpy(np.float64),
                        m["measured_total_bytes"].to_numpy(np.float64), level)


def _single(points: pd.DataFrame, column: str) -> str | None:
    values = points[column].unique()
    return str(values[0]) if len(values) == 1 else None


def save_calibration(fit: KFit, points: pd.DataFrame, db_path=None, json_path=None,
                     residual: ResidualFit | None = None, wait_s: float = db.DEFAULT_WAIT_S) -> str:
    """Store `fit` (made from exactly `points`, one family) as a calibrations row, then regenerate the
    calibration JSON from the database's latest calibrations. Returns the calibration_id."""
    if len(points) != fit.n_points:
        raise ValueError(f"points: {len(points)} rows, but the fit used {fit.n_points}; "
                         "pass the points it was fitted on")
    if fit.k <= 0:
        raise ValueError(f"k: the fit gives k = {fit.k:.4g} <= 0, which no estimate can use; these runs' peaks lie "
                         "below the estimated non-activation memory (see the points' y)")
    family = _single(points, "family")
    if family is None:
        raise ValueError(f"family: points of {', '.join(sorted(points['family'].unique()))}; save one family per fit")
    params = {"level": fit.level, "se_k": fit.se_k, "sum_x2": fit.sum_x2, "t_value": fit.t_value,
              "sources": sorted(points["source"].unique()),
              "implied_k_detailed_median": float(points["implied_k"].median())}
    if residual is not None:
        params.update(context_bytes=residual.context_bytes, context_ci_low=residual.context_ci_low,
                      context_ci_high=residual.context_ci_high, alpha=residual.alpha,
                      alpha_ci_low=residual.alpha_ci_low, alpha_ci_high=residual.alpha_ci_high,
                      context_r2=residual.r2, context_residual_std_bytes=residual.residual_std_bytes,
                      context_n_points=residual.n_points)
    cal = db.Calibration(
        architecture=family, k=fit.k, n_points=fit.n_points, run_ids=tuple(str(r) for r in points["run_id"]),
        method=METHOD, attention=_single(points, "attention"), checkpointing=_single(points, "checkpointing"),
        k_ci_low=fit.k_ci_low, k_ci_high=fit.k_ci_high, r2=fit.r2, residual_std_bytes=fit.residual_std_bytes,
        params={k: (float(v) if isinstance(v, (float, np.floating)) else v) for k, v in params.items()})
    calibration_id = db.insert_calibration(cal, db_path, wait_s)  # one INSERT statement: one transaction
    write_calibration_json(db_path, json_path, wait_s)
    return calibration_id


_ENTRY_FIELDS = tuple(f.name for f in fields(calibration_file.CalibrationEntry))


def _json_entry(cal: db.Calibration) -> dict:
    """One entry of the file `estimator.calibration_file` reads (its module docstring gives the format).

    created_at is naive UTC ISO 8601, as the table stores it. A context constant fitted below zero (noise
    on a handful of runs) means nothing physical, so it is left out of the file; the table keeps it."""
    entry = {"family": cal.architecture, "k": cal.k, "k_ci_low": cal.k_ci_low, "k_ci_high": cal.k_ci_high,
             "residual_std_bytes": cal.residual_std_bytes, "n_points": cal.n_points,
             "created_at": cal.created_at.isoformat(),
             "attention": cal.attention, "checkpointing": cal.checkpointing, "r2": cal.r2, "method": cal.method}
    context = cal.params.get("context_bytes")
    entry["context_bytes"] = float(context) if context is not None and context >= 0 else None
    return entry


def write_calibration_json(db_path=None, json_path=None, wait_s: float = db.DEFAULT_WAIT_S) -> Path:
    """Regenerate the calibration JSON from the database's latest calibrations, atomically: the new text
    goes to a temporary file beside the target and os.replace swaps it in, so a reader sees the old file
    or the new one, never half of one. Returns the path written."""
    path = calibration_file.calibration_path(json_path)
    entries, left_out = [], []
    for cal in db.latest_calibrations(db_path=db_path, wait_s=wait_s):
        entry = _json_entry(cal)
        try:  # what the loader would refuse (a k <= 0 stored by another tool) must not break the whole file
            calibration_file.CalibrationEntry(**{**{f: entry[f] for f in _ENTRY_FIELDS}, "created_at": cal.created_at})
        except ValueError as e:
            left_out.append({"family": cal.architecture, "attention": cal.attention,
                             "checkpointing": cal.checkpointing, "reason": str(e)})
            continue
        entries.append(entry)
    payload = {"version": calibration_file.VERSION,
               "note": "generated by `python -m bench calibrate --save` from the calibrations table; do not edit",
               "calibrations": entries, "left_out": left_out}
    text = json.dumps(payload, indent=2, sort_keys=False, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
