"""The app's background derivations run in a process of their own (`python -m tracer.derive_job`, pages/_derive.derive):
the profile lands in the cache with every trace reported, a refusal is the derivation's own one line, and a cancelled
derivation is killed before it writes anything.

    python -m pytest tests/test_derive_job.py -q
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from estimator import estimate as estimate_mod
from estimator import store
from estimator.model import from_hf_config
from estimator.spec import Parallel, Workload
from pages import _derive

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(__file__).parent / "data" / "tiny"
# no other test derives this config (its own widths), so nothing of it is on disk before
BIGCODE = {"model_type": "gpt_bigcode", "n_layer": 2, "n_embd": 48, "n_head": 4, "vocab_size": 96,
           "n_positions": 2048}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    store.clear_memo()
    yield tmp_path
    store.clear_memo()


def test_a_derivation_in_its_own_process_fills_the_cache_reporting_each_trace(cache):
    model, w, par = from_hf_config(BIGCODE, "bigcode-48"), Workload(batch=4), Parallel()
    assert estimate_mod.profile_where(model, w, par) is None
    seen = []
    _derive.derive(model, w, par, lambda done, total, message: seen.append((done, total, message)))
    assert estimate_mod.profile_where(model, w, par) == "cache"
    total = seen[-1][1]
    assert total >= 6 and seen[-1][0] == total and seen[-1][2] == "done"
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)       # progress only goes forward
    assert any(m.startswith(("tracing", "traced")) for _, _, m in seen)
    est = estimate_mod.estimate(model, w, par, estimate_mod.Options(derive=False))  # no derivation left to do
    assert est.total_bytes > 0


def test_a_refused_derivation_raises_its_own_one_line(cache):
    # a Mamba-2 mixer whose convolution has 8 * 16 + 2 * 2 * 17 = 196 channels: mamba_ssm's fused training kernel
    # refuses channels that are no multiple of 8 (ssd_combined.ensure_stride), at the first trace
    cfg = {**json.loads((TINY / "t-mamba2.json").read_text()), "state_size": 17}
    model, w, par = from_hf_config(cfg, "t-mamba2"), Workload(attention="eager"), Parallel()
    with pytest.raises(ValueError) as here:                                  # the same refusal, in this process
        estimate_mod.ensure_profile(model, w, par)
    with pytest.raises(ValueError) as there:
        _derive.derive(model, w, par, lambda *a: None)
    assert str(there.value) == " ".join(str(here.value).split())
    assert str(there.value).startswith("config: mamba_ssm needs the convolution's channels to be a multiple of 8, "
                                       "got 196")


def test_a_cancelled_derivation_leaves_no_process_and_no_file(cache):
    model, w, par = from_hf_config(BIGCODE, "bigcode-48"), Workload(batch=2, checkpointing="full"), Parallel()

    def cancel(done, total, message):
        raise _derive.Cancelled("test")

    with pytest.raises(_derive.Cancelled):
        _derive.derive(model, w, par, cancel)
    assert estimate_mod.profile_where(model, w, par) is None  # killed with its process group at the first trace


def test_a_job_cancelled_from_outside_kills_its_process_at_once_and_ends_without_an_error(cache):
    # Job.cancel (a page whose inputs changed; tests/conftest.py after a test that did not wait): the process group is
    # killed where it stands, before its first trace reports, and the job ends finished with no error
    import os
    import threading

    model, w, par = from_hf_config(BIGCODE, "bigcode-48"), Workload(batch=2, loop="keep-output"), Parallel()
    job, pids = _derive.Job(label="test"), []
    told = job.started

    def started(pid):
        pids.append(pid)
        job.cancel()          # cancelled as the process starts, before it has imported torch: no trace reports
        told(pid)             # ... and Job.started kills it then

    job.started = started
    thread = threading.Thread(target=_derive._run, args=(job, model, w, par))
    thread.start()
    thread.join(600)
    assert not thread.is_alive() and job.finished and job.error is None and job.done == 0
    assert pids and estimate_mod.profile_where(model, w, par) is None
    with pytest.raises(ProcessLookupError):
        os.killpg(pids[0], 0)   # the whole group is gone


def test_a_malformed_job_is_one_line(cache):
    r = subprocess.run([sys.executable, "-m", "tracer.derive_job"], input='{"config": {}}', capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2
    assert json.loads(r.stdout) == {"error": "job: one JSON object with config, name, workload and parallel"}
