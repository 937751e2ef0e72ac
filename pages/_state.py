"""What every page shares to stay safe and linkable: the error guard (an exception becomes one st.error with
its fix, never a traceback), the inputs that live in the URL (`Field`) and their widgets.

Not a page (the underscore; app.py routes with st.navigation, which ignores files it is not given).
"""
from __future__ import annotations
import logging
import re
from dataclasses import dataclass
import streamlit as st
from bench.store import db


log = logging.getLogger("willitfit.app")


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
