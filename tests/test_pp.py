"""Traced pipeline parallelism (tracer.pp: torch.distributed.pipelining on a fake process group, torchtitan's split)
and its per-rank profiles in the estimator: torchtitan's layer split, hand-checked stage contents of a tiny Llama,
the one-line refusals, the profile classes, the fallback to the analytic rule, and every rank's estimate equal to a
full-depth trace of that rank at a size no fit used (default tier: the cheapest case; the slow tier runs
scripts/parallel_check.py's pipeline cases).
"""
from __future__ import annotations

import json

import pytest
import torch

from estimator.estimate import Options, ensure_profile, estimate, profile_where, resolve, traced_class
from estimator.evaluate import stage_breakdowns, world
from estimator.model import from_hf_config
from estimator.parallel import pp_in_flight, pp_rank_layers, pp_rank_shares, pp_stage_layers, pp_untraced
from estimator.presets import load_config
from estimator.spec import PP_STAGES_PER_RANK, Parallel, Workload
from estimator.store import parallel_class, profile_key
from scripts.parallel_check import main as parallel_check
from tracer.session import run_traced

BF16 = 2
# hidden 64, MLP 128, 4 layers, 4 heads of 16, 2 KV heads, vocab 128: per layer q 64x64, k 32x64, v 32x64, o 64x64,
# gate/up/down 128x64, 2 norms of 64 = 36,992 parameters; embedding and head 128x64 = 8,192 each; final norm 64
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256, "tie_word_embeddings": False}
LAYER = 36_992


@pytest.mark.parametrize("layers, pp, want", [
    (6, 4, [1, 2, 2, 1]), (32, 4, [8, 9, 8, 7]), (4, 2, [2, 2]), (126, 8, [15, 16, 16, 16, 16, 16, 16, 15]),
    (80, 8, [10, 11, 10, 10, 10, 10, 10, 9]),
])
def test_stages_hold_torchtitans_split_of_the_layers(layers, pp, want):
    # torchtitan _generate_llm_fqn_per_model_part with its defaults (the embedding and the norm + head weigh one layer
    # each): checked against torchtitan's own function for every 1..129 layers on 2..16 stages while writing it
    got = [pp_stage_layers(layers, pp, r) for r in range(pp)]
    assert [len(g) for g in got] == want
    assert [i for g in got for i in g] == list(range(layers))   # contiguous, in order, each layer once


def test_a_split_that_leaves_a_stage_empty_is_one_line():
    with pytest.raises(ValueError, match="^pp: 4 pipeline stages for 1 layers"):
        pp_stage_layers(1, 4, 0)
    with pytest.raises(ValueError, match="^pp_rank: pipeline stage 4 does not exist"):
        pp_stage_layers(8, 4, 4)


@pytest.mark.parametrize("w, p, field", [
    (Workload(method="lora"), Parallel("pp", gpus=2), "method"),
    (Workload(mode="infer"), Parallel("pp", gpus=2), "mode"),
    (Workload(loss="chunked"), Parallel("pp", gpus=2), "loss"),
    (Workload(grad_accum=4), Parallel("pp", gpus=2, microbatches=4), "grad_accum"),
    (Workload(), Parallel("pp", gpus=4, microbatches=2), "microbatches"),
    (Workload(), Parallel("fsdp", gpus=8, pp=2, ep=2, microbatches=2), "pp"),
    (Workload(), Parallel("pp", gpus=8, pp=2, microbatches=2), "pp"),   # replicas of the pipeline: not traced
])
def test_untraced_pipelines_are_named_in_one_line(w, p, field):
    why = pp_untraced(w, p)
    assert why and why.startswith(f"{field}:") and "\n" not in why
    with pytest.raises(ValueError, match=f"^{field}:"):
        run_traced(TINY, w, p)


def test_each_rank_holds_its_stage():
    # 4 layers on 2 stages: 2 each. Rank 0: the embedding and layers 0-1; rank 1: layers 2-3, the final norm, the head
    p = Parallel("pp", gpus=2, microbatches=2)
    first = run_traced(TINY, Workload(batch=1, seq=8), p, rank=0)
    last = run_traced(TINY, Workload(batch=1, seq=8), p, rank=1)
    assert first.log.stages[0].breakdown["weights"] == (8_192 + 2 * LAYER) * BF16
    assert last.log.stages[0].breakdown["weights"] == (2 * LAYER + 64 + 8_192) * BF16
    assert first.per_rank["traced_rank"] == 0 and last.per_rank["microbatches"] == 2
    assert any("pp rank 1 of 2" in n and "1f1b" in n for n in last.notes)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="^rank: only a pipeline's or a context-parallel group's ranks differ"):
        run_traced(TINY, Workload(batch=1, seq=8), Parallel(), rank=1)


def test_a_compiled_pipeline_stage_compiles_each_block_and_the_loss(monkeypatch):
    """torchtitan compiles every block and the loss on each stage (tracer.pp -> tracer.compiled.compile_units): the
    last rank's layers run as CompiledCalls and its step saves less than eager's."""
    from tracer import compiled

    p, w = Parallel("pp", gpus=2, microbatches=2), Workload(batch=2, seq=64)
    calls = []
    real = compiled.CompiledCall.__call__

    def spy(self, *args, **kwargs):
        calls.append(self.module is None)   # True: the loss
        return real(self, *args, **kwargs)

    monkeypatch.setattr(compiled.CompiledCall, "__call__", spy)
    comp = run_traced(TINY, Workload(batch=2, seq=64, compile=True), p, rank=1)
    monkeypatch.undo()
    eager = run_traced(TINY, w, p, rank=1)
    assert calls.count(False) >= 2 and calls.count(True) >= 2   # 2 layers, the loss, per micro-batch
    peak = {s.stage: s.peak_bytes for s in eager.log.stages}
    assert max(s.peak_bytes for s in comp.log.stages if s.stage == "forward") < peak["forward"]


def test_a_traced_pipeline_row_is_its_worst_rank():
    from bench.trace.cases import trace_case

    row = trace_case(TINY, "pp-tiny", Workload(batch=1, seq=8), Parallel("pp", gpus=2, microbatches=2))
    ranks = json.loads(row["per_rank_json"])
    assert len(ranks["rank_peaks"]) == 2 and ranks["traced_rank"] == ranks["rank_peaks"].index(max(ranks["rank_peaks"]))


def test_fsdp_over_a_stage_shards_it_and_keeps_its_gradients_whole_during_the_schedule():
    # FSDP 2 x PP 2: each stage's parameters sharded over its 2 dp ranks at load. torch.distributed.pipelining runs
    # every backward of an FSDP stage without resharding or reduce-scattering (PipelineStage
    # .backward_maybe_with_nosync: set_reshard_after_backward(False), set_requires_gradient_sync(False)) and reduces
    # once at the end of the step (perform_reduce_grad): during the schedule the rank holds its stage's gradients
    # whole, and at the optimizer step only its shard
    p = Parallel("fsdp", gpus=4, pp=2, microbatches=2)
    trace = run_traced(TINY, Workload(batch=1, seq=8), p, rank=1)
    stage = 2 * LAYER + 64 + 8_192
    by = {s.stage: s.breakdown for s in trace.log.stages}
    assert by["load"]["weights"] == stage // 2 * BF16
    assert by["forward"]["gradients"] == stage * BF16          # the first micro-batch's backward has run
    # torchtitan under PP: reshard_after_forward=False, so the gathered parameters stay beside the shards
    assert by["forward"]["weights"] == (stage + stage // 2) * BF16
    assert by["optimizer"]["gradients"] == stage // 2 * BF16
    assert trace.per_rank["world_size"] == 4 and not torch.distributed.is_initialized()
    assert parallel_class(p, 1) == {"strategy": "fsdp", "pp": 2, "schedule": "1f1b", "microbatches": 2, "rank": 1}
    _, tp, _ = traced_class(Workload(), p)
    assert tp == Parallel("fsdp", gpus=4, pp=2, microbatches=2)   # fit in 1/n at n = dp = 2 and 4
    # HSDP is FSDP over its shard group (the replicas hold the same): its pipeline ranks are FSDP x PP's at n = shard
    hsdp = Parallel("hsdp", gpus=16, pp=2, hsdp_shard=4, microbatches=2)
    assert pp_untraced(Workload(), hsdp) is None
    _, tp, notes = traced_class(Workload(), hsdp)
    assert tp == Parallel("fsdp", gpus=4, pp=2, microbatches=2) and "hsdp: one FSDP shard group traced" in notes
    assert world(hsdp) == 4


# with tp 2 inside each stage: q and o 64x64 / 2, k and v 32x64 / 2, gate/up/down 128x64 / 2, the two norms whole
LAYER_TP2 = 2_048 + 1_024 + 1_024 + 2_048 + 3 * 4_096 + 128


@pytest.mark.parametrize("sp", [False, True])
def test_tp_inside_each_stage_holds_its_slice(sp):
    # PP 2 x TP 2 on torchtitan's (pp, dp, tp) mesh: rank 0 (global rank 0) holds half the vocabulary rows of the
    # embedding and its layers' TP shards; the last stage's first rank (global rank 2) the same of its layers, the
    # final norm whole and half the head's rows
    p = Parallel("pp", gpus=4, pp=2, tp=2, microbatches=2, sequence_parallel=sp)
    w = Workload(batch=1, seq=8)
    first, last = run_traced(TINY, w, p, rank=0), run_traced(TINY, w, p, rank=1)
    assert first.log.stages[0].breakdown["weights"] == (4_096 + 2 * LAYER_TP2) * BF16
    assert last.log.stages[0].breakdown["weights"] == (2 * LAYER_TP2 + 64 + 4_096) * BF16
    assert last.per_rank["tp"] == 2 and any("tensor-parallel over tp 2" in n for n in last.notes)
    assert not torch.distributed.is_initialized()
    assert parallel_class(p, 1) == {"strategy": "pp", "pp": 2, "schedule": "1f1b", "microbatches": 2, "rank": 1,
                                    "tp": 2, **({"sp": True} if sp else {})}
    tw, tp, notes = traced_class(Workload(), p)
    assert tp == p and any(n.startswith("tp: each stage tensor-parallel over tp 2") for n in notes)
    _, tp, _ = traced_class(Workload(), Parallel("fsdp", gpus=16, pp=2, tp=2, microbatches=2))
    assert tp == Parallel("fsdp", gpus=8, pp=2, tp=2, microbatches=2)   # FSDP over dp: fit in 1/n at n = 2 and 4


@pytest.mark.parametrize("hsdp, fsdp, rank", [
    (Parallel("hsdp", gpus=8, hsdp_shard=4), Parallel("fsdp", gpus=4), 0),
    (Parallel("hsdp", gpus=8, tp=2, hsdp_shard=2), Parallel("fsdp", gpus=4, tp=2), 0),
    (Parallel("hsdp", gpus=8, pp=2, hsdp_shard=2, microbatches=2), Parallel("fsdp", gpus=4, pp=2, microbatches=2), 1),
])
def test_hsdp_holds_what_fsdp_over_its_shard_group_holds(hsdp, fsdp, rank):
    # HSDP traced as torchtitan builds it (fully_shard on the 2-D (dp_replicate, dp_shard) mesh) equals FSDP2 over
    # the shard group, stage by stage and category by category: the estimate prices HSDP from that profile
    w = Workload(batch=2, seq=16)
    h, f = run_traced(TINY, w, hsdp, rank=rank), run_traced(TINY, w, fsdp, rank=rank)
    assert [(s.stage, s.breakdown) for s in h.log.stages] == [(s.stage, s.breakdown) for s in f.log.stages]
    assert any("as HSDP" in n for n in h.notes) or hsdp.pp_size > 1
    assert not torch.distributed.is_initialized()


def test_sequence_parallel_between_stages_needs_tp_to_divide_seq():
    with pytest.raises(ValueError, match="^seq: sequence parallelism between pipeline stages"):
        run_traced(TINY, Workload(batch=1, seq=9), Parallel("pp", gpus=4, pp=2, tp=2, microbatches=2,
                                                             sequence_parallel=True))
    assert pp_untraced(Workload(checkpointing="op-sac"), Parallel("pp", gpus=4, pp=2, tp=2)).startswith("tp:")


def test_gpipe_holds_every_micro_batch_1f1b_at_most_pp():
    # GPipe runs every forward before any backward: the first stage holds all 4 micro-batches' activations at once;
    # 1F1B holds at most pp = 2 of them there
    w = Workload(batch=1, seq=32)
    fwd = {}
    for sched in ("1f1b", "gpipe"):
        t = run_traced(TINY, w, Parallel("pp", gpus=2, microbatches=4, pp_schedule=sched), rank=0)
        fwd[sched] = next(s.breakdown["activations"] for s in t.log.stages if s.stage == "forward")
    assert fwd["gpipe"] > fwd["1f1b"]


def test_pipeline_profile_classes_name_degree_schedule_micro_batches_and_rank():
    p = Parallel("pp", gpus=4, microbatches=8)
    assert parallel_class(p, 3) == {"strategy": "pp", "pp": 4, "schedule": "1f1b", "microbatches": 8, "rank": 3}
    assert profile_key(Workload(), p, pp_rank=0) != profile_key(Workload(), p, pp_rank=3)
    with pytest.raises(ValueError, match="^pp_rank:"):
        parallel_class(Parallel("tp", gpus=2), 1)
    # grad_accum stands for the micro-batches where none are given; the traced class carries them
    tw, tp, notes = traced_class(Workload(grad_accum=6), Parallel("pp", gpus=4))
    assert tp == Parallel("pp", gpus=4, microbatches=6) and tw.grad_accum == 1
    assert any(n.startswith("pp: every rank of pp 4 traced (1f1b, 6 micro-batches") for n in notes)
    assert traced_class(Workload(method="lora"), Parallel("pp", gpus=4))[1] == Parallel()


def test_rank_shares_hold_the_stage_parameters():
    inv = from_hf_config(load_config("llama-3.2-1b")[1], "llama-3.2-1b", derive=False).inventory
    sh = pp_rank_shares(inv, Parallel("pp", gpus=4))
    assert [s.stage for s in sh] == ["first", "middle (rank 1)", "middle (rank 2)", "last"]
    assert [s.layers_local for s in sh] == [4, 5, 4, 3]   # 16 layers: torchtitan's split
    # every parameter on exactly one rank: llama-3.2-1b ties its head to the embedding, which the inventory counts
    # once (with the first stage)
    assert sum(s.params_local for s in sh) == inv.params


def test_estimate_without_every_rank_on_disk_is_the_analytic_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))   # no traced pipeline rank here, and none shipped
    name = "llama-3.2-1b"
    model = from_hf_config(load_config(name)[1], name, derive=False)
    w, p = Workload(batch=2, seq=512, grad_accum=4), Parallel("pp", gpus=2)
    got = estimate(model, w, p, options=Options(derive=False))
    assert any("no traced profiles of the 2 pipeline ranks" in n and "--strategy pp --gpus 2" in n
               and "--microbatches 4" in n for n in got.notes)
    assert got.pipeline_stage in ("first", "last")
    assert profile_where(model, w, p) == "shipped"   # the single-GPU profile the rule prices from


def test_every_rank_estimate_equals_its_full_depth_trace(tmp_path, monkeypatch):
    # the cheapest case: 2 stages of 2 layers (each traced whole), 1F1B over 3 micro-batches; estimate at a batch
    # and a sequence no fit traced (the fit: batches 1..4, seqs of 64 and up; the check 5 x 100)
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    model = from_hf_config(TINY, "pp-tiny", derive=True)
    w, p = Workload(batch=5, seq=100), Parallel("pp", gpus=2, microbatches=3)
    ensure_profile(model, w, p, tp_rank=True)
    tw, _, _, pairs = resolve(model, w, p, Options())
    assert [sh.stage for sh, _ in pairs] == ["first", "last"]
    for rank, (sh, prof) in enumerate(pairs):
        assert prof.parallel_class["rank"] == rank
        ours = stage_breakdowns(model, prof, w, p, tw, sh, Options())
        trace = run_traced(TINY, w, p, rank=rank)
        for peak in trace.log.stages:
            assert ours[peak.stage][1].tensor_bytes == sum(peak.breakdown.values()), (rank, peak.stage)
    est = estimate(model, w, p)
    assert any(n.startswith("pp: every rank of pp 2 traced") for n in est.notes)


@pytest.mark.slow
@pytest.mark.parametrize("cases", [
    ("pp2-1f1b-train", "pp4-gpipe-train", "fsdp16-pp2-1f1b-train", "pp2-tp4-sp-gpipe-train-mixed",
     "fsdp16-tp2-pp2-1f1b-train"),
    ("pp2-interleaved-train", "pp2-interleaved-zb-train", "pp4-zbv-train-mixed", "fsdp16-pp2-interleaved-train",
     "pp2-dualpipev-train"),
], ids=["single-stage", "multi-stage"])
def test_parallel_check_pipeline_cases_are_exact(tmp_path, monkeypatch, capsys, cases):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    assert parallel_check([arg for case in cases for arg in ("--case", case)] + ["--quiet"]) == 0
    assert f"{len(cases)} of {len(cases)} cases exact" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("p, ckpt", [(Parallel("pp", gpus=2, microbatches=2), "none"),
                                     (Parallel("fsdp", gpus=4, pp=2, microbatches=2), "full")])
def test_a_compiled_pipeline_rank_equals_its_full_depth_trace(tmp_path, monkeypatch, p, ckpt):
    """torchtitan compiles each block and the loss on every pipeline stage (tracer.compiled.compile_units in
    tracer.pp), the checkpoint around the compiled block: each rank derived, the worst against traces of every rank
    of the whole 6-layer model at sizes no fit used."""
    from traced import assert_equals_trace

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    cfg = {**TINY, "num_hidden_layers": 6}
    w = Workload(compile=True, checkpointing=ckpt)
    ensure_profile(from_hf_config(cfg, "tiny", derive=True), w, p, tp_rank=True)   # every rank (--derive-ranks)
    est = assert_equals_trace(cfg, "tiny", w, [(2, 100), (4, 500)], p, derive=False)
    assert any(n.startswith("compile: traced as") for n in est[0].notes)


@pytest.mark.slow
def test_optimizer_step_whose_largest_tick_changes_with_depth_is_exact(tmp_path, monkeypatch):
    # A large vocabulary over narrow layers, PP 2 x TP 2: the first stage's AdamW step on DTensors holds two
    # embedding-sized temporaries first and the all-parameter sqrt last. At the 3 and 4 layers a derivation traces,
    # the pair leads; at the stage's 9 layers the sqrt. Every tick of the step is extended (tracer.ticks, optional
    # keys), so the full stage's step equals its trace (before: the pair alone, as llama-3.2-1b's first rank under
    # PP 2 x TP 2 read its optimizer stage 223,936,512 B low at batch 2 x seq 4096)
    from tracer.derive import derive_profile

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    config = {**TINY, "vocab_size": 4096, "num_hidden_layers": 18}
    w, p = Workload(batch=2, seq=64), Parallel("pp", gpus=4, pp=2, tp=2, microbatches=2)
    prof = derive_profile(config, w, p, pp_rank=0)
    step = max(sum(m.bytes_at(2, 64).values()) for m in prof.piece_for(2, 64).moments if m.stage == "optimizer")
    trace = run_traced(config, w, p, rank=0)
    assert step == next(st.peak_bytes for st in trace.log.stages if st.stage == "optimizer")


# ------------------------------------------------------------------------------------- interleaved 1F1B (looped)
SIX = {**TINY, "num_hidden_layers": 6}
INTERLEAVED = "interleaved-1f1b"


@pytest.mark.parametrize("layers, pp", [(6, 2), (16, 4), (32, 4), (126, 8), (80, 8), (61, 4)])
def test_a_looped_rank_holds_stages_r_and_r_plus_pp_of_torchtitans_split(layers, pp):
    # torchtitan splits the layers over pp x 2 stages (its default for a multi-stage schedule) and gives rank r the
    # stages r, r + pp (stage_ids_this_rank, style "loop"); every layer on exactly one rank
    held = [pp_rank_layers(layers, pp, r, INTERLEAVED) for r in range(pp)]
    assert all(len(h) == PP_STAGES_PER_RANK[INTERLEAVED] == 2 for h in held)
    for r, (a, b) in enumerate(held):
        assert a == pp_stage_layers(layers, 2 * pp, r) and b == pp_stage_layers(layers, 2 * pp, r + pp)
    assert sorted(i for h in held for chunk in h for i in chunk) == list(range(layers))
    assert pp_rank_layers(layers, pp, 1) == (pp_stage_layers(layers, pp, 1),)   # 1F1B: one stage


@pytest.mark.parametrize("pp, micro", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 12), (8, 8), (4, 3), (4, 10)])
def test_the_analytic_interleaved_rule_counts_torchs_warmup(pp, micro):
    # the rule's micro-batches in flight: torch's own warm-up count of chunk forwards, plus the one before the first
    # backward, over the rank's two stages
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    for r in range(pp):
        warm = _get_warmup_ops(r, 2, micro // max(1, micro // pp), pp, micro)
        assert pp_in_flight(INTERLEAVED, pp, r, micro) == min(warm + 1, 2 * micro) / 2
        assert pp_in_flight("1f1b", pp, r, micro) == min(pp - r, micro)
    assert pp_in_flight(INTERLEAVED, pp, 0, micro) >= pp_in_flight("1f1b", pp, 0, micro) or micro < pp


def test_interleaved_micro_batches_must_fill_its_rounds():
    # ScheduleInterleaved1F1B: max(1, micro // pp) rounds, which must divide the micro-batches (9 over pp 4: 2 rounds)
    w = Workload()
    why = pp_untraced(w, Parallel("pp", gpus=4, microbatches=9, pp_schedule=INTERLEAVED))
    assert why.startswith("microbatches: interleaved-1f1b runs rounds") and "\n" not in why
    assert pp_untraced(w, Parallel("pp", gpus=4, microbatches=10, pp_schedule=INTERLEAVED)) is None
    assert pp_untraced(w, Parallel("pp", gpus=4, microbatches=3, pp_schedule=INTERLEAVED)) is None
    with pytest.raises(ValueError, match="^microbatches:"):
        run_traced(SIX, Workload(batch=1, seq=8), Parallel("pp", gpus=2, microbatches=5, pp_schedule=INTERLEAVED))


def test_a_looped_rank_holds_both_its_stages_and_more_in_flight_than_1f1b():
    # 6 layers over 4 stages (1, 2, 2, 1): rank 0 runs stage 0 (embedding, layer 0) and stage 2 (layers 3-4); rank 1
    # stage 1 (layers 1-2) and stage 3 (layer 5, the norm, the head)
    w = Workload(batch=1, seq=32)
    p = Parallel("pp", gpus=2, microbatches=4, pp_schedule=INTERLEAVED)
    first, last = (run_traced(SIX, w, p, rank=r) for r in (0, 1))
    assert first.log.stages[0].breakdown["weights"] == (8_192 + 3 * LAYER) * BF16
    assert last.log.stages[0].breakdown["weights"] == (3 * LAYER + 64 + 8_192) * BF16
    assert any("pp rank 0 of 2" in n and INTERLEAVED in n for n in first.notes)
    one = run_traced(SIX, w, Parallel("pp", gpus=2, microbatches=4), rank=0)
    fwd = [next(s.breakdown["activations"] for s in t.log.stages if s.stage == "forward") for t in (first, one)]
    assert fwd[0] > fwd[1]   # rank 0 runs 2 + 2 x 1 = 4 chunk forwards first, 1F1B's rank 0 two micro-batches
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("schedule", [INTERLEAVED, "zbv"])
def test_every_interleaved_rank_estimate_equals_its_full_depth_trace(tmp_path, monkeypatch, schedule):
    # each rank's two stages traced whole (tracer.pp.LOOPED_WHOLE), fit, and estimated at sizes no fit traced;
    # ZBV (zero bubble, the backward's weight gradients apart and later) on its V: rank 0 runs stages 0 and 3
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    model = from_hf_config(SIX, "pp-six", derive=True)
    p = Parallel("pp", gpus=2, microbatches=4, pp_schedule=schedule)
    ensure_profile(model, Workload(batch=1, seq=64), p, tp_rank=True)
    for w in (Workload(batch=5, seq=100), Workload(batch=1, seq=130)):
        tw, _, _, pairs = resolve(model, w, p, Options())
        ends = ["first", "last"] if schedule == INTERLEAVED else ["first and last", "middle (rank 1)"]   # ZBV's V
        assert [sh.stage for sh, _ in pairs] == ends
        for rank, (sh, prof) in enumerate(pairs):
            assert prof.parallel_class == {"strategy": "pp", "pp": 2, "schedule": schedule, "microbatches": 4,
                                           "rank": rank}
            assert "traced_whole" in prof.provenance
            ours = stage_breakdowns(model, prof, w, p, tw, sh, Options())
            trace = run_traced(SIX, w, p, rank=rank)
            for peak in trace.log.stages:
                assert ours[peak.stage][1].tensor_bytes == sum(peak.breakdown.values()), (w, rank, peak.stage)
    est = estimate(model, Workload(batch=5, seq=100), p)
    assert any(n.startswith(f"pp: every rank of pp 2 traced ({schedule}, 4 micro-batches") for n in est.notes)


@pytest.mark.parametrize("p, rank, stage", [(Parallel("pp", gpus=6, microbatches=6), 0, 0),
                                            (Parallel("pp", gpus=3, microbatches=3, pp_schedule=INTERLEAVED), 2, 5)])
def test_a_stage_without_a_layer_is_one_line(p, rank, stage):
    # 4 layers + 2 over 6 stages: one each, so the first holds the embedding alone, the last the norm and head alone
    with pytest.raises(ValueError, match=f"^pp: pipeline stage {stage} of 6 holds no decoder layer"):
        run_traced(TINY, Workload(batch=1, seq=8), p, rank=rank)


def test_the_apps_background_job_derives_every_rank(tmp_path, monkeypatch):
    # what the Multi-GPU page's button runs (pages/_derive.derive with ranks=True: `python -m tracer.derive_job` in a
    # process of its own): every traced rank's profile lands in the cache, each trace reported with its rank
    from pages._derive import derive

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    model = from_hf_config(TINY, "pp-tiny", derive=True)
    w, p = Workload(batch=2, seq=64), Parallel("pp", gpus=2, microbatches=3)
    seen = []
    derive(model, w, p, lambda done, total, message: seen.append(message), ranks=True)
    assert {m.split(":")[0] for m in seen if m.startswith("pp rank")} == {"pp rank 0", "pp rank 1"}
    est = estimate(model, w, p, options=Options(derive=False))
    assert any(n.startswith("pp: every rank of pp 2 traced (1f1b, 3 micro-batches") for n in est.notes)


def test_zero_bubble_schedules_are_priced_from_traced_ranks_only(tmp_path, monkeypatch):
    # no rule counts weight gradients that wait: without the ranks on disk, one line naming the command
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    name = "llama-3.2-1b"
    model = from_hf_config(load_config(name)[1], name, derive=False)
    for schedule in ("interleaved-zb", "zbv", "dualpipev"):
        with pytest.raises(ValueError, match=f"^pp_schedule: {schedule} is priced from traced ranks only; derive them: "
                                             f"`python -m bench derive --model {name} --strategy pp --gpus 4 "
                                             f"--pp-schedule {schedule} --microbatches 8`"):
            estimate(model, Workload(batch=1, seq=512), Parallel("pp", gpus=4, microbatches=8, pp_schedule=schedule),
                     options=Options(derive=False))
    # a zero-bubble pipeline that cannot be traced says why, not "derive them"
    with pytest.raises(ValueError, match="^method: traced pipelines train method 'full'.*; and zbv is priced from its "
                                         "traced ranks only"):
        estimate(model, Workload(method="lora", batch=1, seq=512),
                 Parallel("pp", gpus=4, microbatches=8, pp_schedule="zbv"), options=Options(derive=False))
    # ZBV's V: rank r runs stages r and 2 pp - 1 - r (torchtitan stage_ids_this_rank, style "v")
    assert pp_rank_layers(16, 4, 0, "zbv") == (pp_stage_layers(16, 8, 0), pp_stage_layers(16, 8, 7))
    assert pp_rank_layers(16, 4, 3, "zbv") == (pp_stage_layers(16, 8, 3), pp_stage_layers(16, 8, 4))
    inv = from_hf_config(load_config(name)[1], name, derive=False).inventory
    sh = pp_rank_shares(inv, Parallel("pp", gpus=4, microbatches=8, pp_schedule="zbv"))
    assert [s.stage for s in sh] == ["first and last", "middle (rank 1)", "middle (rank 2)", "middle (rank 3)"]
    assert sum(s.params_local for s in sh) == inv.params and sh[0].params_local > sh[3].params_local
    assert pp_untraced(Workload(), Parallel("pp", gpus=4, microbatches=9, pp_schedule="interleaved-zb")) \
        .startswith("microbatches: interleaved-zb runs rounds")
    # DualPipeV: the same V, at least as many micro-batches as stages (torch's ScheduleDualPipeV refuses fewer)
    assert pp_rank_layers(16, 4, 1, "dualpipev") == pp_rank_layers(16, 4, 1, "zbv")
    assert pp_untraced(Workload(), Parallel("pp", gpus=4, microbatches=7, pp_schedule="dualpipev")) \
        .startswith("microbatches: DualPipeV needs at least as many micro-batches as stages")
    assert pp_untraced(Workload(), Parallel("pp", gpus=4, microbatches=8, pp_schedule="dualpipev")) is None
