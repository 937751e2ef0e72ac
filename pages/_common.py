"""What every page shares: the error guard, cached database reads, URL state and the workload widgets.

Not a page (the underscore; app.py routes with st.navigation, which ignores files it is not given).
Nothing here computes memory: numbers come from `estimator` and `bench`, this file only moves them between
widgets, the URL and the cache.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from bench.store import app_data

from bench.store import db
from estimator import knobs, spec
from estimator.gpus import gpu_names, load_gpus
from estimator.model import Model
from estimator.presets import preset_names
from estimator.units import fmt_bytes
from estimator.reserved import alloc_mode
from estimator.model import from_hf_config
from estimator.store import where
from estimator import store
from estimator.estimate import traced_class

log = logging.getLogger("willitfit.app")

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_GPU = "h100-sxm-80gb"


# ---------------------------------------------------------------- the error guard

def explain(e: Exception) -> str:
    """One user-facing sentence for an exception, saying what to do about it."""
    if isinstance(e, db.DatabaseBusy):
        return f"{e}. Another process is writing the database; wait a moment and reload the page."
    if type(e).__module__.startswith(("duckdb", "_duckdb")):
        return (f"Could not read the database at {db.default_db_path()} ({type(e).__name__}: {e}). "
                "Point WILLITFIT_DB at a willitfit DuckDB file, or rebuild it with `python -m bench build-db`.")
    if isinstance(e, ValueError):
        return f"{e}. Change the input named at the start of this message."
    return (f"Unexpected error ({type(e).__name__}: {e}). Reload the page; if it persists, report it "
            "with this page's URL, which holds every input.")


def run_page(body) -> None:
    """Run a page body; any exception becomes an st.error with its fix, never a traceback on screen.

    Streamlit's own control flow (st.rerun, st.stop, page switches) raises BaseException subclasses,
    which pass through untouched.
    """
    try:
        body()
    except ValueError as e:  # invalid input (the specs name the field): the user's to fix, not a bug
        log.info("page input rejected: %s", e)
        st.error(explain(e))
    except Exception as e:  # noqa: BLE001 - the whole point: the page shows a message, the log keeps the trace
        log.exception("page failed")
        st.error(explain(e))


def or_error(read, default):
    """`read()`, or `default` after an st.error: a page whose stored runs cannot be read still shows its
    analytic part (a locked, corrupt or foreign database file is the usual cause)."""
    try:
        return read()
    except (db.DatabaseBusy, OSError) as e:
        st.error(explain(e))
    except Exception as e:  # noqa: BLE001 - duckdb's errors share no base class with a useful name
        if not type(e).__module__.startswith(("duckdb", "_duckdb")):
            raise
        st.error(explain(e))
    return default


# ---------------------------------------------------------------- cached database reads

def db_path() -> Path:
    return db.default_db_path()


def fingerprint() -> tuple[int, int]:
    """(mtime_ns, size) of the database: part of every cache key, so a changed file is read again."""
    return db.db_fingerprint(db_path())


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


def count_runs() -> int:
    return _count_runs(str(db_path()), fingerprint())


def filter_values() -> dict:
    return _filter_values(str(db_path()), fingerprint())


def counts(filters: dict):
    return _counts(str(db_path()), fingerprint(), filters)


def runs_table(filters: dict):
    return _runs_table(str(db_path()), fingerprint(), filters)


def published_estimates(run_ids: tuple) -> dict:
    return _published_estimates(str(db_path()), fingerprint(), tuple(run_ids))


def run_detail(run_id: str):
    return _run_detail(str(db_path()), fingerprint(), run_id)


def closest_runs(config: dict, model_name, workload: spec.Workload, parallel: spec.Parallel,
                 sources: tuple = ("measured", "traced")):
    return _closest(str(db_path()), fingerprint(), config, model_name, spec.spec_dict(workload),
                    spec.spec_dict(parallel), tuple(sources))


def points(config: dict, model_name, batch: int, seq: int, filters: dict):
    return _points(str(db_path()), fingerprint(), config, model_name, batch, seq, filters)


def empty_db_notice() -> bool:
    """Show an info box and return True when there is nothing to read yet."""
    path = db_path()
    if not app_data.db_exists(path):
        st.info(f"No benchmark database at `{path}` yet. Build one with `python -m bench build-db`, ingest "
                "runs with `python -m bench ingest`, or add measurements on the Contribute page.")
        return True
    if count_runs() == 0:
        st.info(f"The benchmark database `{path}` holds no runs yet. Add some on the Contribute page or with "
                "`python -m bench ingest FILE`.")
        return True
    return False


# ---------------------------------------------------------------- URL state

@dataclass(frozen=True)
class Field:
    """One input that lives in the URL: its query-parameter name, type, default and allowed values."""

    name: str                   # query parameter, and the Workload/Parallel attribute when there is one
    kind: str                   # 'choice' | 'int' | 'bool' | 'multi' | 'text'
    default: object
    choices: tuple = ()         # allowed values for 'choice' (and candidates for 'multi')
    lo: int = 0
    hi: int = 0
    label: str = ""
    help: str = ""

    def parse(self, text: str):
        """The value a URL's text stands for; ValueError naming the parameter and what is allowed."""
        if self.kind == "choice":
            if text not in self.choices:
                raise ValueError(f"{self.name}: {text[:40]!r} is not one of {', '.join(map(str, self.choices[:12]))}"
                                 + (", ..." if len(self.choices) > 12 else ""))
            return text
        if self.kind == "int":
            if not re.fullmatch(r"[0-9]{1,12}", text.strip()):
                raise ValueError(f"{self.name}: {text[:40]!r} is not a whole number")
            value = int(text)
            if not self.lo <= value <= self.hi:
                raise ValueError(f"{self.name}: {value} is out of range {self.lo}..{self.hi}")
            return value
        if self.kind == "bool":
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0"):
                raise ValueError(f"{self.name}: {text[:40]!r} is not true or false")
            return low in ("true", "1")
        if self.kind == "multi":
            items = tuple(t.strip() for t in text.split(",") if t.strip())
            if not items or not all(re.fullmatch(r"[A-Za-z0-9_.]{1,64}", t) for t in items):
                raise ValueError(f"{self.name}: {text[:40]!r} is not a comma-separated list of module names")
            return list(items)
        if len(text) > 200:
            raise ValueError(f"{self.name}: longer than 200 characters")
        return text

    def dump(self, value) -> str:
        if self.kind == "multi":
            return ",".join(value)
        if self.kind == "bool":
            return "true" if value else "false"
        return str(value)


def state_key(page: str, name: str) -> str:
    return f"{page}:{name}"


def init_state(page: str, fields: list[Field]) -> None:
    """Seed the page's widget state: from the URL on the page's first run in this session, else defaults.

    A URL value that does not validate is dropped with a warning naming it, and the default is used.
    """
    flag = f"_url_read:{page}"
    if flag not in st.session_state:
        st.session_state[flag] = True
        params = st.query_params.to_dict()
        ignored = []
        for f in fields:
            if f.name not in params:
                continue
            try:
                st.session_state[state_key(page, f.name)] = f.parse(params[f.name])
            except ValueError as e:
                ignored.append(str(e))
        if ignored:
            st.warning("Some values in the link were not valid and were replaced by defaults: "
                       + "; ".join(ignored) + ".")
    for f in fields:
        st.session_state.setdefault(state_key(page, f.name), f.default)


def value(page: str, name: str):
    return st.session_state[state_key(page, name)]


def write_url(page: str, fields: list[Field], shown: set[str]) -> None:
    """Put the shown inputs in the URL, so that a copied link reproduces this view."""
    params = {f.name: f.dump(value(page, f.name)) for f in fields if f.name in shown}
    if params != st.query_params.to_dict():
        st.query_params.from_dict(params)


def widget(page: str, f: Field, container=st, **kwargs):
    """Draw the widget for `f`, bound to its state key, and return its value."""
    key = state_key(page, f.name)
    common = dict(key=key, help=f.help, persist_state="session", **kwargs)
    if f.kind == "choice":
        return container.selectbox(f.label, f.choices, **common)
    if f.kind == "int":
        return container.number_input(f.label, min_value=f.lo, max_value=f.hi, step=1, **common)
    if f.kind == "bool":
        return container.toggle(f.label, **common)
    if f.kind == "multi":
        return container.multiselect(f.label, f.choices, **common)
    return container.text_input(f.label, **common)


# ---------------------------------------------------------------- the shared inputs

_W = spec.Workload()


def workload_fields() -> list[Field]:
    """Every Workload input, generated from its declaration (estimator.spec.Workload: label, help, choices)."""
    return [Field(d.name, d.kind, list(d.default) if d.kind == "multi" else d.default, d.knob.choices,
                  lo=d.knob.lo, hi=d.knob.hi, label=d.knob.label, help=d.knob.help) for d in knobs.declared()]


def hardware_fields() -> list[Field]:
    names = tuple(gpu_names())
    return [
        Field("gpu", "choice", DEFAULT_GPU if DEFAULT_GPU in names else names[0], names, label="GPU",
              help="Memory is what the driver reports (nvidia-smi memory.total), e.g. 81559 MiB for an "
                   "'80 GB' H100; see data/gpus.json."),
        Field("strategy", "choice", "single", spec.STRATEGIES, label="Parallelism strategy",
              help="single GPU; ddp replicates everything; zero1/2/3 shard optimizer states / + gradients / "
                   "+ weights; fsdp = ZeRO-3; tp splits each matrix; pp splits the layers; ep the experts."),
        Field("gpus", "int", 1, lo=1, hi=spec.MAX_GPUS, label="Number of GPUs",
              help="World size. Memory is reported per GPU (the most loaded one)."),
    ]


def alloc_conf_field() -> Field:
    return Field("alloc", "text", "", label="PYTORCH_CUDA_ALLOC_CONF",
                 help="The allocator settings the run uses, e.g. expandable_segments:True. Changes the reserved "
                      "bytes through the fitted classes (docs/allocator.md); empty = torch's defaults.")


def alloc_conf_input(page: str, field: Field, container) -> str | None:
    """The alloc-conf text box; a string torch would reject shows parse_alloc_conf's one line and gives None."""

    text = widget(page, field, container).strip()
    try:
        alloc_mode(text)
    except ValueError as e:
        st.error(f"{e}. Fix PYTORCH_CUDA_ALLOC_CONF in the sidebar (or leave it empty).")
        return None
    return text


def model_field() -> Field:
    names = tuple(preset_names())
    return Field("model", "choice", DEFAULT_MODEL if DEFAULT_MODEL in names else names[0], names,
                 label="Model preset", help="A Hugging Face config.json shipped in data/models/.")


def lora_target_options(model: Model) -> list[str]:
    """Names PEFT can target in this model (its Linear modules, read from the model itself)."""
    return model.inventory.lora_target_names()


def shown_workload_fields(mode: str, method: str, advanced: bool = False) -> list[str]:
    """Which workload inputs apply (from each field's declaration): inference has no optimizer or LoRA, training
    no generated tokens. advanced=True adds the recipe knobs the sidebar folds under "More settings"."""
    return [d.name for d in knobs.declared() if knobs.applies(d, mode, method) and (advanced or not d.knob.advanced)]


def workload_from_dict(values: dict) -> spec.Workload:
    """A Workload from input values; inputs that do not apply to the mode/method keep the spec defaults.

    Raises ValueError (naming the field) for a contradictory combination, which the page shows.
    """
    shown = shown_workload_fields(values.get("mode", _W.mode), values.get("method", _W.method), advanced=True)
    kwargs = {k: values[k] for k in shown if k in values}
    if "lora_targets" in kwargs:
        kwargs["lora_targets"] = tuple(kwargs["lora_targets"])
    return spec.Workload(**kwargs)


def prepare_lora_targets(page: str, options: list[str]) -> None:
    """Keep the selected LoRA targets among the model's modules (a model change can invalidate them)."""
    key = state_key(page, "lora_targets")
    chosen = [t for t in st.session_state.get(key, []) if t in options]
    if not chosen:
        chosen = [t for t in _W.lora_targets if t in options] or options[:1]
    if chosen != st.session_state.get(key):
        st.session_state[key] = chosen


def workload_inputs(page: str, fields: dict[str, Field], container) -> tuple[dict, list[str]]:
    """Draw the workload widgets that apply, the advanced ones folded; returns (values, names shown)."""
    mode = widget(page, fields["mode"], container)
    method = widget(page, fields["method"], container) if mode == "train" else _W.method
    shown = shown_workload_fields(mode, method, advanced=True)
    core = set(shown_workload_fields(mode, method))
    values = {"mode": mode, "method": method}
    more = container.expander("More settings (loop, loss, recipe knobs)")
    for name in shown:
        if name not in values:
            values[name] = widget(page, fields[name], container if name in core else more)
    return values, shown


def gpu_label(name: str) -> str:
    gpu = load_gpus()[name]
    return f"{gpu.display_name} ({fmt_bytes(gpu.memory_bytes, 'GiB', 1)})"


def both_units(n_bytes: int | float) -> str:
    """'12.55 GiB (13.48 GB)': the binary unit first, the decimal one beside it."""
    return f"{fmt_bytes(n_bytes, 'GiB')} ({fmt_bytes(n_bytes, 'GB')})"


# ---------------------------------------------------------------- models and their profiles

NO_TRACE = dict(derive=False)  # searches, advice and comparisons price what has a profile; they never trace


def load_model(config: dict, name: str):
    """The Model for a config (its inventory: shipped, cached, or read once from transformers on meta)."""

    if where(config) is None:
        with st.spinner(f"Reading {name}'s parameters from transformers (meta device, no weights)..."):
            return from_hf_config(config, name)
    return from_hf_config(config, name, derive=False)


def ensure_profile(model, w: spec.Workload, par: spec.Parallel) -> dict:
    """Make sure the profile this (workload, parallel) evaluates exists; derive it with a progress bar if not.
    Returns its provenance, with 'where' = shipped | cache | derived now."""

    tw, tp, _ = traced_class(w, par)
    key = store.profile_key(tw, tp)
    found = store.where(model.config, key=key)
    if found is None:
        bar = st.progress(0.0, text=f"Deriving {model.name}'s memory profile for this workload: tracing the "
                                    "real model at reduced depth on fake tensors...")

        def progress(done: int, total: int, message: str) -> None:
            bar.progress(min(1.0, done / max(total, 1)), text=f"{message} ({done}/{total})")

        prof = store.profile(model.config, tw, tp, name=model.name, progress=progress)
        bar.empty()
        return {**prof.provenance, "where": "derived now"}
    prof = store.profile(model.config, tw, tp, name=model.name, derive=False)
    return {**prof.provenance, "where": found}


def provenance_caption(prov: dict) -> str:
    """One sentence saying where the numbers come from."""
    how = {"shipped": "shipped with willitfit", "cache": "derived earlier on this machine",
           "derived now": "derived just now"}.get(prov.get("where"), "")
    depths = "/".join(str(len(d)) for d in prov.get("reduced_depths", []))
    return (f"Memory profile {how}: traced from transformers {prov.get('transformers')} (torch {prov.get('torch')}, "
            f"{prov.get('kernels')} kernels), {prov.get('traces')} traces of {depths} layers in {prov.get('seconds')} s, "
            "extended to the full depth.")
