"""The check the model-kind tests share: an estimate against a full-depth trace of the same step, stage by stage.

    from traced import assert_equals_trace
    assert_equals_trace(config, "t-llava", Workload(images=1), [(3, 333)])
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from estimator.spec import Parallel, Workload

TINY = Path(__file__).parent / "data" / "tiny"


def tiny(family: str) -> dict:
    """The tiny config of a family (tests/data/tiny/t-<family>.json)."""
    return json.loads((TINY / f"t-{family}.json").read_text())


def assert_replay_equals_trace(cfg: dict, workload: Workload, kind: str, parallel: Parallel = Parallel(),
                               layers=(0, 1, 2)) -> None:
    """The step replayed under `kind` (tracer.ticks.REPLAYS) equals a traced step of that class key by key, and
    watching the step for the replay changes nothing the fit reads of the traced class itself."""
    from tracer import replay
    from tracer.derive import SIBLINGS
    from tracer.ticks import trace_ticks

    both = trace_ticks(cfg, workload, parallel, list(layers), replays=(kind,))
    plain = trace_ticks(cfg, workload, parallel, list(layers))
    assert replay.keyed(both) == replay.keyed(plain)
    traced = trace_ticks(cfg, SIBLINGS[kind](workload), parallel, list(layers))
    assert replay.keyed(both.replayed[kind]) == replay.keyed(traced)


def assert_equals_trace(cfg: dict, name: str, workload: Workload, sizes, parallel: Parallel = Parallel(),
                        derive: bool = True) -> list:
    """At every (batch, seq) of `sizes`: each stage's tensor bytes of `estimate()` equal those of
    `bench.trace.cases.trace_case` (two steps), to the byte. `derive=False`: the profile must already be on disk.
    Returns the estimates (their provenance says where each profile came from)."""
    from bench.trace.cases import trace_case
    from estimator.estimate import Options, estimate
    from estimator.model import from_hf_config

    m = from_hf_config(cfg, name)
    out = []
    for b, s in sizes:
        w = replace(workload, batch=b, seq=s)
        est = estimate(m, w, parallel, Options(derive=derive))
        row = trace_case(cfg, name, w, parallel, steps=2)
        got = {n: st.tensor_bytes for n, st in est.stages}
        assert got == {n: row[f"{n}_peak_alloc_bytes"] for n in got}, (w, got)
        out.append(est)
    return out
