"""Cached reads of the database for the pages (bench.store.app_data through st.cache_data, keyed by the file's
fingerprint so a new ingest shows at once). Nothing here computes memory.

Not a page (the underscore; app.py routes with st.navigation, which ignores files it is not given).
"""
from __future__ import annotations
from pathlib import Path
import streamlit as st
from bench.share import pull as share_pull
from bench.share import remote
from bench.store import app_data
from bench.store import db
from estimator import spec


def db_path() -> Path:
    return db.default_db_path()


def fingerprint(path: Path | None = None) -> tuple[int, int]:
    """(mtime_ns, size) of the database: part of every cache key, so a changed file is read again."""
    return db.db_fingerprint(path or db_path())


@st.cache_data(show_spinner=False, max_entries=16)
def _count_runs(path: str, fp: tuple) -> int:
    return app_data.count_runs(path)


@st.cache_data(show_spinner=False, max_entries=16)
def _filter_values(path: str, fp: tuple) -> dict:
    return app_data.filter_values(path)


@st.cache_data(show_spinner=False, max_entries=64)
def _counts(path: str, fp: tuple, filters: dict):
    return app_data.counts(path, filters)


@st.cache_data(show_spinner=False, max_entries=64)
def _runs_table(path: str, fp: tuple, filters: dict):
    return app_data.runs_table(path, filters)


@st.cache_data(show_spinner=False, max_entries=16)
def _published_estimates(path: str, fp: tuple, run_ids: tuple):
    return app_data.published_estimates(path, run_ids)


@st.cache_data(show_spinner=False, max_entries=64)
def _run_detail(path: str, fp: tuple, run_id: str):
    return app_data.run_detail(path, run_id)


@st.cache_data(show_spinner=False, max_entries=128)
def _closest(path: str, fp: tuple, config: dict, model_name, workload: dict, parallel: dict,
             sources: tuple = ("measured", "traced")):
    targets = tuple(t for t in workload["lora_targets"].split(",") if t)
    return app_data.closest_runs(path, config, model_name, spec.Workload(**{**workload, "lora_targets": targets}),
                                 spec.Parallel(**parallel), sources=sources)


@st.cache_data(show_spinner=False, max_entries=64)
def _points(path: str, fp: tuple, config: dict, model_name, batch: int, seq: int, filters: dict):
    return app_data.points(path, config, model_name, batch, seq, filters)


# The readers below take the database to read (`path`): the local one by default, or the shared dataset's read-only
# copy (shared_db) on the Benchmarks page.

def count_runs(path: Path | None = None) -> int:
    path = path or db_path()
    return _count_runs(str(path), fingerprint(path))


def filter_values(path: Path | None = None) -> dict:
    path = path or db_path()
    return _filter_values(str(path), fingerprint(path))


def counts(filters: dict, path: Path | None = None):
    path = path or db_path()
    return _counts(str(path), fingerprint(path), filters)


def runs_table(filters: dict, path: Path | None = None):
    path = path or db_path()
    return _runs_table(str(path), fingerprint(path), filters)


def published_estimates(run_ids: tuple, path: Path | None = None) -> dict:
    path = path or db_path()
    return _published_estimates(str(path), fingerprint(path), tuple(run_ids))


def run_detail(run_id: str, path: Path | None = None):
    path = path or db_path()
    return _run_detail(str(path), fingerprint(path), run_id)


@st.cache_data(show_spinner="Reading the shared dataset's cached contributions", max_entries=8)
def _shared_db(url: str, listing: tuple) -> tuple[str, list]:
    path, report = share_pull.browse_db(remote.parse_dataset(url))
    return str(path), report.skipped


def shared_db(url: str) -> tuple[Path, list[tuple[str, str]]]:
    """The read-only DuckDB copy of the shared dataset's cached contributions, and the files it refused; rebuilt
    when the cache changes (its listing is the cache key). ValueError naming `dataset` for a bad address."""
    ds = remote.parse_dataset(url)
    folder = share_pull.cache_root(ds) / remote.CONTRIBUTIONS
    listing = tuple(sorted((p.name, p.stat().st_size) for p in folder.glob("*.parquet"))) if folder.is_dir() else ()
    path, skipped = _shared_db(ds.url, listing)
    return Path(path), skipped


def closest_runs(config: dict, model_name, workload: spec.Workload, parallel: spec.Parallel,
                 sources: tuple = ("measured", "traced")):
    return _closest(str(db_path()), fingerprint(), config, model_name, spec.spec_dict(workload),
                    spec.spec_dict(parallel), tuple(sources))


def points(config: dict, model_name, batch: int, seq: int, filters: dict):
    return _points(str(db_path()), fingerprint(), config, model_name, batch, seq, filters)


def empty_db_notice(path: Path | None = None) -> bool:
    """Show an info box and return True when there is nothing to read yet."""
    path = path or db_path()
    if not app_data.db_exists(path):
        st.info(f"No benchmark database at `{path}` yet. Build one with `python -m bench build-db`, ingest "
                "runs with `python -m bench ingest`, or add measurements on the Contribute page.")
        return True
    if count_runs(path) == 0:
        st.info(f"The benchmark database `{path}` holds no runs yet. Add some on the Contribute page or with "
                "`python -m bench ingest FILE`.")
        return True
    return False
