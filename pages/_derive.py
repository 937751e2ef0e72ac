"""A page never blocks on a derivation: what is priced at once shows at once, the profile derives in the background.

When the profile an estimate needs is on no disk (shipped, cache, bank), `profile_or_background` starts deriving it
in the background (a thread of this session watching `python -m tracer.derive_job`, a process of its own whose traces
run on several cores: tracer.forked), shows the model states the inventory prices
exactly (estimator.components.model_state_bytes), and a progress bar per trace with the time left, refreshed
every second by a fragment; when the profile is written the page reruns and shows the whole answer. The job lives
in this session's state only: two sessions never share one (both derive, the store's atomic writes keep the file
whole). 
"What to change" lists changes whose own profile is not on disk yet; `advice_in_background` derives them one after
another in one thread of this session (each trace reported), and the page reruns when they are priced. Changing
the inputs cancels a job whose rows are no longer asked for (at once: its process is killed, Job.cancel). WILLITFIT_PRICE_ADVICE=0 turns
this off (a busy shared server): such rows are then listed without a number. Not a page (the underscore).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import streamlit as st

from estimator import estimate as estimate_mod
from estimator.breakdown import COMPONENTS
from estimator.components import model_state_bytes
from estimator.spec import Parallel, Workload, spec_dict
from estimator.store import profile_key
from estimator.units import fmt_bytes

POLL_S = 1.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    cancelled: bool = False   # `cancel()`: the derivation's process is killed
    pid: int | None = None    # the derivation's process (its own process group), while it runs

    def cancel(self) -> None:
        """Stop the derivation now: its process group is killed (a trace in flight ends with it)."""
        self.cancelled = True
        if self.pid is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)

    def started(self, pid: int | None) -> None:
        """`derive` tells the process it started, and None once it has been reaped (its id may be reused then)."""
        self.pid = pid
        if pid is not None and self.cancelled:   # cancelled before its process started
            self.cancel()

    def progress(self, done: int, total: int, message: str) -> None:
        if self.cancelled:
            raise Cancelled(self.label)
        self.done, self.total, self.message = done, total, message

    def time_left_s(self) -> float | None:
        """Seconds left at the pace so far (traces take about the same time each), or None before the first."""
        if self.done <= 0 or self.total <= 0:
            return None
        spent = time.monotonic() - self.started_s
        return spent / self.done * max(0, self.total - self.done)


class Cancelled(Exception):
    """Raised from a cancelled job's progress callback: the derivation stops there (Job.cancel kills it at once)."""


@dataclass
class AdviceJob(Job):
    """Derivations of the advice rows not priced yet, one after another: (title, workload, parallel) each."""

    todo: list = field(default_factory=list)     # (class key, workload, parallel) per row
    titles: list = field(default_factory=list)   # the rows' titles, as "What to change" shows them
    current: int = 0
    failed: dict = field(default_factory=dict)   # class key -> the one-line reason it cannot be priced
    derived: set = field(default_factory=set)    # class keys whose profile is on disk now
    row_started_s: float = field(default_factory=time.monotonic)

    def time_left_s(self) -> float | None:
        """This row's time left at its pace so far, plus as long again for each row after it."""
        if self.done <= 0 or self.total <= 0:
            return None
        spent = time.monotonic() - self.row_started_s
        per_row = spent / self.done * self.total
        return spent / self.done * max(0, self.total - self.done) + per_row * (len(self.todo) - self.current - 1)


def _run_advice(job: AdviceJob, model) -> None:
    try:
        for i, (key, w, par) in enumerate(job.todo):
            job.current, job.done, job.total, job.row_started_s = i, 0, 0, time.monotonic()
            try:
                derive(model, w, par, job.progress, job.started)
            except ValueError as e:
                job.failed[key] = " ".join(str(e).split())
            else:
                job.derived.add(key)
    except Exception as e:  # noqa: BLE001 - shown in one line; the thread must not die silently
        if not job.cancelled:   # cancelled (Cancelled, or its killed process's error): no error, as in _run
            job.error = " ".join(str(e).split()) or type(e).__name__
    finally:
        job.finished = True


def background_advice_enabled() -> bool:
    return os.environ.get("WILLITFIT_PRICE_ADVICE", "1") != "0"


def advice_in_background(page: str, model, todo: list) -> tuple[bool, dict[str, str]]:
    """Derive the profiles of the unpriced advice rows `todo` ((title, workload, parallel) each) in the background,
    showing which row and which trace. Returns (whether they are being priced now, {title: why it cannot be priced}
    for the rows whose derivation refused in this session). A job this run does not ask for is cancelled when the
    run ends (`advice_run`). When the job ends the page reruns and the rows show their numbers."""
    if not background_advice_enabled():
        return False, {}
    h = model.inventory.config_hash[:16]
    refused = st.session_state.setdefault(f"{page}:advice-refused", {})  # class key -> reason (this session)
    rows = [(f"{h}:{profile_key(*estimate_mod.traced_class(w, par)[:2])}", title, w, par) for title, w, par in todo]
    for k in [k for k in st.session_state if str(k).startswith(f"{page}:advice:")]:
        if st.session_state[k].finished:
            done = st.session_state.pop(k)
            refused.update(done.failed)
            # derived, yet still asked for: never derive it again in a loop; say so instead
            refused.update({key: "its profile was derived but the estimate still finds none (please report this)"
                            for key, *_ in rows if key in done.derived})
    failed = {title: refused[key] for key, title, _, _ in rows if key in refused}
    rows = [r for r in rows if r[0] not in refused]
    key = f"{page}:advice:{','.join(sorted(r[0] for r in rows))}"
    st.session_state[f"{page}:advice-wanted"] = key
    if not rows:
        return False, failed
    job = st.session_state.get(key)
    if job is None:
        job = AdviceJob(label=model.name, todo=[(k, w, par) for k, _, w, par in rows],
                        titles=[title for _, title, _, _ in rows])
        job.thread = threading.Thread(target=_run_advice, args=(job, model), daemon=True, name=key)
        job.thread.job = job  # tests/conftest.py cancels a job its test left running
        st.session_state[key] = job
        job.thread.start()
    _watch_advice(job)
    return True, failed


@contextmanager
def advice_run(page: str):
    """Wrap one run of a page: an advice job this run did not ask for (other inputs, or the page stopped before its
    advice: an error, another profile deriving) is cancelled when the run ends (its process killed at once)."""
    wanted = f"{page}:advice-wanted"
    st.session_state[wanted] = None
    try:
        yield
    finally:
        for k in [k for k in st.session_state if str(k).startswith(f"{page}:advice:")]:
            if k != st.session_state.get(wanted):
                st.session_state.pop(k).cancel()


@st.fragment(run_every=POLL_S)
def _watch_advice(job: AdviceJob) -> None:
    if job.finished:
        st.rerun()
    left = job.time_left_s()
    eta = f", about {left:.0f} s left" if left is not None else ""
    title = job.titles[job.current] if job.titles else ""
    frac = (job.current + (job.done / job.total if job.total else 0.0)) / max(1, len(job.todo))
    st.progress(min(1.0, frac), text=f"Pricing the rest in the background: change {job.current + 1} of "
                                    f"{len(job.todo)}, {title!r}: its profile, trace {job.done}/{job.total or '?'}"
                                    f"{eta}")


def derive(model, w: Workload, par: Parallel, progress, started=None, ranks: bool = False) -> None:
    """What estimator.estimate.ensure_profile(model, w, par, progress, tp_rank=ranks) does, in a process of its own:
    `python -m tracer.derive_job` derives the profile into the cache (`ranks`: every traced pipeline rank's),
    reporting each trace to `progress` (which raises Cancelled to stop it: the process is killed; `started(pid)` is
    told the process's id, whose group a job can kill at once, Job.cancel, and `started(None)` once it is reaped). A
    refusal raises ValueError with the derivation's one line; a crash, RuntimeError with the last line it wrote."""
    if not ranks and estimate_mod.profile_where(model, w, par) is not None:
        return
    tw, tp = estimate_mod.evaluated_class(model, w, par, ranks)
    job = json.dumps({"config": model.config, "name": model.name, "workload": spec_dict(tw),
                      "parallel": spec_dict(tp)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    error = None
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tracer.derive_job"], cwd=ROOT, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)  # its own process group: its forked copies end with it
        try:
            if started is not None:
                started(proc.pid)
            proc.stdin.write(job)
            proc.stdin.close()
            for line in proc.stdout:
                msg = json.loads(line)
                if "done" in msg:
                    progress(int(msg["done"]), int(msg["total"]), str(msg["message"]))
                elif "error" in msg:
                    error = str(msg["error"])
            proc.wait()
        except BaseException:
            with suppress(ProcessLookupError):   # a cancelled job's group may be gone already (Job.cancel)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            proc.stdout.close()
            if started is not None:
                started(None)   # reaped: nothing to kill any more
        if error is not None:
            raise ValueError(error)
        if proc.returncode != 0:
            err.seek(0)
            last = ([ln for ln in err.read().splitlines() if ln.strip()] or [f"exit status {proc.returncode}"])[-1]
            raise RuntimeError(f"derivation: its process failed: {last.strip()[:300]}")
    estimate_mod.ensure_profile(model, w, par, tp_rank=ranks)  # read from the cache it wrote


def _run(job: Job, model, w: Workload, par: Parallel, ranks: bool = False) -> None:
    try:
        derive(model, w, par, job.progress, job.started, ranks)
    except Exception as e:  # noqa: BLE001 - the page shows it in one line; the thread must not die silently
        if not job.cancelled:   # cancelled: finished without an error (the page's next run starts it again)
            job.error = " ".join(str(e).split()) or type(e).__name__
    finally:
        job.finished = True


def _job_key(page: str, model, w: Workload, par: Parallel, ranks: bool = False) -> str:
    tw, tp, _ = estimate_mod.traced_class(w, par)
    return f"{page}:derive:{model.inventory.config_hash[:16]}:{profile_key(tw, tp)}" + (":ranks" if ranks else "")


def _job(page: str, model, w: Workload, par: Parallel, ranks: bool = False) -> Job:
    tp = estimate_mod.traced_class(w, par)[1]
    key = _job_key(page, model, w, par, ranks)
    job = st.session_state.get(key)
    if job is None or (job.finished and job.error is None):
        label = f"{model.name}, {w.mode} {w.method} {w.recipe}, {par.strategy}" + (
            f", its {tp.pp_size} pipeline ranks ({tp.pp_schedule}, {tp.microbatches} micro-batches)" if ranks else "")
        job = Job(label=label)
        job.thread = threading.Thread(target=_run, args=(job, model, w, par, ranks), daemon=True, name=key)
        job.thread.job = job  # tests/conftest.py cancels a job its test left running
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


def profile_on_request(page: str, model, w: Workload, par: Parallel, button: str, why: str) -> bool:
    """True where `par`'s profile is on disk; else a button that derives it in the background (a process of its own,
    with its progress; the page reruns when it is done), and False. A refusal shows in one line."""
    if estimate_mod.profile_where(model, w, par) is not None:
        return True
    key = _job_key(page, model, w, par)
    if not st.session_state.get(f"{key}:asked"):
        if st.button(button, key=f"{page}:derive:{key}", help=why):
            st.session_state[f"{key}:asked"] = True
            st.rerun()
        return False
    job = _job(page, model, w, par)
    if job.error:
        st.error(job.error)
        return False
    _watch(job)
    return False


def pipeline_ranks_in_background(page: str, model, w: Workload, par: Parallel) -> None:
    """Derive every traced rank of the pipeline `par` (tracer.pp; `estimator.parallel.pp_untraced` is None) in the
    background, asked for by a button (each rank is a derivation of its own: minutes), with its progress; the page
    reruns when they are on disk and prices the layout from them. A refusal shows in one line."""
    key = _job_key(page, model, w, par, ranks=True)
    if not st.session_state.get(f"{key}:asked"):
        if st.button(f"Derive the {par.pp_size} pipeline ranks of this layout exactly (in the background)",
                     key=f"{page}:derive-ranks", help="Each rank's step is traced on fake tensors as torchtitan runs it "
                     "(tracer.pp), a few minutes per rank; the layout is then priced from them, exact per rank."):
            st.session_state[f"{key}:asked"] = True
            st.rerun()
        return
    done = st.session_state.get(key)
    if done is not None and done.finished and done.error is None:
        return   # on disk now: the layouts above price it from them (a finished job is not started again)
    job = _job(page, model, w, par, ranks=True)
    if job.error:
        st.error(job.error)
        return
    _watch(job)


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
