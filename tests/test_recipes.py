"""The recipe knobs (tracer.recipes, losses, offload) do to memory what their framework sources say.

Sizes are the tiny configs in tests/data/tiny; t-llama: hidden H = 128, intermediate I = 352, 4 heads of 32, 2 KV
heads (KV width 64), vocab V = 512, 3 layers, bf16 (2 bytes), tied embeddings (one V x H = 131072-byte weight).
Expected bytes are derived in the comments.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from estimator.spec import Parallel, Workload  # noqa: E402
from tracer import kernels, losses, offload, session  # noqa: E402
from tracer.counters import CATEGORIES, StorageCounter  # noqa: E402

TINY = Path(__file__).parent / "data" / "tiny"
LLAMA = json.loads((TINY / "t-llama.json").read_text())
V, H = 512, 128


def _counted(config: dict, w: Workload, p: Parallel = Parallel()):
    """(counter, model) of a two-step traced run, as run_traced counts it."""
    with kernels.emulate("cuda"), session._prepared(config, w, p) as case:
        return session._run(case, 2), case.model


def _at_marks(counter, category: str, stage: str, reduce=None) -> list[int]:
    """Bytes of `category` live at the end of each `stage` window (or, with reduce=max, its largest in the window)."""
    tl = counter.timeline()
    live = tl.live()[CATEGORIES.index(category)]
    out, prev = [], 0
    for t, st in tl.marks:
        if st == stage:
            out.append(int(live[prev:t + 1].max() if reduce is max else live[t]))
        prev = t
    return out


def _stage_peaks(counter) -> dict[str, int]:
    return {s.stage: s.peak_bytes for s in counter.log().stages}


# ------------------------------------------------------------------------------------------------- chunked loss

def test_chunked_cross_entropy_equals_the_full_loss():
    torch.manual_seed(0)
    logits = torch.randn(2, 12, 7)
    labels = torch.randint(0, 7, (2, 12))
    labels[0, :3] = losses.IGNORE_INDEX
    full = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
    chunked = losses.chunked_cross_entropy(list(logits.tensor_split(4, dim=1)), labels, 4)
    assert torch.allclose(full, chunked)


def test_chunked_loss_drops_the_fp32_copy_of_the_logits():
    # HF's loss at its forward peak holds the bf16 logits (2 bytes per logit), their fp32 copy (4) and the fp32
    # log-softmax it saves for backward (4): 10 * b*s*V. torchtune's chunked loss holds the bf16 chunks (2), the
    # saved fp32 log-softmax of every chunk (4) and one chunk's fp32 copy (4 / chunks): the fp32 copy drops from
    # b*s*V*4 to b*(s/8)*V*4, i.e. by 4 * 2*256*512 * (1 - 1/8) = 917504 bytes. The labels and loss scalars of the
    # two paths differ by a few bytes (HF pads and slices, torchtune appends one ignore column).
    w = Workload(batch=2, seq=256)
    full = _stage_peaks(_counted(LLAMA, w)[0])["forward"]
    chunked = _stage_peaks(_counted(LLAMA, replace(w, loss="chunked"))[0])["forward"]
    assert abs((full - chunked) - 917504) <= 64


# ------------------------------------------------------------------------------------------------- fused linear

def test_liger_chunk_rule_matches_its_source():
    # fused_linear_cross_entropy_forward's comment: BT = 4096*4, V = 32000, H = 4096 => inc_factor 8, chunk 2048
    assert losses.liger_chunk_rows(4096 * 4, 32000, 4096) == 2048
    assert losses.liger_chunk_rows(2 * 256, V, H) == 128   # inc 4, cdiv(512, 4) = 128, a power of two already
    assert losses.liger_chunk_rows(3 * 100, V, H) == 128   # cdiv(300, 4) = 75 -> 128
    for bt in range(1, 5000, 37):                          # the profile's rule bounds Liger's from above
        liger, bound = losses.liger_chunk_rows(bt, 128256, 2048), losses.bounding_chunk_rows(bt, 128256, 2048)
        assert liger - 1 <= bound <= 4 * liger


def test_a_chunked_loss_is_verified_at_a_seq_its_chunks_divide():
    """bench_cold found qwen2.5-7b fused-linear (k = 16 chunks) and a 16-chunk loss refused at verify seq 1016: the
    chunks there are ceil(s / 16) rows, a step no polynomial follows. The verify seq is a multiple of the chunk count
    where one is free (tracer.derive.chunk_step)."""
    from tracer import derive

    assert losses.bounding_chunk_count(152064, 3584) == 16          # qwen2.5-7b: inc_factor 43
    assert derive.choose_seqs(0, 256) == ((256, 512, 768), 1016)    # the default is unchanged
    for step in (16, 32, 64, 128):
        seqs, verify = derive.choose_seqs(0, 256, step=step)
        assert verify % step == 0 and verify not in seqs and verify > max(seqs)
    w = Workload(loss="chunked", loss_chunks=16)
    assert derive.chunk_step(w, type("C", (), {"vocab_size": 152064, "hidden_size": 3584})()) == 16
    assert derive.chunk_step(Workload(loss="fused-linear"),
                             type("C", (), {"vocab_size": 152064, "hidden_size": 3584})()) == 16
    assert derive.chunk_step(Workload(), None) == 8


def test_fused_linear_cross_entropy_gradients_are_right():
    torch.manual_seed(0)
    x = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    t = torch.randint(0, 24, (40,))
    t[:5] = losses.IGNORE_INDEX
    loss = losses.FusedLinearCrossEntropy.apply(x, w, t, None, lambda bt, v, h: 8)  # 5 chunks of 8 rows
    (loss * 3).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x2 @ w2.t(), t, ignore_index=-100)
    (ref * 3).backward()
    assert torch.allclose(loss, ref, atol=1e-5) and torch.allclose(x.grad, x2.grad, atol=1e-5)
    assert torch.allclose(w.grad, w2.grad, atol=1e-5)


def test_fused_linear_forward_never_holds_more_than_one_chunk_of_logits():
    # BT = 512 tokens, V = 512, H = 128, bf16: Liger's chunk is 128 rows (above). At the forward's peak, the
    # mm(grad_logits.t(), x_chunk).float() of a chunk, these are alive:
    #   grad_input (BT, H) 131072 + grad_weight (V, H) 131072 + loss_1d (BT,) fp32 2048 + n_non_ignore 8
    #   + one chunk of logits (128, V) 131072 + the mm (V, H) bf16 131072 + its fp32 copy 262144 = 788488 bytes,
    # where full logits alone would be BT*V*2 = 524288 bytes.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(512, H, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(V, H, dtype=torch.bfloat16, requires_grad=True)
        t = torch.zeros(512, dtype=torch.int64)
        counter = StorageCounter()
        counter.track([x, w, t], "other")
        with counter:
            losses.FusedLinearCrossEntropy.apply(x, w, t, None, losses.liger_chunk_rows)
    assert counter.peak_bytes - (131072 + 131072 + 4096) == 788488


# ------------------------------------------------------------------------------------------------- optimizer

def test_optimizer_in_backward_keeps_one_gradient_at_a_time():
    # torchtune steps each parameter in its post-accumulate-grad hook and frees its .grad: no set of gradients is
    # ever alive. At most one .grad at a time, so the most gradient bytes ever live is the largest parameter's,
    # the tied embedding (V x H bf16 = 131072); without it every gradient (all 684928 params, 1369856 bytes) is.
    w = Workload(batch=1, seq=16)
    plain, _ = _counted(LLAMA, w)
    fused, _ = _counted(LLAMA, replace(w, optimizer_in_backward=True))
    assert _at_marks(plain, "gradients", "backward", reduce=max) == [1369856, 1369856]
    assert _at_marks(fused, "gradients", "backward", reduce=max) == [131072, 131072]
    assert _at_marks(fused, "gradients", "optimizer", reduce=max) == [0, 0]
    # the states are the same: AdamW's two bf16 moments per parameter (2 * 1369856) and a 4-byte step per tensor
    assert _at_marks(fused, "optimizer_states", "optimizer") == _at_marks(plain, "optimizer_states", "optimizer")


# ------------------------------------------------------------------------------------------------- offloading

def test_offload_keeps_only_the_stash_of_five_on_the_gpu():
    # ten exp ops on (16, 16) fp32 = 1024 bytes each (offloaded: >= min_offload_size); each saves its output.
    # Without offloading the ten outputs stay: 10 * 1024 + the input's 1024 = 11264 at the forward peak. With it,
    # only the forward stash of the last max_fwd_stash_size = 5 is kept: the peak is when the next output is
    # allocated before its pack drops the oldest, (1 input + 5 stashed + 1 new) * 1024 = 7168.
    from torch._subclasses.fake_tensor import FakeTensorMode

    peaks = {}
    for name, hooks in (("kept", torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)),
                        ("offloaded", offload.OffloadActivations())):
        with FakeTensorMode():
            x = torch.empty(16, 16, requires_grad=True)
            counter = StorageCounter()
            counter.track([x], "other")
            with counter:
                with hooks:
                    y = x
                    for _ in range(10):
                        y = torch.exp(y)
                counter.mark_stage("forward")
                y.sum().backward()
                del y
                counter.mark_stage("backward")
        peaks[name] = _stage_peaks(counter)["forward"]
    assert peaks == {"kept": 11264, "offloaded": 7168}


def test_offload_moves_every_layers_saved_activations_off_the_gpu():
    # Without offloading each decoder layer adds its saved activations at the end of forward; with torchtune's
    # offloading every saved tensor of a layer of at least min_offload_size (1024 B) leaves the GPU (only the stash
    # of the last five, in the final norm and head, stays), so a third layer adds only what is smaller: the CUDA
    # flash kernel's philox seed (uint64[2]) and offset (uint64), saved for its backward: 24 B.
    acts = {}
    for layers in (2, 3):
        for off in (False, True):
            c, _ = _counted({**LLAMA, "num_hidden_layers": layers}, Workload(batch=2, seq=256, activation_offload=off))
            acts[(layers, off)] = _at_marks(c, "activations", "forward")[-1]
    assert acts[(3, True)] - acts[(2, True)] == 24
    assert acts[(3, False)] - acts[(2, False)] == 2895896  # one layer's saved activations, all on the GPU


# ------------------------------------------------------------------------------------------------- op-sac

def test_op_sac_saves_every_other_mm_and_attention_per_layer():
    # torchtitan's per-op policy in one Llama layer (b*s = 512 tokens, bf16): the 7 mms run q, k, v, o, gate, up,
    # down; odd-numbered ones are saved: q (512 x 128) 131072 + v (512 x 64) 65536 + gate (512 x 352) 360448
    # + down (512 x 128) 131072; SDPA's output (512 x 128) 131072 and its logsumexp (2 x 4 x 256 fp32) 8192; and
    # the checkpoint's input, the layer's hidden state 131072; the CUDA flash kernel's philox seed (uint64[2], 16 B)
    # and offset (uint64, 8 B), saved for its backward. Together 958488 bytes per layer.
    acts = {}
    for layers in (2, 3):
        c, _ = _counted({**LLAMA, "num_hidden_layers": layers}, Workload(batch=2, seq=256, checkpointing="op-sac"))
        acts[layers] = _at_marks(c, "activations", "forward")[-1]
    assert acts[3] - acts[2] == 958488


# ------------------------------------------------------------------------------------------------- fsdp-mp

def test_fsdp_mixed_precision_keeps_fp32_shards():
    # 684928 parameters over 2 ranks. fsdp-mp: fp32 shards (684928 * 4 / 2 = 1369856 bytes) and fp32 sharded
    # gradients (reduce_dtype float32); pure bf16: half of each.
    par = Parallel(strategy="fsdp", gpus=2)
    for recipe, shard in (("fsdp-mp", 1369856), ("pure", 684928)):
        c, _ = _counted(LLAMA, Workload(batch=1, seq=32, recipe=recipe), par)
        assert _at_marks(c, "weights", "load") == [shard]
        assert _at_marks(c, "gradients", "optimizer", reduce=max) == [shard, shard]


# ------------------------------------------------------------------------------------------------- float8

def test_float8_saves_what_bf16_saves():
    # torchao's matmul_with_hp_or_float8_args saves (input_hp, weight_hp_t): the same tensors a bf16 Linear
    # saves, so the activations alive at the end of forward are the bf16 run's. All 7 Linears of each of the 3
    # layers are converted (every dimension a multiple of 16); the tied lm_head is not.
    pytest.importorskip("torchao")
    w = Workload(batch=2, seq=64)
    bf16, _ = _counted(LLAMA, w)
    f8, model = _counted(LLAMA, replace(w, float8=True))
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 21
    assert _at_marks(f8, "activations", "forward") == _at_marks(bf16, "activations", "forward")


# ------------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("workload, parallel, message", [
    (Workload(recipe="fsdp-mp"), Parallel(), "^recipe: fsdp-mp is FSDP2's MixedPrecisionPolicy"),
    (Workload(compile=True), Parallel(strategy="fsdp", gpus=4, cp=2), "^compile: traced on one GPU, DDP, an FSDP2 rank"),
    (Workload(compile=True, loss="chunked"), Parallel(), "^compile: traced with loss='full'"),
    (Workload(compile=True, checkpointing="full"), Parallel(), "^compile: traced with loss='full'"),
    (Workload(optimizer_in_backward=True, recipe="mixed"), Parallel(), "^optimizer_in_backward: recipe 'mixed'"),
    (Workload(optimizer_in_backward=True), Parallel(strategy="ddp", gpus=2), "^optimizer_in_backward: ddp"),
    (Workload(loss="fused-linear", loop="keep-output"), Parallel(), "^loop: keep-output keeps the logits"),
    (Workload(activation_offload=True, checkpointing="selective"), Parallel(), "^activation_offload: torchtune"),
])
def test_impossible_combinations_are_refused_in_one_line(workload, parallel, message):
    with pytest.raises(ValueError, match=message) as e:
        session.check_traceable(workload, parallel)
    assert "\n" not in str(e.value)


def test_chunked_loss_on_a_masked_lm_is_refused():
    from tracer import runner

    bert = json.loads((TINY / "t-bert.json").read_text())
    with pytest.raises(ValueError, match="^loss: 'chunked' chunks a causal LM's output head"):
        runner.build_model(bert, Workload(loss="chunked"), device="meta")


def test_trace_flags_parse_booleans_and_refuse_others():
    import argparse

    from bench.trace import grid

    parser = argparse.ArgumentParser()
    grid.add_arguments(parser)
    args = parser.parse_args(["--model", "x", "--loss", "chunked,fused-linear", "--optimizer-in-backward", "true,false",
                              "--activation-offload", "True"])
    axes = grid.axes_from_args(args)
    assert axes["loss"] == ["chunked", "fused-linear"] and axes["optimizer_in_backward"] == [True, False]
    assert axes["activation_offload"] == [True]
    with pytest.raises(ValueError, match="^float8: 'maybe' is not allowed; choose true or false"):
        grid.axes_from_args(parser.parse_args(["--model", "x", "--float8", "maybe"]))
    assert "Liger" in parser.format_help()


# ------------------------------------------------------------------------------------------------- pricing

@pytest.mark.parametrize("knob", [dict(loss="chunked"), dict(loss="fused-linear"), dict(optimizer_in_backward=True),
                                  dict(activation_offload=True), dict(checkpointing="op-sac"), dict(compile=True)])
def test_traced_knobs_keep_their_own_profile_class(knob):
    from estimator.estimate import traced_class

    tw, _, _ = traced_class(Workload(batch=4, seq=2048, **knob), Parallel())
    assert all(getattr(tw, k) == v for k, v in knob.items())


def test_float8_is_traced_where_torchao_is_installed_and_priced_as_bf16_elsewhere():
    import importlib.util

    from estimator.estimate import traced_class

    tw, _, notes = traced_class(Workload(float8=True), Parallel())
    if importlib.util.find_spec("torchao") is not None:
        assert tw.float8 and not notes
    else:
        assert not tw.float8 and notes[0].startswith("float8: torchao is not installed")


def test_untraced_compile_is_priced_as_eager_with_its_reason():
    from estimator.estimate import traced_class

    tw, _, notes = traced_class(Workload(compile=True, loss="chunked"), Parallel(strategy="fsdp", gpus=8))
    assert not tw.compile and [n for n in notes if n.startswith("compile: traced with loss='full'")]
    # a pipeline priced by the rule (its ranks not traced): the single-GPU step, one graph, which full checkpointing
    # rules out
    tw, _, notes = traced_class(Workload(compile=True, checkpointing="full"), Parallel(strategy="pp", gpus=2))
    assert not tw.compile and notes[-1].endswith("estimated as eager")
    tw, _, notes = traced_class(Workload(compile=True, checkpointing="full"), Parallel(strategy="fsdp", gpus=8))
    assert tw.compile and [n for n in notes if n.startswith("compile")] == [   # torchtitan's per-block graphs
        "compile: traced as AOTAutograd's partitioner saves, each block and the loss apart (torchtitan, torchtune); "
        "inductor's fusion inside a graph is not modelled, so a peak inside forward or backward can read above a "
        "compiled run's"]


def test_chunked_loss_profile_lowers_the_estimate():
    # The profile of loss='chunked' is derived from traces that run it; at the trace's sizes its forward stage is
    # the trace's forward peak, 917504 bytes (within a few) below the full loss's (test above).
    from estimator.estimate import Options, estimate
    from estimator.model import from_hf_config

    model = from_hf_config(LLAMA, "t-llama")
    w = Workload(batch=2, seq=256)
    # tensor bytes: the allocator's cache on top is a fitted function of them (estimator.reserved), not traced
    full = estimate(model, w, options=Options()).stage("forward").tensor_bytes
    chunked = estimate(model, replace(w, loss="chunked"), options=Options()).stage("forward").tensor_bytes
    assert abs((full - chunked) - 917504) <= 64


# ------------------------------------------------------------------------------------------------- compile

def test_compiled_step_saves_what_the_partitioner_chooses():
    # AOTAutograd's min-cut partitioner recomputes cheap pointwise ops (norms, SiLU, the RoPE products) in backward
    # instead of saving their outputs: a layer of the compiled step keeps less at the end of forward than eager's
    # 2895872 bytes (b*s = 512 tokens; measured in the offload test above), and the step still produces every
    # gradient (684928 bf16 parameters: 1369856 bytes) and AdamW's states (2739712 + 30 four-byte step counters).
    acts, c = {}, None
    for layers in (2, 3):
        c, _ = _counted({**LLAMA, "num_hidden_layers": layers}, Workload(batch=2, seq=256, compile=True))
        acts[layers] = _at_marks(c, "activations", "forward")[-1]
    assert 0 < acts[3] - acts[2] < 2895872
    assert _at_marks(c, "gradients", "optimizer", reduce=max) == [1369856, 1369856]
    assert _at_marks(c, "optimizer_states", "optimizer") == [2739832, 2739832]


@pytest.mark.parametrize("knob", [dict(loss="fused-linear"), dict(activation_offload=True)])
def test_torch_memtracker_agrees_with_the_counter(knob):
    # torch's own MemTracker counts the same run independently: the overall peaks must agree to the byte (the two
    # knobs with their own autograd machinery; chunked and op-sac agree too: python -m bench trace --check)
    trace = session.run_traced(LLAMA, Workload(batch=1, seq=32, **knob), Parallel(), check=True)
    assert any(n.startswith("MemTracker agrees to the byte") for n in trace.notes)


FSDP2 = Parallel(strategy="fsdp", gpus=2)


def test_fsdp_compiles_each_block_and_the_loss_and_keeps_no_step_alive():
    """Under FSDP2 each decoder layer and the loss are compiled apart (torchtitan's apply_compile): less is saved than
    eager's, and nothing of a step outlives it (the warm-up's copies have storages of their own: sharing them, the
    graphs' example inputs kept the first step's layer inputs, position embeddings and logits, 238,080 B, into the
    next optimizer step)."""
    w = Workload(batch=2, seq=64)
    eager, _ = _counted(LLAMA, w, FSDP2)
    comp, model = _counted(LLAMA, replace(w, compile=True), FSDP2)
    assert getattr(model, "_willitfit_units_compiled", False)
    assert _at_marks(comp, "activations", "forward", reduce=max)[-1] < _at_marks(eager, "activations", "forward",
                                                                                 reduce=max)[-1]
    for category in CATEGORIES:
        assert _at_marks(comp, category, "optimizer", reduce=max) == _at_marks(eager, category, "optimizer",
                                                                               reduce=max), category


def test_fsdp_checkpoint_wraps_the_compiled_block():
    """torchtune wraps each compiled layer in its checkpoint, torchtitan applies AC before compile: under full
    checkpointing a compiled block keeps only its input in forward and recomputes its compiled forward in backward
    (transformers' own wrapper, inside the compiled forward, would have checkpointed nothing)."""
    w = Workload(batch=2, seq=64, compile=True)
    plain, _ = _counted(LLAMA, w, FSDP2)
    ckpt, model = _counted(LLAMA, replace(w, checkpointing="full"), FSDP2)
    calls = [layer.forward for layer in model.modules() if hasattr(layer, "gradient_checkpointing")
             and isinstance(getattr(layer, "forward", None), __import__("functools").partial)]
    assert len(calls) == LLAMA["num_hidden_layers"]
    assert max(_at_marks(ckpt, "activations", "backward", reduce=max)) < max(_at_marks(plain, "activations", "backward",
                                                                                       reduce=max))
