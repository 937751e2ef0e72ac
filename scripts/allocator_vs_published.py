"""Compare reserved and device bytes predicted by the estimator with published GPU numbers.

    python scripts/allocator_vs_published.py             # print the comparison
    python scripts/allocator_vs_published.py --write     # and write it into docs/allocator.md
    python scripts/allocator_vs_published.py --db PATH   # another database (default $WILLITFIT_DB or the shipped one)

Reads every run with source = 'published' (bench/store/queries/published_device_runs.sql). A row is compared when it
carries a reserved figure (peak_reserved_bytes, or metric = 'reserved') or a whole-device one (nvml_used_bytes, or
metric = 'device': what nvidia-smi showed); the estimate for its own model, workload and parallelism comes from
estimate() with derive=False (a run whose profile is not on disk is counted as skipped, never traced), with the
CUDA context of the row's GPU where the GPU is a preset. Error = (predicted - published) / published; the script
prints, per metric, the count, the median and the worst |error|, and each row. With no such rows it says so.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimator.units import GiB  # noqa: E402

DOC = ROOT / "docs" / "allocator.md"
SECTION = "## Compared with published reserved and nvidia-smi numbers"
# metric value -> (column holding the published figure, Estimate attribute it is compared with)
METRICS = {"reserved": ("peak_reserved_bytes", "reserved_bytes"), "device": ("nvml_used_bytes", "device_bytes")}


def _present(v) -> bool:
    return v is not None and v == v   # NaN / pd.NA compare unequal to themselves


def published_rows(db_path: str | None) -> list[dict]:
    """Published rows as dicts, or [] when there is no database (or no published rows)."""
    from bench.store import db

    path = Path(db_path) if db_path else db.default_db_path()
    if not path.is_file():
        return []
    return db.query_df(str(ROOT / "bench" / "queries" / "published_device_runs.sql"), ["published"],
                       db_path=path).to_dict("records")


def comparisons(rows: list[dict]) -> tuple[list[dict], dict]:
    """(one dict per compared figure, counts of rows skipped and why)."""
    from bench.accuracy.calibrate import model_from_row, parallel_from_row, workload_from_row
    from estimator.estimate import Options, estimate
    from estimator.gpus import load_gpus
    from estimator.store import ProfileMissing

    presets = load_gpus()
    out, skipped = [], {}
    for row in rows:
        wanted = [m for m, (col, _) in METRICS.items()
                  if _present(row.get(col)) and (row.get("metric") in (None, m) or not _present(row.get("metric")))]
        if not wanted:
            skipped["no reserved or device figure"] = skipped.get("no reserved or device figure", 0) + 1
            continue
        gpu = next((g.name for g in presets.values() if g.display_name == row.get("gpu_name")
                    or g.name == row.get("gpu_name")), None)
        try:
            est = estimate(model_from_row(row), workload_from_row(row), parallel_from_row(row),
                           Options(derive=False, gpu=gpu))
        except ProfileMissing:
            skipped["profile not on disk"] = skipped.get("profile not on disk", 0) + 1
            continue
        except (ValueError, KeyError, TypeError) as e:
            why = f"cannot estimate ({str(e).split(':')[0]})"
            skipped[why] = skipped.get(why, 0) + 1
            continue
        for m in wanted:
            truth = int(row[METRICS[m][0]])
            pred = int(getattr(est, METRICS[m][1]))
            out.append({"metric": m, "run_id": row.get("run_id"), "published_id": row.get("published_id"),
                        "model": row.get("model_name"), "gpu": row.get("gpu_name"),
                        "mapping_status": row.get("mapping_status"), "published_bytes": truth,
                        "predicted_bytes": pred, "rel_error": (pred - truth) / truth if truth else None})
    return out, skipped


def report(comps: list[dict], skipped: dict, n_rows: int) -> str:
    lines = [SECTION, "", "Made by `python scripts/allocator_vs_published.py --write`. Error = (predicted - "
             "published) / published; reserved against `peak_reserved_bytes`, device against `nvml_used_bytes` "
             "(nvidia-smi).", ""]
    if not comps:
        lines.append(f"No published run with a reserved or nvidia-smi figure could be compared ({n_rows} published "
                     "rows in the database" + (f"; skipped: {_fmt(skipped)}" if skipped else "") + "). The figures "
                     "appear here once the published tier's rows are ingested.")
        return "\n".join(lines) + "\n"
    lines += ["| metric | n | median abs error | worst abs error |", "|---|---:|---:|---:|"]
    for m in METRICS:
        errs = [abs(c["rel_error"]) for c in comps if c["metric"] == m and c["rel_error"] is not None]
        if errs:
            lines.append(f"| {m} | {len(errs)} | {statistics.median(errs):.1%} | {max(errs):.1%} |")
    lines += ["", "| metric | model | GPU | published GiB | predicted GiB | error | mapping | published id |",
              "|---|---|---|---:|---:|---:|---|---|"]
    for c in sorted(comps, key=lambda c: (c["metric"], -abs(c["rel_error"] or 0))):
        lines.append(f"| {c['metric']} | {c['model']} | {c['gpu']} | {c['published_bytes'] / GiB:.2f} | "
                     f"{c['predicted_bytes'] / GiB:.2f} | {c['rel_error']:+.1%} | {c['mapping_status']} | "
                     f"{c['published_id']} |")
    if skipped:
        lines += ["", f"Skipped: {_fmt(skipped)}."]
    return "\n".join(lines) + "\n"


def _fmt(skipped: dict) -> str:
    return ", ".join(f"{n} {why}" for why, n in sorted(skipped.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default=None, help="DuckDB file (default $WILLITFIT_DB, else data/benchmarks.duckdb)")
    ap.add_argument("--write", action="store_true", help="replace the comparison section of docs/allocator.md")
    args = ap.parse_args(argv)
    rows = published_rows(args.db)
    comps, skipped = comparisons(rows)
    text = report(comps, skipped, len(rows))
    print(text)
    if args.write:
        from scripts.perf_doc import replace_section
        replace_section(SECTION, text, DOC)
        print(f"wrote the '{SECTION}' section of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
