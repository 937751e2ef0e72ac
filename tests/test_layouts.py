"""estimator.layouts: every FSDP x TP x PP layout of N GPUs, ranked by the worst rank, each one an estimate."""
from __future__ import annotations

import pytest

from estimator.estimate import Options, estimate
from estimator.layouts import layouts
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.spec import Parallel, Workload

NO_TRACE = Options(derive=False)
GiB = 2**30


@pytest.fixture(scope="module")
def llama70b():
    return from_hf_config(load_config("llama-3.1-70b")[1], "llama-3.1-70b", derive=False)


def test_every_layout_of_8_gpus_is_an_estimate_and_they_are_ranked(llama70b):
    w = Workload(batch=1, seq=4096)
    rows = layouts(llama70b, w, 8, 80 * GiB, NO_TRACE)
    # 8 = dp x tp x pp: tp in {1, 2, 4, 8} (64 heads, 8 KV heads), pp dividing what is left: 10 layouts
    assert sorted((r.dp, r.tp, r.pp) for r in rows) == sorted(
        (8 // (t * p), t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if 8 % (t * p) == 0)
    for r in rows:
        assert r.device_bytes == estimate(llama70b, w, Parallel(strategy="fsdp", gpus=8, tp=r.tp, pp=r.pp),
                                          NO_TRACE).total_bytes
    keys = [(not r.fits, r.device_bytes) for r in rows]
    assert keys == sorted(keys)


def test_why_names_the_rank_the_component_and_the_lever(llama70b):
    rows = layouts(llama70b, Workload(batch=1, seq=4096), 8, 80 * GiB, NO_TRACE)
    plain = next(r for r in rows if (r.tp, r.pp) == (1, 1))
    assert not plain.fits and plain.largest == "activations" and plain.worst_rank == "every rank"
    assert "checkpointing" in plain.why(80 * GiB) and "over by" in plain.why(80 * GiB)
    staged = next(r for r in rows if r.pp > 1)
    assert "pipeline stage" in staged.worst_rank
    # plain FSDP is the traced FSDP rank; no TP or pipeline rank of this model is derived here: the analytic rule
    assert plain.priced == "traced per rank" and staged.priced == "analytic rule" and not staged.per_rank


def test_checkpointing_moves_the_cause_from_activations_to_the_states(llama70b):
    """Without checkpointing activations fill the plain FSDP rank; with full checkpointing (one input per layer kept)
    no layout grows (a PP layout whose peak is the optimizer step stays) and the states decide: pure bf16 AdamW holds 8 B per parameter (weights 2, grads 2,
    two bf16 moments 4), 70.6e9 x 8 B / 8 GPUs = 65.7 GiB, so the lever named is the states'."""
    w = Workload(batch=1, seq=4096)
    before = {(r.tp, r.pp): r for r in layouts(llama70b, w, 8, 80 * GiB, NO_TRACE)}
    after = {(r.tp, r.pp): r for r in layouts(llama70b, Workload(batch=1, seq=4096, checkpointing="full"), 8,
                                              80 * GiB, NO_TRACE)}
    assert set(before) == set(after) and all(after[k].device_bytes <= before[k].device_bytes for k in before)
    assert after[(1, 1)].device_bytes < before[(1, 1)].device_bytes / 2  # 211 GiB -> 96 GiB per GPU
    assert after[(1, 1)].largest == "optimizer_states" and "8-bit optimizer" in after[(1, 1)].why(80 * GiB)


def test_one_gpu_is_one_layout_and_bad_counts_are_one_line(llama70b):
    assert [(r.dp, r.tp, r.pp) for r in layouts(llama70b, Workload(), 1, 80 * GiB, NO_TRACE)] == [(1, 1, 1)]
    with pytest.raises(ValueError, match="^gpus:"):
        layouts(llama70b, Workload(), 0, 80 * GiB, NO_TRACE)


def test_pipeline_layouts_run_the_schedule_asked(llama70b):
    # interleaved 1F1B over 8 micro-batches: every layout with pp > 1 runs it (two stages per rank); the others do
    # not pipeline; a pp whose 2 x pp stages would leave one without a layer is no layout
    w = Workload(batch=1, seq=4096)
    rows = layouts(llama70b, w, 8, 80 * GiB, NO_TRACE, pp_schedule="interleaved-1f1b", microbatches=8)
    for r in rows:
        want = Parallel(strategy="fsdp", gpus=8, tp=r.tp, pp=r.pp,
                        **(dict(pp_schedule="interleaved-1f1b", microbatches=8) if r.pp > 1 else {}))
        assert r.parallel == want
        assert r.device_bytes == estimate(llama70b, w, want, NO_TRACE).total_bytes
    assert {r.pp for r in rows} == {1, 2, 4, 8}
    # llama-3.2-1b's 16 layers + the embedding and the head over 2 x 16 stages: more stages than effective layers
    # (torchtitan's _generate_llm_fqn_per_model_part refuses); over 2 x 8 the last stage holds the norm and head only
    small = from_hf_config(load_config("llama-3.2-1b")[1], "llama-3.2-1b", derive=False)
    pps = {r.pp for r in layouts(small, Workload(batch=1, seq=1024), 16, 80 * GiB, NO_TRACE,
                                 pp_schedule="interleaved-1f1b", microbatches=16)}
    assert pps == {1, 2, 4, 8}
