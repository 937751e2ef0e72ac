"""The published tier: GPU peak-memory numbers that framework authors measured and published, as runs.

    python -m bench import-published                         # data/published/points.csv -> the database
    python -m bench import-published --from ../shared/published/points.csv   # map the collected file again first

`data/published/points.csv` holds one row per published number: the facts and provenance (value and unit as
published, GPU, repository, section, commit, reliability), the workload in willitfit's vocabulary with each
field's origin (stated by the source, or inferred and why: bench/published/mapping.py, docs/published.md) and the
mapping status. The import replaces every `source='published'` run in ONE transaction (all rows or none), so a
bad data row leaves the previous tier as it was. run_ids are stable: the published id is part of the identity.

`estimate_row` is the one place that prices a published run with the estimator (shipped profiles only: it never
traces).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

from bench.published.mapping import map_row
from bench.store.db import connect, load_sql, incoming_runs
from bench.store.ingest import RawRow, prepare_rows
from estimator import knobs
from estimator.estimate import Options, estimate
from estimator.model import from_hf_config
from estimator.spec import Parallel, Workload
from estimator.presets import config_hash, load_config

DATA_FILE = Path(__file__).resolve().parents[2] / "data" / "published" / "points.csv"
MAX_FILE_BYTES = 2_000_000
FIELDS = ("published_id", "source_repo", "source_section", "source_version", "source_url", "model_published",
          "params_b_published", "preset", "model_type", "gpu_published", "gpu", "mode", "method", "lora_rank",
          "lora_targets", "recipe", "precision", "weight_format", "quantize_scope", "double_quant", "optimizer",
          "optimizer_impl", "batch", "seq", "gen_tokens", "grad_accum", "checkpointing", "attention", "loss",
          "loss_chunks", "optimizer_in_backward", "activation_offload", "compile", "strategy", "gpus", "offload",
          "metric", "metric_how", "measured_value", "measured_unit", "measured_bytes", "conversion", "per_gpu",
          "reliability", "mapping_status", "mapping_reason", "field_origins", "note")
# a published value of this metric fills this run column too (the rest stay in published_value_bytes only)
METRIC_COLUMN = {"allocated": "peak_alloc_bytes", "reserved": "peak_reserved_bytes", "device": "nvml_used_bytes"}
PUBLISHED_AT = "2026-11-24T00:00:00"   # created_at of every published run: when the tier was assembled


def write_data(source_csv: str | Path, out: Path = DATA_FILE) -> int:
    """Map every row of the collected file and write data/published/points.csv; returns the row count."""
    rows = [map_row(raw) for raw in _read_csv(Path(source_csv), "source")]
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        r = dict(r)
        if r.get("lora_targets"):
            r["lora_targets"] = ",".join(r["lora_targets"])
        w.writerow({k: r.get(k) for k in FIELDS})
    out.write_text(buf.getvalue())
    return len(rows)


def _read_csv(path: Path, what: str) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"{what}: {path} is not a file")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{what}: {path} is larger than {MAX_FILE_BYTES:,} bytes")
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@dataclass(frozen=True)
class Published:
    """One row of data/published/points.csv, typed."""

    fields: dict

    def __getitem__(self, key):
        return self.fields.get(key)


def _bool(v: str, field: str, pid: str) -> bool | None:
    if v in ("", None):
        return None
    if v in ("True", "true", "1"):
        return True
    if v in ("False", "false", "0"):
        return False
    raise ValueError(f"{field}: {v!r} of {pid} is not True or False")


def _int(v: str, field: str, pid: str) -> int | None:
    if v in ("", None):
        return None
    try:
        return int(float(v)) if float(v).is_integer() else _bad(field, v, pid)
    except ValueError:
        raise ValueError(f"{field}: {v!r} of {pid} is not an integer") from None


def _bad(field, v, pid):
    raise ValueError(f"{field}: {v!r} of {pid} is not an integer")


BOOLS = ("double_quant", "optimizer_in_backward", "activation_offload", "compile", "per_gpu")
INTS = ("lora_rank", "batch", "seq", "gen_tokens", "grad_accum", "loss_chunks", "gpus", "measured_bytes")


def load_data(path: Path = DATA_FILE) -> list[Published]:
    """The shipped data file, typed; a malformed row raises ValueError in one line naming the field."""
    raw = _read_csv(path, "published")
    if raw and set(raw[0]) != set(FIELDS):
        missing = sorted(set(FIELDS) - set(raw[0]))
        raise ValueError(f"published: {path.name} lacks column(s) {', '.join(missing) or '(none)'}; "
                         f"expected {', '.join(FIELDS)}")
    out, seen = [], set()
    for r in raw:
        pid = r.get("published_id") or "?"
        if pid in seen:
            raise ValueError(f"published_id: {pid} appears twice")
        seen.add(pid)
        f = {k: (v if v != "" else None) for k, v in r.items()}
        for k in BOOLS:
            f[k] = _bool(r[k], k, pid)
        for k in INTS:
            f[k] = _int(r[k], k, pid)
        if f["measured_bytes"] is None or f["measured_bytes"] <= 0:
            raise ValueError(f"measured_bytes: {r['measured_bytes']!r} of {pid} must be a positive integer")
        try:
            json.loads(r["field_origins"] or "{}")
        except json.JSONDecodeError:
            raise ValueError(f"field_origins: of {pid} is not JSON") from None
        out.append(Published(f))
    return out


def _model(p: Published) -> tuple[str, str, int, str, str | None]:
    """(model_name, model_type, params, config_hash, config_json) of a published row."""
    if p["preset"]:

        name, config = load_config(p["preset"])
        model = from_hf_config(config, name, derive=False)
        return name, str(config.get("model_type")), model.params, config_hash(config), \
            json.dumps(config, sort_keys=True)
    params = round(float(p["params_b_published"] or 0) * 1e9) or 1
    digest = hashlib.sha256(("published:" + (p["model_published"] or "")).encode()).hexdigest()
    return p["model_published"] or "unknown", p["model_type"] or "unknown", params, digest, None


def run_row(p: Published) -> dict:
    """The `runs` row of a published number (bench.store.rows.COLUMNS)."""
    name, model_type, params, chash, cfg = _model(p)
    infer = p["mode"] == "infer"
    row = {
        "source": "published", "created_at": PUBLISHED_AT, "contributor": p["source_repo"],
        "gpu_name": p["gpu_published"], "gpu_count": _or(p["gpus"], 1), "torch_version": "unknown",
        "model_name": name, "model_type": model_type, "params": params, "config_hash": chash, "config_json": cfg,
        "mode": p["mode"] or "train", "method": p["method"] or "full", "lora_rank": p["lora_rank"],
        "lora_targets": p["lora_targets"], "recipe": p["recipe"] or "pure", "precision": p["precision"] or "bf16",
        "weight_format": p["weight_format"], "optimizer": None if infer else p["optimizer"],
        "optimizer_impl": p["optimizer_impl"], "batch": _or(p["batch"], 1), "seq": _or(p["seq"], 1),
        "gen_tokens": p["gen_tokens"], "grad_accum": p["grad_accum"], "checkpointing": p["checkpointing"],
        "attention": p["attention"], "strategy": p["strategy"] or "single", "world_size": _or(p["gpus"], 1),
        "oom": False, "notes": p["note"], "loss": p["loss"], "loss_chunks": p["loss_chunks"],
        "optimizer_in_backward": p["optimizer_in_backward"], "activation_offload": p["activation_offload"],
        "quantize_scope": p["quantize_scope"], "double_quant": p["double_quant"], "compile": p["compile"],
        "offload": p["offload"], "published_id": p["published_id"], "metric": p["metric"],
        "measured_unit": p["measured_unit"], "per_gpu": p["per_gpu"], "published_value_bytes": p["measured_bytes"],
        "reliability": p["reliability"], "source_repo": p["source_repo"], "source_section": p["source_section"],
        "source_version": p["source_version"], "source_url": p["source_url"],
        "mapping_status": p["mapping_status"], "mapping_reason": p["mapping_reason"],
        "field_origins": p["field_origins"],
    }
    col = METRIC_COLUMN.get(p["metric"])
    if col:
        row[col] = p["measured_bytes"]
    return row


def _or(v, default):
    """The value, or the default where the data file leaves it empty (an unmapped row's NOT NULL columns)."""
    return default if v is None else v


def import_published(db_path=None, path: Path = DATA_FILE, wait_s: float = 30.0) -> int:
    """Replace the published tier with the data file's rows in one transaction; returns the rows written."""

    rows = [run_row(p) for p in load_data(path)]
    prepared = prepare_rows(str(path), (RawRow(i, r) for i, r in enumerate(rows, start=2)), keep_valid=False)
    if prepared.rejected:
        label, line, why = prepared.rejected[0]
        raise ValueError(f"published: row at line {line} of {Path(label).name}: {why}")
    if prepared.in_file_duplicates:
        raise ValueError(f"published: {prepared.in_file_duplicates} row(s) repeat another's run_id")
    with connect(db_path, read_only=False, wait_s=wait_s) as con:
        with incoming_runs(con, prepared.table):
            con.execute(load_sql("delete_published_runs"))
            n = con.execute(load_sql("insert_runs")).fetchone()[0]
    return n


def estimate_row(row: dict) -> dict | None:
    """The estimator's allocated / reserved / device bytes for a published run row (a dict of runs columns), or
    None when its workload cannot be expressed or no profile is shipped. Never traces (Options(derive=False))."""
    if row.get("mapping_status") == "unmapped" or not _present(row.get("config_json")):
        return None

    try:
        config = json.loads(row["config_json"])
        model = from_hf_config(config, row["model_name"], derive=False)
        w = Workload(**workload_fields(row))
        p = Parallel(strategy=row["strategy"], gpus=int(row["world_size"]),
                     offload=row["offload"] if _present(row.get("offload")) else "none")
        est = estimate(model, w, p, Options(derive=False))
    except ValueError:
        return None
    return {"allocated_bytes": est.allocated_bytes, "reserved_bytes": getattr(est, "reserved_bytes", None),
            "device_bytes": getattr(est, "device_bytes", None)}


def workload_fields(row: dict) -> dict:
    """Every declared workload field the row states (estimator.knobs), typed; the rest take the defaults."""
    return knobs.workload_values(row)


def _present(v) -> bool:
    """A value that is set (a DataFrame row has NaN where the database has NULL)."""
    return v is not None and not (isinstance(v, float) and v != v)
