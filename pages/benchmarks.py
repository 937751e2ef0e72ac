"""Benchmarks: browse the stored runs (measured, traced, published), one run's full record, and downloads."""
from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from bench.share import pull as share_pull
from bench.share import remote
from bench.share.remote import ShareError
from bench.store import app_data
from bench.store.rows import STAGES
from estimator.units import GiB
from pages import _state as state, _data as reads

PAGE = "bench"
FILTER_LABELS = {"source": "Source", "metric": "Metric", "gpu_name": "GPU", "model_name": "Model", "mode": "Mode",
                 "method": "Method", "precision": "Precision"}
METRIC_HELP = ("What the number is: allocated (torch.cuda.max_memory_allocated), active, reserved "
               "(max_memory_reserved: the caching allocator's segments), device (nvidia-smi), tracemalloc (PEFT's "
               "begin + peak delta of max_memory_allocated), capacity (the largest setting that fits a card, not a "
               "peak), unknown (the source does not say).")
OOM_CHOICES = {"all": "all runs", "oom": "OOM only", "ok": "no OOM"}
DETAIL_CHOICES = 200  # runs offered in the detail selector (a longer list is slow to build and to scroll)
GIB_COLUMNS = ("peak_alloc_gib", "peak_reserved_gib", "nvml_used_gib", "gpu_total_gib")
DATASETS = {"local": "local database", "shared": "shared dataset"}


def choose_database():
    """The database to browse: the local one, or (when WILLITFIT_DATASET is set and chosen) the read-only copy of the
    shared dataset's contributions cached on this machine. None after an error message."""
    url = remote.configured()
    if not url:
        return reads.db_path()
    choice = st.sidebar.radio("Runs from", list(DATASETS), format_func=DATASETS.get, key=f"{PAGE}:dataset",
                              help=f"The shared dataset is {url} ({remote.ENV}); it is read-only here. "
                                   "`python -m bench pull` adds its rows to your local database.")
    if choice == "local":
        return reads.db_path()
    try:
        ds = remote.parse_dataset(url)
    except ValueError as e:
        st.error(f"{e}. Fix {remote.ENV} and restart the app.")
        return None
    if st.sidebar.button("Fetch new contributions", key=f"{PAGE}:fetch",
                         help="Download the contributions not yet cached here; each is checked against its "
                              "manifest's sha256 and every row validated again before it shows."):
        try:
            fetched = share_pull.refresh(ds.url)
        except ShareError as e:
            st.error(str(e))
        else:
            for file, reason in fetched.skipped:
                st.warning(f"Skipped {file}: {reason}")
    path, refused = reads.shared_db(ds.url)
    for file, reason in refused:
        st.warning(f"Skipped {file}: {reason}")
    st.caption(f"Browsing the shared dataset **{ds.url}** (read-only): the contributions fetched to this machine. "
               "`python -m bench pull` adds them to your local database.")
    if reads.count_runs(path) == 0:
        st.info("No contribution of the shared dataset is cached here yet: press **Fetch new contributions** in "
                "the sidebar.")
        return None
    return path


def filters_sidebar(path) -> dict:
    """Sidebar filters -> {column: [values] or bool}; an empty choice means no filter on that column."""
    values = reads.filter_values(path)
    st.sidebar.header("Filter runs")
    filters = {}
    for col, label in FILTER_LABELS.items():
        options = values.get(col, [])
        key = f"{PAGE}:{col}"
        if key in st.session_state:  # values of the other database (local / shared) are not options here
            st.session_state[key] = [v for v in st.session_state[key] if v in options]
        chosen = st.sidebar.multiselect(label, options, key=key,
                                        help=METRIC_HELP if col == "metric" else
                                        f"Show only runs with these {label.lower()} values; empty = all.")
        filters[col] = chosen or None
    oom = st.sidebar.radio("Out of memory", list(OOM_CHOICES), format_func=OOM_CHOICES.get, key=f"{PAGE}:oom",
                           help="OOM runs are data too: they mark where the memory cliff is.")
    filters["oom"] = {"all": None, "oom": True, "ok": False}[oom]
    return {k: v for k, v in filters.items() if v is not None}


def summary(filters: dict, path) -> int:
    df = reads.counts(filters, path)
    total = int(df["n_runs"].sum()) if len(df) else 0
    c = st.columns(5)
    c[0].metric("Runs", f"{total:,}", help="Runs matching the filters.")
    c[1].metric("OOM runs", f"{int(df['n_oom'].sum()) if len(df) else 0:,}")
    for i, source in enumerate(("measured", "traced", "published"), start=2):
        n = int(df.loc[df["source"] == source, "n_runs"].sum()) if len(df) else 0
        c[i].metric(f"{source.capitalize()} runs", f"{n:,}")
    if len(df):
        st.dataframe(df.rename(columns={"n_runs": "runs", "n_oom": "OOM runs", "n_gpus": "GPUs",
                                        "n_models": "models", "last_created_at": "newest run (UTC)"}),
                     hide_index=True)
    return total


def runs_section(filters: dict, total: int, path) -> pd.DataFrame:
    df = reads.runs_table(filters, path)
    if total > len(df):
        st.caption(f"Showing the newest {len(df):,} of {total:,} runs; the download below has them all.")
    published = tuple(df.loc[df["source"] == "published", "run_id"]) if len(df) else ()
    if published:  # the estimator beside each published number (shipped profiles only: nothing is traced here)
        est = reads.published_estimates(published, path)
        df.insert(6, "estimate_gib", df["run_id"].map(est) / GiB)
        df.insert(7, "error", (df["estimate_gib"] - df["measured_gib"]) / df["measured_gib"] * 100)
    config = {c: st.column_config.NumberColumn(c.replace("_gib", " (GiB)"), format="%.3f",
                                               help="GiB = 2^30 bytes") for c in GIB_COLUMNS + ("measured_gib",)}
    # the run's number, whatever its source: a GPU's peak, a trace's, or the published value (its metric beside it)
    config["measured_gib"] = st.column_config.NumberColumn(
        "peak (GiB)", format="%.3f", help="The run's peak, GiB = 2^30 bytes: measured on a GPU, traced on fake "
                                          "tensors, or the number as published (its counter in 'metric')")
    config["measured_gb"] = st.column_config.NumberColumn("peak (GB)", format="%.3f", help="GB = 10^9 bytes")
    config["estimate_gib"] = st.column_config.NumberColumn(
        "estimate (GiB)", format="%.3f", help="willitfit's bytes for the published metric (allocated, or reserved "
                                              "for a reserved number); empty where the workload cannot be priced "
                                              "from shipped profiles")
    config["error"] = st.column_config.NumberColumn("error (%)", format="%+.1f", help="(estimate - measured) / measured")
    config["source_url"] = st.column_config.LinkColumn("source", help="where the number was published")
    config["params"] = st.column_config.NumberColumn("params", format="localized")
    config["created_at"] = st.column_config.DatetimeColumn("created (UTC)")
    text = [c for c in df.columns if pd.api.types.is_string_dtype(df[c]) or df[c].dtype == object]
    st.dataframe(df.assign(**{c: df[c].fillna("") for c in text}), hide_index=True, column_config=config)
    return df


def detail_section(df: pd.DataFrame, path) -> None:
    st.subheader("One run in full")
    if df.empty:
        return
    top = df.head(DETAIL_CHOICES).astype({"batch": str, "seq": str, "gpu_name": str})
    labels = dict(zip(top["run_id"], top["source"] + " · " + top["model_name"] + " · " + top["mode"] + " b="
                      + top["batch"] + " s=" + top["seq"] + " · " + top["gpu_name"] + " · " + top["run_id"].str[:12]))
    run_id = st.selectbox("Run", list(labels), format_func=labels.get, key=f"{PAGE}:run",
                          help=f"One of the newest {DETAIL_CHOICES} filtered runs (narrow the filters to reach "
                               "others): every column of the stored row, provenance, per-stage peaks, config.")
    row = reads.run_detail(run_id, path)
    if row is None:
        st.warning("That run is no longer in the database (it changed since the table was read); reload.")
        return
    stages = pd.DataFrame([{"stage": s, "peak allocated (GiB)": _gib(row.get(f"{s}_peak_alloc_bytes")),
                            "peak reserved (GiB)": _gib(row.get(f"{s}_peak_reserved_bytes"))} for s in STAGES])
    stages = stages.dropna(how="all", subset=["peak allocated (GiB)", "peak reserved (GiB)"])
    left, right = st.columns(2)
    with left:
        st.markdown("**Provenance and workload**")
        skip = {"config_json", "breakdown_json", "per_rank_json", "field_origins"} | {c for c in row if c.endswith("_peak_alloc_bytes")
                                                                    or c.endswith("_peak_reserved_bytes")}
        st.dataframe(pd.DataFrame({"column": [k for k in row if k not in skip],
                                   "value": [_show(row[k]) for k in row if k not in skip]}),
                     hide_index=True, height=420)
    with right:
        st.markdown("**Peaks per stage**")
        st.dataframe(stages, hide_index=True, column_config={
            c: st.column_config.NumberColumn(format="%.3f") for c in stages.columns[1:]})
        if row.get("source") == "published":
            st.markdown(f"**Published** by [{row.get('source_repo')}]({row.get('source_url')}), "
                        f"{row.get('source_section')}, {row.get('source_version')}; reliability "
                        f"{row.get('reliability')}; mapping {row.get('mapping_status')}"
                        + (f": {row.get('mapping_reason')}" if row.get("mapping_reason") else "."))
        for col, title in (("field_origins", "Workload fields: stated by the source or inferred"),
                           ("config_json", "config.json"), ("breakdown_json", "Breakdown at the peak (bytes)"),
                           ("per_rank_json", "Per-rank peaks (bytes)")):
            text = row.get(col)
            if isinstance(text, str) and text:
                with st.expander(title, expanded=col in ("config_json", "field_origins")):
                    st.json(json.loads(text), expanded=1)


def _gib(v):
    return None if v is None or pd.isna(v) else v / GiB


def _show(v) -> str:
    return "" if v is None or (not isinstance(v, str) and pd.isna(v)) else str(v)


def download_section(filters: dict, db_file) -> None:
    st.subheader("Download")
    fmt = st.radio("Format", app_data.EXPORT_FORMATS, horizontal=True, key=f"{PAGE}:fmt",
                   help="Every column of `runs`, so the file can be ingested again (python -m bench ingest).")
    path = str(db_file)
    st.download_button(f"Download the filtered runs as {fmt.upper()}",
                       data=lambda: app_data.export_bytes(path, filters, fmt),  # built only when clicked
                       file_name=f"willitfit-runs.{fmt}",
                       mime="text/csv" if fmt == "csv" else "application/vnd.apache.parquet",
                       icon=":material/download:", key=f"{PAGE}:download")


def main() -> None:
    st.title("Benchmarks")
    st.caption("Runs stored in the database: **measured** on a GPU, **traced** on fake CPU tensors, or "
               "**published**. Sizes in GiB (2^30 bytes).")
    path = choose_database()
    if path is None or reads.empty_db_notice(path):
        return
    filters = filters_sidebar(path)
    total = summary(filters, path)
    if total == 0:
        st.info("No run matches these filters; clear some in the sidebar.")
        return
    df = runs_section(filters, total, path)
    detail_section(df, path)
    download_section(filters, path)


state.run_page(main)
