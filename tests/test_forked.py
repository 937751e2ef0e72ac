"""A derivation's traces spread over forked copies of the process (tracer.forked) give the same profile, byte for byte,
as one process tracing them one after another; failures come back as the exception the trace raised.

    python -m pytest tests/test_forked.py -q
    WILLITFIT_SLOW=1 python -m pytest tests/test_forked.py -q    # also a windowed model's pieces and FSDP's ranks
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tracer import forked

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(__file__).parent / "data" / "tiny"

# Derive in a fresh interpreter (the test runner's own threads would make forking unsafe, tracer.forked
# .why_sequential) with WILLITFIT_TRACE_WORKERS=1 and =3, and print both profiles less their timings.
_BOTH = r"""
import json, os, sys
from estimator.spec import Parallel, Workload
from tracer.derive import derive_profile

cfg = json.load(open(sys.argv[1]))
w = Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[2]).items()})
par = Parallel(**json.loads(sys.argv[3]))
out = []
for n in ("1", "3"):
    os.environ["WILLITFIT_TRACE_WORKERS"] = n
    lines = []
    d = json.loads(derive_profile(cfg, w, par, progress=lambda i, n, m: lines.append(m)).to_json())
    for k in ("seconds", "derived_at"):
        d["provenance"].pop(k)
    out.append({"profile": d, "traced_elsewhere": sum(m.startswith("traced ") for m in lines)})
print(json.dumps(out))
"""


def _both(config: str, workload: dict, parallel: dict | None = None) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", _BOTH, str(TINY / config), json.dumps(workload),
                        json.dumps(parallel or {})], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config, workload, parallel", [
    ("t-llama.json", {"method": "lora", "lora_targets": ["q_proj", "v_proj"]}, None),   # rank-variable: 3 ranks
    pytest.param("t-phi3.json", {"mode": "infer", "gen_tokens": 4}, None,             # sliding window: pieces
                 marks=pytest.mark.slow),
    pytest.param("t-llama.json", {"recipe": "mixed"}, {"strategy": "fsdp", "gpus": 2},  # fake process group, 1/n
                 marks=pytest.mark.slow),
    pytest.param("t-llama.json", {"compile": True}, None,  # AOTAutograd (its tqdm bar: no monitor thread, tracer/)
                 marks=pytest.mark.slow),
])
def test_forked_traces_give_the_same_profile_to_the_byte(config, workload, parallel):
    one, three = _both(config, workload, parallel)
    assert one["traced_elsewhere"] == 0          # one process: every trace here
    assert three["traced_elsewhere"] > 0         # three: the copies traced some (and said so as they came back)
    assert three["profile"] == one["profile"]


def _square(x: int) -> int:
    if x == 3:
        raise ValueError("fit: three is refused")
    if x == 5:
        raise OSError("disk on fire")
    return x * x


def _run(jobs, n):
    got, started = {}, []
    forked.run_all(jobs, _square, lambda v: {"v": v}, lambda d: d["v"], got.__setitem__, started.append,
                   n_workers=n)
    return got, started


def test_a_failed_trace_comes_back_as_its_exception_in_either_mode():
    jobs = list(range(8))
    for n in (1, 3):
        got, started = _run(jobs, n)
        assert sorted(got) == jobs
        assert [got[j] for j in (0, 2, 7)] == [0, 4, 49]
        assert type(got[3]) is ValueError and str(got[3]) == "fit: three is refused"
        if forked.why_sequential(len(jobs), n) is None:  # a copy's unexpected error: a RuntimeError naming it
            assert type(got[5]) is RuntimeError and str(got[5]) == "OSError: disk on fire"
        else:
            assert type(got[5]) is OSError
        assert set(started) <= set(jobs)


def test_forking_is_skipped_where_it_is_not_safe(monkeypatch):
    monkeypatch.delenv(forked.ENV_VAR, raising=False)
    assert forked.why_sequential(10, 1) == "one CPU core"
    assert forked.why_sequential(1, 4) == "one trace"
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert forked.why_sequential(10, 4) == "other threads run in this process"
        got, started = _run(list(range(6)), 4)           # so run_all traces here, in order
        assert started == list(range(6)) and got[4] == 16
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("raw", ["0", "-2", "two", "257", "1.5"])
def test_a_bad_worker_count_is_one_line_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(forked.ENV_VAR, raw)
    with pytest.raises(ValueError, match=r"^WILLITFIT_TRACE_WORKERS: the number of processes that trace at once, "
                                         r"1\.\.256; got "):
        forked.workers()


def test_the_worker_count_defaults_to_the_usable_cores(monkeypatch):
    monkeypatch.delenv(forked.ENV_VAR, raising=False)
    assert 1 <= forked.workers() <= forked.MAX_DEFAULT_WORKERS
    monkeypatch.setenv(forked.ENV_VAR, "12")
    assert forked.workers() == 12
