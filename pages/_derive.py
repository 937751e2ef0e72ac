"""A page never blocks on a derivation: what is priced at once shows at once, the profile derives in the background.

When the profile an estimate needs is on no disk (shipped, cache, bank), `profile_or_background` starts deriving it
in a thread of this session (estimator.estimate.ensure_profile), shows the model states the inventory prices
exactly (estimator.components.model_state_bytes), and a progress bar per trace with the time left, refreshed
every second by a fragment; when the profile is written the page reruns and shows the whole answer. The job lives
in this session's state only: two sessions never share one (both derive, the store's atomic writes keep the file
whole). Not a page (the underscore).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import streamlit as st

from estimator import estimate as estimate_mod
from estimator.breakdown import COMPONENTS
from estimator.components import model_state_bytes
from estimator.spec import Parallel, Workload
from estimator.store import profile_key
from estimator.units import fmt_bytes

POLL_S = 1.0


@dataclass
class Job:
    """One background derivation: its progress as the tracer reports it, its end, its error in one line."""

    label: str
    started_s: float = field(default_factory=time.monotonic)
    done: int = 0
    total: int = 0
    message: str = "starting"
    finished: bool = False
    error: str | None = None
    thread: threading.Thread | None = None

    def progress(self, done: int, total: int, message: str) -> None:
        self.done, self.total, self.message = done, total, message

    def time_left_s(self) -> float | None:
        """Seconds left at the pace so far (traces take about the same time each), or None before the first."""
        if self.done <= 0 or self.total <= 0:
            return None
        spent = time.monotonic() - self.started_s
        return spent / self.done * max(0, self.total - self.done)


def _run(job: Job, model, w: Workload, par: Parallel) -> None:
    try:
        estimate_mod.ensure_profile(model, w, par, job.progress)
    except Exception as e:  # noqa: BLE001 - the page shows it in one line; the thread must not die silently
        job.error = " ".join(str(e).split()) or type(e).__name__
    finally:
        job.finished = True


def _job(page: str, model, w: Workload, par: Parallel) -> Job:
    tw, tp, _ = estimate_mod.traced_class(w, par)
    key = f"{page}:derive:{model.inventory.config_hash[:16]}:{profile_key(tw, tp)}"
    job = st.session_state.get(key)
    if job is None or (job.finished and job.error is None):
        job = Job(label=f"{model.name}, {w.mode} {w.method} {w.recipe}, {par.strategy}")
        job.thread = threading.Thread(target=_run, args=(job, model, w, par), daemon=True, name=key)
        st.session_state[key] = job
        job.thread.start()
    return job


def profile_or_background(page: str, model, w: Workload, par: Parallel) -> dict | None:
    """The profile's provenance when it is on disk (the page goes on); otherwise None after showing the model
    states priced at once and the background derivation's progress (the page stops and reruns when it ends)."""
    if estimate_mod.profile_where(model, w, par) is not None:
        return estimate_mod.ensure_profile(model, w, par)
    job = _job(page, model, w, par)
    if job.error:
        raise ValueError(job.error)
    priced_at_once(model, w)
    _watch(job)
    return None


def priced_at_once(model, w: Workload) -> None:
    """The model states from the inventory: exact, before any trace."""
    parts = model_state_bytes(model.inventory, w)
    st.subheader("Priced at once: what the model holds")
    cols = st.columns(len(parts) + 1)
    for col, name in zip(cols, [c for c in COMPONENTS if c in parts]):
        col.metric(name.replace("_", " "), fmt_bytes(parts[name], "GiB"), help=fmt_bytes(parts[name], "GB"))
    cols[-1].metric("model states", fmt_bytes(sum(parts.values()), "GiB"), help=fmt_bytes(sum(parts.values()), "GB"))
    st.caption("On one GPU before any sharding, from the model's inventory (estimator.components.model_state_bytes). "
               "Activations, temporaries, the allocator's cache and the verdict follow when the step's profile is "
               "derived.")


@st.fragment(run_every=POLL_S)
def _watch(job: Job) -> None:
    if job.finished:
        st.rerun()  # the whole page: the profile is on disk now (or the error shows)
    left = job.time_left_s()
    eta = f", about {left:.0f} s left" if left is not None else ""
    frac = job.done / job.total if job.total else 0.0
    st.progress(min(1.0, frac), text=f"Deriving the memory profile of {job.label} in the background: "
                                    f"{job.message} ({job.done}/{job.total or '?'} traces{eta})")
    st.caption("Each trace runs the real model at reduced depth on fake tensors; the profile is then cached "
               "(and shared through WILLITFIT_PROFILES where one is set), so this happens once per workload class.")
