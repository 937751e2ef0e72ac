"""The check the model-kind tests share: an estimate against a full-depth trace of the same step, stage by stage.

    from traced import assert_equals_trace
    assert_equals_trace(config, "t-llava", Workload(images=1), [(3, 333)])
"""
from __future__ import annotations

from dataclasses import replace

from estimator.spec import Parallel, Workload


def assert_equals_trace(cfg: dict, name: str, workload: Workload, sizes, parallel: Parallel = Parallel()) -> None:
    """At every (batch, seq) of `sizes`: each stage's tensor bytes of `estimate()` equal those of
    `bench.trace.cases.trace_case` (two steps), to the byte."""
    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    m = from_hf_config(cfg, name)
    for b, s in sizes:
        w = replace(workload, batch=b, seq=s)
        est = estimate(m, w, parallel)
        row = trace_case(cfg, name, w, parallel, steps=2)
        got = {n: st.tensor_bytes for n, st in est.stages}
        assert got == {n: row[f"{n}_peak_alloc_bytes"] for n in got}, (w, got)
