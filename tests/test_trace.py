"""Traced tier: the counter, trace_case, FSDP on a fake process group, grids and the `trace` CLI.

The central test derives every stage peak of a 2-layer Llama by hand from what each op allocates and
what autograd saves, and requires the trace to match to the byte.
"""
from __future__ import annotations

import json

import pytest
import torch

from bench.trace import grid

from bench.trace import cases as trace
from bench.__main__ import main
from tracer.counters import StorageCounter
from bench.store.validate import validate_row
from estimator.spec import Parallel, Workload

BF16, FP32, INT64 = 2, 4, 8  # bytes per element

# Hand-written tiny Llama (nothing fetched). head_dim = 64 / 4 = 16; K/V heads = 2 (grouped-query).
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256, "tie_word_embeddings": False}
H, I, V, L, NH, KVH, HD = 64, 128, 128, 2, 4, 2, 16


def tiny_params() -> int:
    """Parameters of TINY: embedding, per layer q/k/v/o + gate/up/down + 2 RMSNorm weights, final norm, lm_head."""
    per_layer = H * NH * HD + 2 * H * KVH * HD + NH * HD * H + 3 * H * I + 2 * H
    return V * H + L * per_layer + H + V * H  # 8192 + 2 * 36992 + 64 + 8192 = 90432


def stages(row) -> dict:
    return json.loads(row["breakdown_json"])["stages"]


@pytest.fixture(scope="module")
def tiny_row():
    """B=1, T=8, pure bf16, AdamW foreach, two steps; torch's MemTracker runs on the same trace."""
    return trace.trace_case(TINY, "tiny", Workload(batch=1, seq=8), Parallel(), check=True)


def test_tiny_llama_stage_peaks_match_hand_derivation(tiny_row):
    # Every number below is what the ops allocate (B=1, T=8, see tiny_row).
    B, T = 1, 8
    row = tiny_row
    assert f"MemTracker agrees to the byte ({row['peak_alloc_bytes']} B)" in row["notes"]
    assert row["params"] == tiny_params() == 90432
    W = tiny_params() * BF16                       # 180,864 B of bf16 weights
    n_tensors = 1 + L * 9 + 1 + 1                  # parameter tensors: 21
    S = 2 * W + n_tensors * FP32                   # exp_avg + exp_avg_sq (bf16) + a fp32 `step` per tensor
    inputs = 2 * B * T * INT64                     # input_ids + labels
    buffers = 2 * (HD // 2) * FP32                 # RoPE inv_freq and original_inv_freq
    load = W + inputs + buffers
    assert row["load_peak_alloc_bytes"] == load == 181_056

    # Forward peak = the last op of the loss, in step 2 (Adam states exist). Alive then:
    # per layer, what autograd saved:
    #   RMSNorm (x2): fp32 copy of its input (B*T*H*4, saved by pow and mul), rsqrt (B*T*4), bf16
    #     normalised copy (B*T*H*2, saved by the weight mul), its output (B*T*H*2, saved by the mm's).
    norm = B * T * H * FP32 + B * T * FP32 + 2 * B * T * H * BF16
    #   attention (CUDA's flash kernel, tracer.kernels): q and k after RoPE, v (the SDPA inputs, saved
    #     by it; with no mask HF passes enable_gqa, so K/V are not repeated), the SDPA output (B*T*NH*HD), its
    #     fp32 logsumexp (B*NH*T) and the RNG state flash_api.cpp mha_fwd allocates on the GPU even without
    #     dropout (rng_state: 2 uint64, _unused: 1 uint64). The q/k projection outputs die once RoPE has
    #     replaced them (mm saves its input).
    rng = 3 * INT64
    attn = B * T * (NH + 2 * KVH) * HD * BF16 + B * T * NH * HD * BF16 + B * NH * T * FP32 + rng
    #   MLP: gate (saved by silu), silu out and up (saved by their mul), the product (saved by down).
    mlp = 4 * B * T * I * BF16
    per_layer = 2 * norm + attn + mlp                                    # 19,672 B
    cos_sin = 2 * B * T * HD * BF16        # saved by the RoPE muls, shared by all layers
    final_norm = norm
    # The loss (transformers/loss/loss_utils.py ForCausalLMLoss): bf16 logits, their fp32 upcast,
    # labels padded by one (B*(T+1) int64), log_softmax (fp32, saved), the loss and total_weight.
    loss = B * T * V * BF16 + B * T * V * FP32 + B * (T + 1) * INT64 + B * T * V * FP32 + 2 * FP32
    activations = L * per_layer + cos_sin + final_norm + loss
    assert activations == 54_304
    forward = load + S + activations
    assert row["forward_peak_alloc_bytes"] == forward == 597_172

    # Backward peak = its last op, embedding_dense_backward, in step 2: every layer's gradients
    # (73,984 B) outweigh the activations it saved (19,672 B), so memory only grows through the
    # backward. Alive then: all gradients (W bytes), the gradient of the embedding output
    # (B*T*H bf16), the loss and NLL's saved total_weight.
    backward = load + S + W + B * T * H * BF16 + 2 * FP32
    assert row["backward_peak_alloc_bytes"] == backward == 724_764

    # Optimizer peak = torch._foreach_sqrt(exp_avg_sqs) in _multi_tensor_adamw: one bf16 temporary per
    # parameter while weights, gradients and states are alive (torch/optim/adamw.py).
    optimizer = load + W + S + W
    assert row["optimizer_peak_alloc_bytes"] == optimizer == 904_596
    assert row["peak_alloc_bytes"] == optimizer

    # The categories at each peak sum to it and name the same tensors.
    opt = stages(row)["optimizer"]
    assert sum(opt.values()) == optimizer
    assert (opt["weights"], opt["gradients"], opt["optimizer_states"], opt["activations"]) == (W, W, S, W)
    assert stages(row)["forward"]["activations"] == activations


def test_fused_adamw_has_no_foreach_temporary():
    row = trace.trace_case(TINY, "tiny", Workload(batch=1, seq=8, optimizer_impl="fused"))
    W = tiny_params() * BF16
    assert row["optimizer_peak_alloc_bytes"] == 904_596 - W  # the foreach sqrt temporary is gone


@pytest.mark.parametrize("workload", [
    Workload(batch=1, seq=8, recipe="amp", checkpointing="full", attention="eager"),
    Workload(batch=1, seq=8, recipe="mixed", checkpointing="selective"),
])
def test_memtracker_agrees_to_the_byte(workload):
    # check=True runs torch's MemTracker nested in the same run and raises if the peaks differ.
    row = trace.trace_case(TINY, "tiny", workload, check=True)
    assert f"MemTracker agrees to the byte ({row['peak_alloc_bytes']} B)" in row["notes"]


def test_counter_counts_storages_not_views_and_classifies_the_past():
    counter = StorageCounter()
    with counter:
        x = torch.empty(256, dtype=torch.float32)          # 1024 B
        v = x.view(16, 16)[:, :4]                          # a view: same storage, not counted again
        y = torch.empty(128, dtype=torch.bfloat16)         # 256 B; peak 1280 here
        del y
    assert counter.current_bytes == 1024 and counter.peak_bytes == 1280
    counter.track([v], "gradients")                        # role given after the peak still applies there
    counter.mark_stage("forward")
    peak = counter.log().peak
    assert peak.breakdown["gradients"] == 1024 and peak.breakdown["activations"] == 256
    assert sum(peak.breakdown.values()) == peak.peak_bytes


def test_counter_follows_storage_resize():
    original = torch.UntypedStorage.resize_
    counter = StorageCounter()
    with counter:
        x = torch.empty(100, dtype=torch.uint8)
        x.untyped_storage().resize_(0)                     # FSDP2 frees unsharded parameters like this
        assert counter.current_bytes == 0
        x.untyped_storage().resize_(300)
    assert counter.current_bytes == 300 and counter.peak_bytes == 300
    assert torch.UntypedStorage.resize_ is original      # the patch is gone after the context


@pytest.mark.filterwarnings("ignore::FutureWarning")  # PEFT calls a deprecated transformers helper
def test_lora_trace_counts_peft_trainable_parameters():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    w = Workload(batch=1, seq=8, method="lora", lora_rank=4, lora_targets=("q_proj", "v_proj"))
    row = trace.trace_case(TINY, "tiny", w)
    with torch.device("meta"):
        cfg = AutoConfig.for_model(**TINY)
        peft_model = get_peft_model(AutoModelForCausalLM.from_config(cfg),
                                    LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainable, total = peft_model.get_nb_trainable_parameters()
    # per layer: q (64->4->64) and v (64->4->32): 4*64 + 64*4 + 4*64 + 32*4 = 896; two layers
    assert row["trainable_params"] == trainable == L * (4 * H + NH * HD * 4 + 4 * H + KVH * HD * 4) == 1792
    assert row["params"] == total
    opt = stages(row)["optimizer"]
    assert opt["gradients"] == trainable * FP32        # PEFT keeps adapters (and so their grads) in fp32
    assert opt["weights"] == tiny_params() * BF16 + trainable * FP32


def test_inference_prefill_and_decode_kv_cache():
    B, T, N = 1, 8, 3
    row = trace.trace_case(TINY, "tiny", Workload(mode="infer", batch=B, seq=T, gen_tokens=N))
    kv_per_token_layer = 2 * B * KVH * HD * BF16       # K and V of one token in one layer
    st = stages(row)
    # The prefill peak comes after every layer has cached its T tokens (it is in the last layer).
    assert st["prefill"]["kv_cache"] == L * T * kv_per_token_layer == 2048
    # Decoding: DynamicLayer.update concatenates into a new tensor while the old one is still held, so
    # the peak of the last token has every layer at T+N tokens plus the last layer's old V (T+N-1).
    assert st["decode"]["kv_cache"] == L * (T + N) * kv_per_token_layer + (T + N - 1) * kv_per_token_layer // 2
    assert row["forward_peak_alloc_bytes"] is None and row["decode_peak_alloc_bytes"] > 0


def test_fsdp_shards_weights_and_agrees_with_fsdp_mem_tracker():
    W = tiny_params() * BF16
    for world in (2, 4):
        # check=True: FSDPMemTracker counts its own run of the case and must find the same peak
        row = trace.trace_case(TINY, "tiny", Workload(batch=1, seq=8), Parallel(strategy="fsdp", gpus=world),
                               check=world == 2)
        assert world != 2 or "FSDPMemTracker agrees to the byte" in row["notes"]
        # every dim 0 here divides by 4, so FSDP2's padded shards are exact: 1/N of the weights per rank
        assert stages(row)["load"]["weights"] == W // world
        per_rank = json.loads(row["per_rank_json"])
        assert per_rank["world_size"] == world and per_rank["ranks"][0]["peak_alloc_bytes"] == row["peak_alloc_bytes"]
    assert not torch.distributed.is_initialized()


def test_cases_do_not_leak_into_each_other(tiny_row):
    def peaks(row):
        return [row[k] for k in sorted(row) if k.endswith("_peak_alloc_bytes")]

    # tiny_row was traced earlier in this process; FSDP (fake process group) runs in between
    w = Workload(batch=1, seq=8)
    fsdp = Parallel(strategy="fsdp", gpus=2)
    # A shape no other test uses: the first FSDP run meets DTensor's sharding propagation cold, which
    # runs ops on global-shape fake tensors; the counter must not count them, so both runs agree.
    cold = trace.trace_case(TINY, "tiny", Workload(batch=3, seq=5), fsdp)
    warm = trace.trace_case(TINY, "tiny", Workload(batch=3, seq=5), fsdp)
    assert peaks(cold) == peaks(warm)
    again = trace.trace_case(TINY, "tiny", w)
    assert peaks(tiny_row) == peaks(again) and tiny_row["run_id"] == again["run_id"]


def test_ddp_adds_gradient_buckets():
    row = trace.trace_case(TINY, "tiny", Workload(batch=1, seq=8), Parallel(strategy="ddp", gpus=2))
    assert stages(row)["load"]["comm_buffers"] == tiny_params() * BF16
    assert row["load_peak_alloc_bytes"] == 181_056 + tiny_params() * BF16


@pytest.mark.parametrize("workload, parallel, field", [
    (Workload(), Parallel(strategy="zero2", gpus=2), "strategy"),
    (Workload(), Parallel(strategy="pp", gpus=2), "microbatches"),   # 1F1B needs as many micro-batches as stages
    (Workload(mode="infer"), Parallel(strategy="tp", gpus=2, sequence_parallel=True), "sequence_parallel"),
    (Workload(), Parallel(strategy="zero3", gpus=2, offload="optimizer"), "offload"),
    (Workload(method="qlora"), Parallel(), "method"),
    (Workload(optimizer="adafactor"), Parallel(), "optimizer"),
    (Workload(mode="infer", kv_dtype="int8"), Parallel(), "kv_dtype"),
    (Workload(mode="infer", weight_format="nf4"), Parallel(), "weight_format"),
])
def test_untraceable_cases_name_the_field(workload, parallel, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        trace.check_traceable(workload, parallel)


def test_row_is_valid_and_run_id_is_predictable(tiny_row):
    w, p = Workload(batch=1, seq=8), Parallel()
    row = tiny_row
    valid, errors = validate_row(row)
    assert errors == [] and valid["run_id"] == row["run_id"] == trace.case_run_id(TINY, w, p)
    assert row["source"] == "traced" and row["gpu_name"] == "fake-cpu" and row["gpu_total_bytes"] is None
    assert row["load_peak_reserved_bytes"] is None and "no fragmentation" in row["notes"]


# ---- grids -------------------------------------------------------------------------------------------

def test_grid_expands_and_counts_invalid_combinations(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    axes = {"mode": ["train", "infer"], "method": ["full", "lora"], "batch": [1, 2], "seq": [8, 16]}
    cases, skipped = grid.expand([str(path)], axes)
    assert len(cases) == 12                       # 16 combinations, minus infer+lora (4)
    assert sum(skipped.values()) == 4 and all(msg.startswith("method: ") for msg in skipped)
    assert {c.model_name for c in cases} == {"tiny"}


@pytest.mark.parametrize("text, typ, allowed, message", [
    ("1,x", int, None, "batch: 'x' is not an integer"),
    ("1,,2", int, None, "batch: empty value"),
    ("pure,bogus", str, ("pure", "amp"), "batch: 'bogus' is not allowed; choose one of pure, amp"),
])
def test_grid_list_errors_name_the_flag(text, typ, allowed, message):
    with pytest.raises(ValueError, match=message):
        grid.parse_list("batch", text, typ, allowed)


def test_grid_refuses_huge_sweeps():
    with pytest.raises(ValueError, match="^grid: "):
        grid.expand(["x"], {"batch": list(range(1, 400)), "seq": list(range(1, 400))})


# ---- the CLI -----------------------------------------------------------------------------------------

@pytest.fixture
def tiny_path(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_cli_single_case_prints_table_and_resumes(tiny_path, tmp_path, capsys):
    out, db = tmp_path / "runs.jsonl", tmp_path / "absent.duckdb"
    argv = ["trace", "--model", tiny_path, "--batch", "1", "--seq", "8", "--out", str(out), "--db", str(db)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "GiB (2^30 B)" in printed and "optimizer_states" in printed and "optimizer" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["peak_alloc_bytes"] == 904_596
    assert main(argv) == 0                                    # second run: already in --out, skipped
    assert "nothing to trace" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 1
    assert not db.exists()


def test_cli_grid_writes_one_row_per_case(tiny_path, tmp_path, capsys):
    out = tmp_path / "grid.jsonl"
    argv = ["trace", "--model", tiny_path, "--batch", "1", "--seq", "8", "--mode", "train,infer",
            "--method", "full,lora", "--out", str(out), "--db", str(tmp_path / "absent.duckdb")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "skipped 1 invalid combination: 1 x method: 'lora' needs mode='train'" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["mode"], r["method"]) for r in rows) == [("infer", "full"), ("train", "full"), ("train", "lora")]


def test_cli_bad_input_exits_2_naming_the_field(tiny_path, capsys):
    assert main(["trace", "--model", tiny_path, "--batch", "1,x"]) == 2
    assert capsys.readouterr().err.strip() == "error: batch: 'x' is not an integer"
    # tp and pp are traced per rank (tracer.tp, tracer.pp); ZeRO-2 is not, nor a 1F1B pipeline short of micro-batches
    assert main(["trace", "--model", tiny_path, "--strategy", "zero2", "--gpus", "2"]) == 2
    assert "not traced: strategy: 'zero2'" in capsys.readouterr().err
    assert main(["trace", "--model", tiny_path, "--strategy", "pp", "--gpus", "2"]) == 2
    assert "not traced: microbatches: 1F1B needs at least as many micro-batches" in capsys.readouterr().err


def test_cli_ingest_then_resume_from_database(tiny_path, tmp_path, capsys):
    db = tmp_path / "bench.duckdb"
    argv = ["trace", "--model", tiny_path, "--batch", "1", "--seq", "8", "--db", str(db)]
    assert main([*argv, "--out", str(tmp_path / "a.jsonl"), "--ingest"]) == 0
    assert "inserted 1" in capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "b.jsonl")]) == 0  # a fresh --out: the database knows the run
    assert "nothing to trace" in capsys.readouterr().err
    assert not (tmp_path / "b.jsonl").exists() or (tmp_path / "b.jsonl").read_text() == ""


def test_cli_nothing_to_trace_prints_the_stored_table_and_offers_force(tiny_path, tmp_path, capsys):
    db = tmp_path / "bench.duckdb"
    argv = ["trace", "--model", tiny_path, "--batch", "1", "--seq", "8", "--db", str(db)]
    assert main([*argv, "--out", str(tmp_path / "a.jsonl"), "--ingest"]) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0  # stored in the database: its table, from the stored row, and the way to trace again
    captured = capsys.readouterr()
    assert "nothing to trace" in captured.err and "--force" in captured.err
    assert "GiB (2^30 B)" in captured.out and "peak" in captured.out
    table = [line for line in first.splitlines() if line.startswith("peak ")]
    assert table and table[0] in captured.out
    assert main([*argv, "--force", "--out", str(tmp_path / "c.jsonl")]) == 0  # --force traces it again
    assert len((tmp_path / "c.jsonl").read_text().splitlines()) == 1


def test_runs_past_learned_positions_are_refused_before_tracing():
    """Fake tensors never check an index: GPT-2 (1024 learned positions) at 2048 tokens must not 'trace'."""
    from bench.trace import cases as tr
    from estimator.presets import load_config

    _, cfg = load_config("gpt2")
    with pytest.raises(ValueError, match="seq: 2048 tokens exceed"):
        tr.trace_case(cfg, "gpt2", Workload(batch=1, seq=2048))
