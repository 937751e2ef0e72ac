"""`check_tiny(name, workload, sizes, calls, scan)`: a tiny config's estimate against full-depth traces, stage by stage.

For the emulated sequence kernels (tests/test_gdn.py, test_mamba1.py): tests/data/tiny/t-<name>.json is estimated at
each (batch, seq) in `sizes` (deriving its profile on first use) and traced whole at the same size
(`bench.trace.cases.trace_case`, two steps); every stage's tensor bytes must be equal, the profile must say it
assumes the code `scan` starts with, and `calls()` (a kernel module's call counter) is read around each trace.

    from tracecheck import check_tiny
    runs = check_tiny("mamba", Workload(mode="train"), ((2, 100),), kernels_mamba1.scan_calls, "Mamba-1 mixers")
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

TINY = Path(__file__).parent / "data" / "tiny"


def check_tiny(name: str, workload, sizes, calls, scan: str) -> list:
    """[(estimate, kernel calls during the trace)] per size; asserts equality of every stage."""
    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    cfg = json.loads((TINY / f"t-{name}.json").read_text())
    out = []
    for b, s in sizes:
        w = replace(workload, batch=b, seq=s)
        est = estimate(from_hf_config(cfg, "tiny"), w)
        before = calls()
        row = trace_case(cfg, "tiny", w, steps=2)
        got = {n: st.tensor_bytes for n, st in est.stages}
        assert got == {n: row[f"{n}_peak_alloc_bytes"] for n in got}, (name, b, s, got)
        assert est.profile["scan"].startswith(scan), est.profile["scan"]
        out.append((est, calls() - before))
    return out
