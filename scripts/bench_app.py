"""Time each page of the Streamlit app: its first render on the shipped database and on a 1M-row one.

    python scripts/bench_app.py                      # shipped DB + 1M synthetic rows; rewrites '## App' in docs/performance.md
    python scripts/bench_app.py --rows 100000 --no-doc

A page's "first render" is what a new visitor waits for in a running server: Python modules are already
imported (the server imported them for an earlier session), but the data caches are empty. Each timing is an
AppTest run of the page started from app.py, after `st.cache_data.clear()`: the page script and everything it
calls (DuckDB reads, estimates, chart specs), without the browser's drawing. One untimed warm-up pass imports
everything; then each page is timed `--repeats` times and the median and slowest are reported, plus a rerun
with warm caches (what every later click costs).

The synthetic database: one valid template run per preset model, inserted through bench.store.ingest, multiplied to
--rows runs by scripts/bench_app_synthetic.sql (varying batch, seq, source, strategy, OOM).
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
sys.path.insert(0, str(REPO / "tests"))

import duckdb  # noqa: E402
import streamlit as st  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

import pages._state as page_common  # noqa: E402
from bench.store import app_data
from bench.store import db  # noqa: E402
from bench.store.ingest import ingest_rows  # noqa: E402
from estimator.model import from_hf_config  # noqa: E402
from estimator.presets import load_config  # noqa: E402
from rowfactory import make_row  # noqa: E402

APP = str(REPO / "app.py")
SYNTHETIC_SQL = Path(__file__).with_name("bench_app_synthetic.sql")
TEMPLATE_MODELS = ("llama-3.1-8b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b", "gpt2")
# (page file, label, query parameters): the Will-it-fit and Curves views use a model that has rows
PAGES = (
    ("pages/fit.py", "Will it fit?", {"model": "llama-3.1-8b", "batch": "4", "seq": "1024"}),
    ("pages/benchmarks.py", "Benchmarks", {}),
    ("pages/curves.py", "Curves", {"model": "llama-3.1-8b", "batch": "4", "seq": "1024"}),
    ("pages/calibrate.py", "Calibrate", {}),
    ("pages/multi_gpu.py", "Multi-GPU", {"model": "llama-3.1-8b", "batch": "4", "seq": "1024"}),
    ("pages/contribute.py", "Contribute", {}),
)
TARGETS_S = {"shipped": 1.0, "synthetic": 2.0}
BODY_S: list[float] = []  # seconds of each page body run, recorded by the wrapper below


def _timed_run_page(body, _run=page_common.run_page) -> None:
    """pages/_common.run_page, timed: the page's own work, without AppTest's harness around the script."""
    t0 = time.perf_counter()
    try:
        _run(body)
    finally:
        BODY_S.append(time.perf_counter() - t0)


page_common.run_page = _timed_run_page  # the pages look run_page up on the module at each run


def synthetic_db(path: Path, n_rows: int) -> float:
    """Build the synthetic database; returns seconds taken."""
    t0 = time.perf_counter()
    templates = []
    for name in TEMPLATE_MODELS:
        _, cfg = load_config(name)
        params = from_hf_config(cfg, name).params
        templates.append(make_row(config=cfg, model_name=name, params=params, trainable_params=params,
                                  batch=1, seq=128, peak_alloc_bytes=4 * params, peak_reserved_bytes=5 * params,
                                  **{f"{s}_peak_alloc_bytes": None for s in ("load", "forward", "backward", "optimizer")},
                                  **{f"{s}_peak_reserved_bytes": None for s in ("load", "forward", "backward", "optimizer")}))
    report = ingest_rows(templates, path)
    assert report.written and report.inserted == len(templates), report
    with db.connect(path) as con:
        con.execute(SYNTHETIC_SQL.read_text(), {"n": n_rows - len(templates)})
        con.execute("CHECKPOINT")
    return time.perf_counter() - t0


def run_page(page: str, query: dict) -> tuple[float, float]:
    """(seconds of the AppTest run, seconds of the page body) for a first render of `page`.

    The session is opened on the light Contribute page first, so that every page, the home page included,
    is timed as the second script run of a session (the first carries AppTest's own session set-up)."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.switch_page("pages/contribute.py")
    at.run()
    at.switch_page(page)
    at.query_params.update(query)
    st.cache_data.clear()
    BODY_S.clear()
    t0 = time.perf_counter()
    at.run()
    elapsed = time.perf_counter() - t0
    if at.exception:
        raise RuntimeError(f"{page}: {at.exception[0].value}")
    return elapsed, sum(BODY_S)


def rerun_page(page: str, query: dict) -> float:
    """Seconds for a rerun of `page` with warm caches (e.g. after a widget change)."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.switch_page(page)
    at.query_params.update(query)
    at.run()
    t0 = time.perf_counter()
    at.run()
    return time.perf_counter() - t0


def time_pages(db_path: Path, repeats: int) -> list[tuple[str, float, float, float, float]]:
    """Per page: (label, median first render s, slowest first render s, median page body s, warm rerun s)."""
    os.environ["WILLITFIT_DB"] = str(db_path)
    rows = []
    for page, label, query in PAGES:
        runs, bodies = [], []
        for _ in range(repeats):
            st.cache_data.clear()
            run_s, body_s = run_page(page, query)
            runs.append(run_s)
            bodies.append(body_s)
        warm = rerun_page(page, query)
        rows.append((label, statistics.median(runs), max(runs), statistics.median(bodies), warm))
        print(f"  {label:<14} first render median {statistics.median(runs):6.3f} s  max {max(runs):6.3f} s  "
              f"page body {statistics.median(bodies):6.3f} s  warm rerun {warm:6.3f} s")
    return rows


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, streamlit {st.__version__}, "
            f"duckdb {duckdb.__version__}, {dt.date.today().isoformat()}")


def table(rows, target_s: float) -> list[str]:
    out = ["| page | first render, median s | slowest s | of which the page body, median s | warm rerun s | target |",
           "| --- | ---: | ---: | ---: | ---: | --- |"]
    for label, med, worst, body, warm in rows:
        out.append(f"| {label} | {med:.3f} | {worst:.3f} | {body:.3f} | {warm:.3f} | "
                   f"{'met' if worst < target_s else 'MISSED'} (< {target_s:g} s) |")
    return out


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} cores while it ran"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="runs in the synthetic database")
    ap.add_argument("--repeats", type=int, default=3, help="timed first renders per page")
    ap.add_argument("--shipped", default=str(REPO / "data" / "benchmarks.duckdb"), help="the shipped database")
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/performance.md alone")
    ap.add_argument("--doc", default=str(REPO / "docs" / "performance.md"), help="the file to update")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["WILLITFIT_CALIBRATION"] = str(tmp / "calibration.json")  # never the shipped file
        os.environ["HF_HUB_OFFLINE"] = "1"
        synth = tmp / "synthetic.duckdb"
        build_s = synthetic_db(synth, args.rows)
        print(f"synthetic database: {args.rows:,} runs built in {build_s:.1f} s")
        print("warm-up (imports every module each page uses)")
        time_pages(synth, 1)
        shipped = Path(args.shipped)
        results = {}
        if shipped.is_file():
            n_shipped = db.count_runs(shipped)
            print(f"shipped database {shipped} ({n_shipped:,} runs)")
            results["shipped"] = (f"the shipped `data/benchmarks.duckdb` ({n_shipped:,} runs)", time_pages(shipped, args.repeats))
        else:
            print(f"no shipped database at {shipped}; timing the empty-database pages instead")
            results["shipped"] = ("no database (the shipped file was absent when this ran)",
                                  time_pages(tmp / "absent.duckdb", args.repeats))
        results["synthetic"] = (f"a synthetic database of {args.rows:,} runs", time_pages(synth, args.repeats))

    lines = ["## App", "", f"Measured by `python scripts/bench_app.py` on {machine()}; {load_average()}.", "",
             "First render of each page, as a new visitor to a running server gets it: modules already imported, "
             "data caches empty (`st.cache_data.clear()`), timed as an `AppTest` run started from app.py (the "
             "page's Python: database reads, estimates, chart specs; not the browser's drawing). 'Page body' is "
             "the part spent inside the page's own code (`pages/_common.run_page`), the rest being AppTest's harness "
             "around the script. "
             f"{args.repeats} timed renders per page after a warm-up pass; 'warm rerun' is the same page run "
             "again with its caches filled, what a widget change costs. The Will-it-fit, Curves and Multi-GPU "
             "views are of llama-3.1-8b at batch 4, seq 1024, a model with rows in both databases. What keeps "
             "the large database fast: the Benchmarks table shows the newest "
             f"{app_data.TABLE_LIMIT:,} filtered runs (the download has all), the Calibrate page fits a fixed "
             f"pseudo-random sample of {app_data.CALIBRATION_SAMPLE:,} runs per family (`python -m bench "
             "calibrate` fits all), and stored runs are estimated once per distinct setting.", ""]
    for key, (what, rows) in results.items():
        lines += [f"On {what}:", "", *table(rows, TARGETS_S[key]), ""]
    section = "\n".join(lines) + "\n"
    print()
    print(section)
    if not args.no_doc:
        replace_section("## App", section, Path(args.doc))
        print(f"updated {args.doc}")


if __name__ == "__main__":
    main()
