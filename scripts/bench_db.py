"""Benchmark the DuckDB store: ingest rate, and the app's main queries on a database of 1M runs.

    python scripts/bench_db.py                       # 1M rows; rewrites '## Database' in docs/performance.md
    python scripts/bench_db.py --rows 50000 --no-doc # a quick look, docs untouched

It generates synthetic but fully valid rows (varied models, workloads, GPUs), writes them as JSONL files
(the contributed-results format, 100k rows a file), times `bench.store.ingest.ingest_files` on them into a
fresh database, then times each main query the way the app calls it: open a read-only connection,
run, fetch a pandas DataFrame, close. Each query gets burn-in calls first, then timed calls; the
median and the slowest are reported. Everything happens in a temporary directory.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.perf_doc import replace_section  # noqa: E402

import duckdb  # noqa: E402

from bench.store import db

from bench.store import ingest  # noqa: E402
from bench.store.rows import COLUMN_NAMES, canonical_json, compute_run_id, config_hash  # noqa: E402

GiB = 2**30
ROWS_PER_FILE = 100_000
MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma2", "phi3", "qwen2_moe", "gpt_neox", "deepseek_v3")
SEQS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_MODELS = 40
# (name, bytes the driver reports): an "80 GB" H100 shows 81559 MiB
GPUS = (("NVIDIA H100 80GB HBM3", 81559 * 2**20), ("NVIDIA A100-SXM4-40GB", 40960 * 2**20),
        ("NVIDIA GeForce RTX 4090", 24564 * 2**20))


def _models() -> list[tuple[str, str, str, str, int]]:
    """(model_name, model_type, config_json, config_hash, params) for N_MODELS made-up configs."""
    out = []
    for m in range(N_MODELS):
        mtype = MODEL_TYPES[m % len(MODEL_TYPES)]
        hidden = 512 * (1 + m % 8)
        layers = 8 + 4 * (m % 6)
        cfg = {"model_type": mtype, "hidden_size": hidden, "num_hidden_layers": layers,
               "num_attention_heads": hidden // 64, "num_key_value_heads": max(1, hidden // 256),
               "intermediate_size": 4 * hidden, "vocab_size": 32000 + 64 * m, "max_position_embeddings": 16384}
        params = layers * 12 * hidden * hidden + 2 * (32000 + 64 * m) * hidden
        out.append((f"synthetic-{mtype}-{m:02d}", mtype, canonical_json(cfg), config_hash(cfg), params))
    return out


BASE_TIME = dt.datetime(2025, 1, 1)


def synthetic_row(i: int, models) -> dict:
    """Row i: unique by (model, seq, batch) = a mixed-radix split of i; every 10th row is 'measured'.

    Models are interleaved row by row (the worst case for filters: every row group holds every model);
    created_at rises one minute per row, as rows are produced and ingested over time.
    """
    name, mtype, cfg_json, cfg_hash, params = models[i % N_MODELS]
    seq, batch = SEQS[(i // N_MODELS) % len(SEQS)], 1 + i // (N_MODELS * len(SEQS))
    train = (i // 7) % 2 == 0
    measured = i % 10 == 0
    gpu_name, gpu_total = GPUS[i % len(GPUS)] if measured else ("fake-cpu", None)
    weights = 2 * params
    act = 2 * batch * seq * 4096
    stages = ({"load": weights, "forward": weights + act, "backward": 2 * weights + act, "optimizer": 4 * weights}
              if train else {"load": weights, "prefill": weights + act, "decode": weights + act // 2})
    peak = max(stages.values())
    oom = gpu_total is not None and peak > gpu_total
    row = dict.fromkeys(COLUMN_NAMES)
    row.update({
        "source": "measured" if measured else "traced", "created_at": (BASE_TIME + dt.timedelta(minutes=i)).isoformat() + "Z",
        "tool_version": "0.1.0", "gpu_name": gpu_name, "gpu_total_bytes": gpu_total, "gpu_count": 1,
        "torch_version": "2.13.0", "transformers_version": "5.23.0", "python_version": "3.11.7",
        "model_name": name, "model_type": mtype, "params": params, "trainable_params": params if train else 0,
        "config_hash": cfg_hash, "config_json": cfg_json, "mode": "train" if train else "infer", "method": "full",
        "recipe": "pure", "precision": "bf16", "weight_format": "auto", "optimizer": "adamw" if train else None,
        "batch": batch, "seq": seq, "gen_tokens": 0 if train else 128, "grad_accum": 1,
        "checkpointing": "none" if train else "none", "attention": ("sdpa", "eager", "flash")[i % 3],
        "strategy": "single", "world_size": 1, "peak_alloc_bytes": peak, "peak_reserved_bytes": peak + 2**21,
        "oom": oom, "oom_stage": "forward" if oom else None,
    })
    if not train:
        row["gen_tokens"] = 128
        row["grad_accum"] = None
    for st, b in stages.items():
        row[f"{st}_peak_alloc_bytes"] = b
        row[f"{st}_peak_reserved_bytes"] = b + 2**21
    row["run_id"] = compute_run_id(row)
    return row


def write_jsonl_files(n_rows: int, out_dir: Path) -> list[Path]:
    import json
    models, paths = _models(), []
    for start in range(0, n_rows, ROWS_PER_FILE):
        path = out_dir / f"runs_{start // ROWS_PER_FILE:03d}.jsonl"
        with open(path, "w") as f:
            for i in range(start, min(n_rows, start + ROWS_PER_FILE)):
                f.write(json.dumps(synthetic_row(i, models)) + "\n")
        paths.append(path)
    return paths


def time_call(fn, burn_in: int = 3, repeats: int = 20) -> tuple[float, float, float, int]:
    """(median wall ms, max wall ms, median CPU ms, rows returned) over `repeats` calls after `burn_in`.

    CPU time is this process's, all DuckDB threads included: on a shared machine it shows the work
    done, where wall time also counts waiting for other processes' turn on the cores.
    """
    for _ in range(burn_in):
        result = fn()
    wall_ms, cpu_ms = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        wall_ms.append((time.perf_counter() - t0) * 1e3)
        cpu_ms.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall_ms), max(wall_ms), statistics.median(cpu_ms), len(result)


def seed_calibrations(db_path: Path, n: int = 200) -> None:
    for j in range(n):
        db.insert_calibration(db.Calibration(
            architecture=MODEL_TYPES[j % len(MODEL_TYPES)], k=1.0 + j / 100, n_points=3,
            run_ids=("a" * 64, "b" * 64, "c" * 64), method="ols", attention=("sdpa", "eager", "flash")[j % 3],
            checkpointing=("none", "full", "selective")[(j // 3) % 3], residual_std_bytes=1e6,
            created_at=dt.datetime(2025, 1, 1) + dt.timedelta(hours=j)), db_path)


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, duckdb {duckdb.__version__}, "
            f"{dt.date.today().isoformat()}")


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min) / {five:.1f} (5 min)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="synthetic rows to generate and ingest")
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/performance.md alone")
    ap.add_argument("--doc", default=str(REPO / "docs" / "performance.md"), help="the file to update")
    args = ap.parse_args()
    load_before = load_average()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        files = write_jsonl_files(args.rows, tmp)
        mib = sum(p.stat().st_size for p in files) / 2**20
        print(f"generated {args.rows} rows in {len(files)} JSONL files ({mib:.0f} MiB) "
              f"in {time.perf_counter() - t0:.1f} s")

        db_path = tmp / "bench.duckdb"
        t0, c0 = time.perf_counter(), time.process_time()
        report = ingest.ingest_files(files, db_path)
        ingest_s, ingest_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        assert report.inserted == args.rows and report.n_rejected == 0, report
        rate, cpu_rate = args.rows / ingest_s, args.rows / ingest_cpu_s
        db_mib = db_path.stat().st_size / 2**20
        print(f"ingested {report.inserted} rows in {ingest_s:.1f} s wall = {rate:,.0f} rows/s "
              f"({ingest_cpu_s:.1f} s CPU = {cpu_rate:,.0f} rows per CPU-second); database {db_mib:.0f} MiB")

        seed_calibrations(db_path)
        probe = synthetic_row(args.rows // 2, _models())
        def open_close():
            with db.connect(db_path, read_only=True):
                return [None]

        queries = [
            ("open + close a read-only connection (the floor under every call)", open_close),
            ("v_summary: `query_df('summary')`", lambda: db.query_df("summary", db_path=db_path)),
            (f"`fetch_runs(model_name=.., mode='train')`, limit {db.DEFAULT_FETCH_LIMIT}",
             lambda: db.fetch_runs({"model_name": probe["model_name"], "mode": "train"}, db_path)),
            ("`fetch_runs(family='qwen', seq=[1024, 2048], oom=False)`, limit 100",
             lambda: db.fetch_runs({"family": "qwen", "seq": [1024, 2048], "oom": False}, db_path, limit=100)),
            ("detail by run_id: `get_run(run_id)`", lambda: [db.get_run(probe["run_id"], db_path)]),
            ("`latest_calibrations()`", lambda: db.latest_calibrations(db_path=db_path)),
        ]
        results = []
        for name, fn in queries:
            med, worst, cpu, n = time_call(fn)
            results.append((name, med, worst, cpu, n))
            print(f"{name:<70} median {med:7.1f} ms  max {worst:7.1f} ms  CPU {cpu:7.1f} ms  rows {n}")
    load_after = load_average()

    section = "\n".join([
        "## Database",
        "",
        f"Measured by `python scripts/bench_db.py` on {machine()}. The machine is shared: load average "
        f"{load_before} before the run and {load_after} after, so wall times include waiting for the "
        "cores; CPU time (this process, all DuckDB threads) is the work itself.",
        "",
        f"**Ingest**: {args.rows:,} synthetic valid rows in {len(files)} JSONL files ({mib:.0f} MiB) through "
        "`bench.store.ingest.ingest_files` (parse, validate every field, compute run_id, dedupe, one transaction "
        f"per file) into a fresh database: {ingest_s:.1f} s wall = **{rate:,.0f} rows/s** "
        f"({ingest_cpu_s:.1f} s CPU = {cpu_rate:,.0f} rows per CPU-second). The database file is {db_mib:.0f} MiB.",
        "",
        f"**Queries** on that {args.rows:,}-row database (plus 200 calibrations), timed as the app calls them: "
        "open a read-only connection, run, fetch a pandas DataFrame, close. Models are interleaved row by "
        "row (every row group holds every model); created_at rises with the row number. 3 burn-in calls, "
        "then 20 timed. Target: under 200 ms each.",
        "",
        "| query | median ms | max ms | CPU ms (median) | rows returned |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(f"| {name} | {med:.1f} | {worst:.1f} | {cpu:.1f} | {n} |" for name, med, worst, cpu, n in results),
        "",
    ]) + "\n"
    print()
    print(section)
    if not args.no_doc:
        replace_section("## Database", section, Path(args.doc))
        print(f"updated {args.doc}")


if __name__ == "__main__":
    main()
