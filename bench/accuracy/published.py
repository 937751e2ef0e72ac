"""The published tier of the accuracy report: every estimator against numbers framework authors measured on GPUs.

Each published run (bench/published/importer.py) has one number and its metric. It is compared with what each method
predicts for that metric:
- allocated (torch.cuda.max_memory_allocated), active (memory_stats active peak, within a few percent of
  allocated) and tracemalloc (PEFT's begin + peak delta of max_memory_allocated: the allocated peak): ours'
  `allocated_bytes`;
- reserved (max_memory_reserved): ours' `reserved_bytes` (the allocator model, estimator/reserved.py);
- unknown: compared with allocated, and reported in its own rows;
- capacity: not a peak; never compared.
Peers (offline/peers.py) predict one number whatever the metric; it is compared as it is. Paged optimizer
states live outside the torch allocator: ours leaves them out of allocated (`paged_bytes`), as the sources'
counters do. High and medium reliability are reported apart; low, suspect and derived rows are listed but not
summarised. Nothing is fitted to these rows.
"""
from __future__ import annotations

import json

import pandas as pd
from bench.store.db import connect, load_sql
from bench.published.importer import workload_fields, estimate_row
from estimator.model import from_hf_config
from offline.peers import peer_predictions
from estimator.spec import Parallel, Workload

OURS = "willitfit"
COMPARED_WITH = {"allocated": "allocated_bytes", "active": "allocated_bytes", "tracemalloc": "allocated_bytes",
                 "unknown": "allocated_bytes", "reserved": "reserved_bytes"}
SUMMARISED_RELIABILITY = ("high", "medium")


def load_published(db_path=None, wait_s: float = 30.0) -> pd.DataFrame:

    with connect(db_path, read_only=True, wait_s=wait_s) as con:
        return con.execute(load_sql("published_runs")).df()


def _present(v) -> bool:
    return v is not None and not (isinstance(v, float) and v != v)


def predictions(row: dict) -> tuple[dict, str]:
    """({method: bytes}, why ours cannot price it ('' when it can)) for one published run."""

    out = {}
    if row["mapping_status"] == "unmapped":
        return out, f"unmapped: {row['mapping_reason']}"
    est = estimate_row(row)
    why = ""
    if est is None:
        why = "no shipped profile for this workload class, or the workload is refused"
    else:
        col = COMPARED_WITH.get(row["metric"])
        if col and est.get(col) is not None:
            out[OURS] = int(est[col])
        elif col:
            why = f"ours gives no {col}"
    try:
        model = from_hf_config(json.loads(row["config_json"]), row["model_name"], derive=False)
        w = Workload(**workload_fields(row))
        p = Parallel(strategy=row["strategy"], gpus=int(row["world_size"]),
                     offload=row["offload"] if _present(row.get("offload")) else "none")
        out.update(dict(peer_predictions(model, w, p)))
    except ValueError:
        pass
    return out, why


def errors(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per (published run, method) with the signed error, one row per run ours cannot price)."""
    recs, missing = [], []
    for row in runs.to_dict("records"):
        if row["metric"] == "capacity":
            missing.append({"published_id": row["published_id"], "why": "a capacity, not a peak reading"})
            continue
        truth = int(row["published_value_bytes"])
        preds, why = predictions(row)
        if why:
            missing.append({"published_id": row["published_id"], "why": why})
        for method, pred in preds.items():
            recs.append({"published_id": row["published_id"], "model": row["model_name"], "metric": row["metric"],
                         "reliability": row["reliability"], "source": row["source_repo"], "method": method,
                         "mode": row["mode"] + ("-" + row["method"] if row["mode"] == "train" else ""),
                         "truth": truth, "pred": pred, "error": (pred - truth) / truth})
    cols = ["published_id", "model", "metric", "reliability", "source", "method", "mode", "truth", "pred", "error"]
    return pd.DataFrame(recs, columns=cols), pd.DataFrame(missing, columns=["published_id", "why"])


def summary(err: pd.DataFrame) -> pd.DataFrame:
    """Per metric x reliability x method: n, median signed error, median and worst |error|."""
    rows = []
    e = err[err["reliability"].isin(SUMMARISED_RELIABILITY)]
    for (metric, rel, method), g in e.groupby(["metric", "reliability", "method"]):
        a = g["error"].abs()
        worst = g.loc[a.idxmax()]
        rows.append({"metric": metric, "reliability": rel, "method": method, "n": len(g),
                     "median_signed": float(g["error"].median()), "median_abs": float(a.median()),
                     "worst": float(worst["error"]), "worst_id": worst["published_id"]})
    return pd.DataFrame(rows, columns=["metric", "reliability", "method", "n", "median_signed", "median_abs",
                                       "worst", "worst_id"])


def leave_one_source_out(err: pd.DataFrame) -> pd.DataFrame:
    """Ours per source repository, each alone: no constant is fitted on these rows, so holding a source out
    changes nothing in the predictions; the table shows how the error differs by who measured."""
    e = err[(err["method"] == OURS) & err["reliability"].isin(SUMMARISED_RELIABILITY)]
    rows = [{"source": s, "n": len(g), "median_signed": float(g["error"].median()),
             "median_abs": float(g["error"].abs().median())} for s, g in e.groupby("source")]
    return pd.DataFrame(rows, columns=["source", "n", "median_signed", "median_abs"])
