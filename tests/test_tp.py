"""Traced tensor parallelism (tracer.tp: torchtitan's apply_tp on a fake process group) and its profile in the
estimator: hand-checked shard sizes of a tiny Llama, the one-line refusals, the profile's class, the fallback to
the analytic split, and (slow tier) scripts/parallel_check.py's cheapest case: estimate == full-depth trace.
"""
from __future__ import annotations

import pytest
import torch

from estimator.estimate import Options, estimate, profile_where, traced_class
from estimator.model import from_hf_config
from estimator.parallel import tp_untraced
from estimator.presets import load_config
from estimator.spec import Parallel, Workload
from estimator.store import parallel_class, profile_key
from scripts.parallel_check import main as parallel_check
from tracer.session import run_traced

BF16 = 2
# Hand-written tiny Llama (as tests/test_trace.py): hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 128
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_tp_rank_holds_its_shards_and_the_whole_norms():
    # per layer: q 64x64, k 32x64, v 32x64, o 64x64 = 12,288; gate, up, down 128x64 each = 24,576; 2 norms of 64.
    # embedding and head 128x64 each. Sharded over 2: (2 * 36,864 + 2 * 8,192) / 2 = 45,056; norms 5 x 64 = 320
    # replicated (2 per layer and the final one): 45,376 parameters = 90,752 B of bf16 on rank 0.
    trace = run_traced(TINY, Workload(mode="infer", batch=1, seq=8, gen_tokens=1), Parallel("tp", gpus=2))
    load = trace.log.stages[0]
    assert load.stage == "load" and load.breakdown["weights"] == 45_376 * BF16
    # the KV cache of rank 0 holds its one KV head of 16 of both layers, K and V, 9 positions after one token
    decode = next(p for p in trace.log.stages if p.stage == "decode")
    assert decode.breakdown["kv_cache"] == 2 * 2 * 1 * 9 * 16 * BF16
    assert not torch.distributed.is_initialized()


def test_tp_training_step_runs_under_loss_parallel():
    trace = run_traced(TINY, Workload(batch=1, seq=8), Parallel("tp", gpus=2))
    opt = next(p for p in trace.log.stages if p.stage == "optimizer")
    # AdamW's two fp32-free bf16 moments per local parameter (pure bf16): 2 x the rank's weights, plus the step
    # count tensors (one 4-byte float per parameter tensor: 2 layers x 9 + 3 = 21)
    assert opt.breakdown["optimizer_states"] == 2 * 45_376 * BF16 + 21 * 4
    assert any("tp rank 0 of 2" in n for n in trace.notes)


@pytest.mark.parametrize("w, p, field", [
    (Workload(mode="infer"), Parallel("tp", gpus=4, sequence_parallel=True), "sequence_parallel"),
    (Workload(method="lora"), Parallel("tp", gpus=2), "method"),
    (Workload(loss="chunked"), Parallel("tp", gpus=2), "loss"),
    (Workload(), Parallel("fsdp", gpus=8, tp=2, ep=2), "tp"),   # FSDP x TP x PP is a pipeline's (tests/test_pp.py)
])
def test_untraced_tp_is_named_in_one_line(w, p, field):
    why = tp_untraced(w, p)
    assert why and why.startswith(f"{field}:") and "\n" not in why
    with pytest.raises(ValueError, match=f"^{field}:"):
        run_traced(TINY, w, p)


def test_tp_profile_class_names_the_degree():
    assert parallel_class(Parallel("tp", gpus=4)) == {"strategy": "tp", "tp": 4}
    assert parallel_class(Parallel("fsdp", gpus=4)) == {"strategy": "fsdp"}   # existing keys unchanged
    assert profile_key(Workload(), Parallel("tp", gpus=2)) != profile_key(Workload(), Parallel("tp", gpus=4))
    _, tp, notes = traced_class(Workload(), Parallel("tp", gpus=8))
    assert tp == Parallel("tp", gpus=8) and any(n.startswith("tp: one rank of tp 8") for n in notes)
    assert traced_class(Workload(method="lora"), Parallel("tp", gpus=8))[1] == Parallel()
    # FSDP x TP: FSDP2 over dp on a (dp, tp) mesh, traced at dp 2 (dp is the profile's n)
    assert traced_class(Workload(), Parallel("fsdp", gpus=64, tp=8))[1] == Parallel("fsdp", gpus=16, tp=8)
    assert parallel_class(Parallel("fsdp", gpus=16, tp=8)) == {"strategy": "fsdp", "tp": 8}
    # HSDP x TP: FSDP x TP over the shard group (the replicas hold the same), evaluated at n = the shard group
    assert traced_class(Workload(), Parallel("hsdp", gpus=64, tp=8))[1] == Parallel("fsdp", gpus=16, tp=8)


def test_estimate_without_a_tp_profile_on_disk_is_the_analytic_split(tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))   # no traced TP profile here, and none shipped
    name = "llama-3.2-1b"
    model = from_hf_config(load_config(name)[1], name, derive=False)
    w, p = Workload(batch=2, seq=512), Parallel("tp", gpus=2)
    got = estimate(model, w, p, options=Options(derive=False))
    forced = estimate(model, w, p, options=Options(derive=False, analytic_tp=True))
    assert any("no traced profile of one rank at tp=2" in n and "--strategy tp --gpus 2" in n for n in got.notes)
    assert got.stages == forced.stages
    # the pages ask where that profile is: the single-GPU one the split prices from, shipped; none derives a TP rank
    assert profile_where(model, w, p) == "shipped"


@pytest.mark.slow
def test_parallel_check_cheapest_case_is_exact(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    assert parallel_check(["--case", "tp2-infer", "--quiet"]) == 0
    assert "1 of 1 cases exact" in capsys.readouterr().out


def test_fsdp_over_tp_shards_the_tp_slice_again():
    # FSDP2 over dp 2 of rank 0's TP slice (tp 2): 45,376 / 2 = 22,688 parameters at load (every dim 0 divides)
    trace = run_traced(TINY, Workload(batch=1, seq=8), Parallel("fsdp", gpus=4, tp=2))
    assert trace.log.stages[0].breakdown["weights"] == 22_688 * BF16
    assert any("(dp 2, tp 2) mesh" in n for n in trace.notes)
    assert not torch.distributed.is_initialized()


def test_sequence_parallelism_shards_the_residual_stream_not_the_weights():
    # torchtitan's SP: the norms' inputs and outputs and the block outputs are (b, s / tp, h) shards; the weights
    # are those of TP alone (norms replicated either way), the activations fewer
    plain = run_traced(TINY, Workload(batch=2, seq=16), Parallel("tp", gpus=2))
    sp = run_traced(TINY, Workload(batch=2, seq=16), Parallel("tp", gpus=2, sequence_parallel=True))
    fwd = {t: next(p.breakdown for p in r.log.stages if p.stage == "forward") for t, r in (("tp", plain), ("sp", sp))}
    assert fwd["sp"]["weights"] == fwd["tp"]["weights"] == 45_376 * BF16
    assert fwd["sp"]["activations"] < fwd["tp"]["activations"]
    assert parallel_class(Parallel("tp", gpus=2, sequence_parallel=True)) == {"strategy": "tp", "tp": 2, "sp": True}

