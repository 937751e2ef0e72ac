"""Hand-checkable numbers for each memory component; the derivation of every expected value is in a comment."""
from __future__ import annotations

import pytest

from estimator import components as comp
from estimator.estimate import estimate
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.spec import Workload
from estimator.units import MiB, dtype_bytes

N = 4096 * 4096  # 16,777,216 weights in a 4096 x 4096 matrix


def _preset(name):
    return from_hf_config(load_config(name)[1], name)


TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}


def test_tiny_llama_params():
    # head_dim 16, kv width 2*16 = 32. Per layer: q 64*64 = 4096, k 64*32 = 2048, v 2048, o 4096,
    # gate/up/down 3 * 64*128 = 24,576, two RMSNorms 128 -> 36,992; x2 layers = 73,984.
    # + embed 100*64 = 6,400 + final norm 64 + untied lm_head 6,400 = 86,848.
    m = from_hf_config(TINY_LLAMA)   # read from transformers' own LlamaForCausalLM, built on meta
    assert m.params == 86_848
    assert m.inventory.linear_params == 2 * (4096 + 2048 + 2048 + 4096 + 24_576)
    assert m.inventory.params_by_role == {"embedding": 6_400, "head": 6_400, "linear": 73_728, "norm": 320}


# ---------------------------------------------------------------- quantized weights

def test_nf4_double_quant_4096():
    # bitsandbytes 4-bit: 2 weights per byte -> N/2 = 8,388,608; one absmax per 64 weights -> 262,144 blocks.
    # Double quant: absmaxes as uint8 (262,144 B) + one fp32 absmax per 256 of them (1,024 * 4 = 4,096 B)
    # + one fp32 offset (4 B): 8,388,608 + 262,144 + 4,096 + 4 = 8,654,852 (0.127 bits/param overhead).
    assert comp.quantized_matrix_bytes(4096, 4096, "nf4") == 8_654_852
    assert comp.quantized_matrix_bytes(4096, 4096, "fp4") == 8_654_852


def test_nf4_without_double_quant_4096():
    # Plain 4-bit: 8,388,608 packed + 262,144 fp32 absmaxes * 4 B = 9,437,184 (4.5 bits/param).
    assert comp.quantized_matrix_bytes(4096, 4096, "nf4", double_quant=False) == 9_437_184


def test_gptq_and_awq_groupwise_4096():
    # GPTQ 4-bit, group 128: qweight N*4/8 = 8,388,608; 32 groups x 4096 columns of fp16 scales = 262,144;
    # packed 4-bit zeros 32*4096/2 = 65,536; g_idx int32 per input column 4*4096 = 16,384 -> 8,732,672.
    assert comp.quantized_matrix_bytes(4096, 4096, "gptq-4bit") == 8_732_672
    # AWQ: the same without g_idx -> 8,716,288.
    assert comp.quantized_matrix_bytes(4096, 4096, "awq-4bit") == 8_716_288
    # GPTQ 8-bit: 16,777,216 + 262,144 scales + 32*4096 = 131,072 zeros + 16,384 g_idx = 17,186,816.
    assert comp.quantized_matrix_bytes(4096, 4096, "gptq-8bit") == 17_186_816


def test_int8_fp8_gguf_4096():
    # LLM.int8: one byte per weight + one fp32 scale per output row: 16,777,216 + 16,384 = 16,793,600.
    assert comp.quantized_matrix_bytes(4096, 4096, "int8") == 16_793_600
    # fp8: one byte per weight + one fp32 per-tensor scale.
    assert comp.quantized_matrix_bytes(4096, 4096, "fp8") == N + 4
    # GGUF Q4_0: block of 32 = 16 B of nibbles + fp16 scale = 18 B -> 4.5 bpw -> N*4.5/8 = 9,437,184.
    assert comp.quantized_matrix_bytes(4096, 4096, "gguf-q4_0") == 9_437_184
    # Q8_0: 34 B per 32 -> 8.5 bpw -> 17,825,792.
    assert comp.quantized_matrix_bytes(4096, 4096, "gguf-q8_0") == 17_825_792


def test_nf4_llama31_8b_whole_model():
    # Per layer (DQ bytes per matrix = n/2 + n/64 + 4*ceil(n/16384) + 4):
    #   q, o 4096x4096: 8,654,852 each; k, v 1024x4096 (n = 4,194,304): 2,097,152 + 65,536 + 1,024 + 4 = 2,163,716
    #   gate, up, down 14336x4096 (n = 58,720,256): 29,360,128 + 917,504 + 14,336 + 4 = 30,291,972
    #   = 2*8,654,852 + 2*2,163,716 + 3*30,291,972 = 112,513,052; x 32 layers = 3,600,417,664.
    # Left in bf16: embed 525,336,576 + lm_head 525,336,576 + norms 32*2*4096 + 4096 = 266,240
    #   -> 1,050,939,392 params * 2 B = 2,101,878,784. Total 5,702,296,448 B (5.31 GiB).
    inv = _preset("llama-3.1-8b").inventory
    assert comp.base_weight_bytes(inv, Workload(mode="infer", weight_format="nf4")) == 5_702_296_448


def test_qlora_adapted_scope_quantizes_only_the_adapted_linears():
    # torchtune's QLoRA: NF4 on q_proj and v_proj only (32 layers each); everything else stays bf16.
    # q: 8,654,852 and v: 2,163,716 per layer as above -> 32 * 10,818,568 = 346,194,176 B of NF4;
    # bf16 for the rest: (8,030,261,248 - 32 * (16,777,216 + 4,194,304)) * 2 = 14,718,345,216.
    inv = _preset("llama-3.1-8b").inventory
    w = Workload(method="qlora", lora_targets=("q_proj", "v_proj"), quantize_scope="adapted")
    assert comp.base_weight_bytes(inv, w) == 346_194_176 + 14_718_345_216
    assert comp.base_weight_bytes(inv, Workload(method="qlora")) == 5_702_296_448  # scope 'all'


def test_float_weights_are_params_times_bytes():
    inv = _preset("llama-2-7b").inventory
    assert comp.base_weight_bytes(inv, Workload(mode="infer")) == 2 * 6_738_415_616
    assert comp.base_weight_bytes(inv, Workload(recipe="fp32", precision="fp32")) == 4 * 6_738_415_616


# ---------------------------------------------------------------- LoRA

def test_lora_r8_qv_llama2_7b():
    # 32 layers x 2 modules x r*(in + out) = 32 * 2 * 8 * (4096 + 4096) = 4,194,304 (PEFT print_trainable_parameters)
    assert _preset("llama-2-7b").inventory.lora_params(8, ("q_proj", "v_proj")) == 4_194_304


def test_lora_gqa_targets_use_real_shapes():
    # Llama-3.1-8B k_proj is 4096 -> 1024: r=16 -> 32 * 16 * (4096 + 1024) = 2,621,440
    assert _preset("llama-3.1-8b").inventory.lora_params(16, ("k_proj",)) == 2_621_440


def test_lora_bad_target_names_available_modules():
    with pytest.raises(ValueError, match=r"^lora_targets: c_attn match no Linear.*available: .*q_proj"):
        _preset("llama-2-7b").inventory.lora_params(8, ("c_attn",))


# ---------------------------------------------------------------- optimizer states and temporaries

def test_adamw_8bit_states():
    # bitsandbytes blockwise: 2 uint8 states (2*N) + one fp32 absmax per 2048-block each (2 * 4 * 8192):
    # 2 * (16,777,216 + 32,768) = 33,619,968 -> 2.004 bytes/param instead of 8.
    assert comp.optimizer_state_bytes([(1, 4096, 4096)], "adamw-8bit", "fp32") == 33_619_968
    # Tensors under 4096 elements keep 32-bit states: 4095 * 8 = 32,760.
    assert comp.optimizer_state_bytes([(1, 4095, 1)], "adamw-8bit", "fp32") == 32_760


def test_adam_sgd_lion_state_counts():
    shapes = [(3, 10, 20)]  # 3 copies of a 10x20 matrix: 600 elements
    assert comp.optimizer_state_bytes(shapes, "adamw", "fp32") == 600 * 8    # exp_avg + exp_avg_sq
    assert comp.optimizer_state_bytes(shapes, "adamw", "bf16") == 600 * 4    # pure bf16: zeros_like(param)
    assert comp.optimizer_state_bytes(shapes, "sgd-momentum", "fp32") == 600 * 4
    assert comp.optimizer_state_bytes(shapes, "lion", "fp32") == 600 * 4
    assert comp.optimizer_state_bytes(shapes, "sgd", "fp32") == 0


def test_adafactor_factored_states():
    # torch.optim.Adafactor: a 4096 x 11008 matrix keeps a row (4096) and a column (11008) factor:
    # (4096 + 11008) * 4 = 60,416 B instead of 2 * 45M * 4 for Adam. A vector keeps a full second moment.
    assert comp.optimizer_state_bytes([(1, 4096, 11008)], "adafactor", "fp32") == 60_416
    assert comp.optimizer_state_bytes([(1, 4096, 1)], "adafactor", "fp32") == 16_384


def test_step_temporaries_foreach_fused_forloop():
    shapes = [(2, 100, 10), (1, 50, 1)]  # 2 x 1000 + 50 = 2,050 elements
    # foreach: _foreach_sqrt materialises one state-sized tensor per param at once: 2,050 * 4 = 8,200
    assert comp.optimizer_step_temp_bytes(shapes, "adamw", "foreach", "fp32") == 8_200
    # forloop: one param at a time while the previous one's denom is still bound: 2 n_i + n_(i-1) elements at its
    # largest, from the parameters' order (Inventory.forloop_elems); without the order, 3 x the largest bounds it
    assert comp.optimizer_step_temp_bytes(shapes, "adamw", "forloop", "fp32", forloop_elems=2_050) == 8_200
    assert comp.optimizer_step_temp_bytes(shapes, "adamw", "forloop", "fp32") == 12_000
    assert comp.optimizer_step_temp_bytes(shapes, "adamw", "fused", "fp32") == 0
    assert comp.optimizer_step_temp_bytes(shapes, "sgd", "foreach", "fp32") == 0
    assert comp.optimizer_step_temp_bytes(shapes, "adamw", "foreach", "bf16") == 4_100


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "sgd", "lion", "adamw-8bit"])
def test_an_optimizer_swap_keeps_exactly_the_new_optimizers_states(optimizer):
    # The traced AdamW's state category holds its moments and torch's float32 `step` per parameter; the swap scales
    # both, so SGD with momentum (half of AdamW's states) kept 2 bytes per parameter of scaled counters before the
    # counters were part of the ratio (tests/test_exact_random.py found it: 132 B on a 7-layer Llama)
    name = "llama-3.2-1b"
    model = from_hf_config(load_config(name)[1], name)
    w = Workload(optimizer=optimizer, batch=1, seq=512)
    shapes = model.inventory.trainable_shapes(w)
    assert comp.traced_step_counter_bytes(shapes, "adamw") == 4 * sum(c for c, _, _ in shapes) > 0
    states = estimate(model, w).stage("optimizer").optimizer_states
    assert states == comp.optimizer_state_bytes(shapes, optimizer, "bf16")


def test_unknown_optimizer_names_field():
    with pytest.raises(ValueError, match="^optimizer:"):
        comp.optimizer_state_bytes([(1, 2, 2)], "adagrad", "fp32")


def test_recipe_dtypes_bytes_per_param():
    # weights + grads + states (+ master), bytes per trainable param with AdamW
    def per_param(recipe, precision):
        rd = comp.recipe_dtypes(Workload(recipe=recipe, precision=precision))
        return (dtype_bytes(rd.weight) + dtype_bytes(rd.grad) + 2 * dtype_bytes(rd.state)
                + comp.master_weight_bytes(1, recipe))
    assert per_param("pure", "bf16") == 2 + 2 + 4 == 8
    assert per_param("amp", "bf16") == 4 + 4 + 8 == 16
    assert per_param("mixed", "bf16") == 2 + 2 + 8 + 4 == 16
    assert per_param("fp32", "fp32") == 16


# ---------------------------------------------------------------- KV cache (from the traced profile)

def _kv(name: str, batch: int, seq: int, kv_dtype: str = "auto") -> int:
    """The KV cache at the prefill's peak, in the last layer once its keys and values are cached: batch x seq
    tokens. (Decoding also holds the previous keys of one layer while torch.cat copies them: not counted here.)"""
    e = estimate(_preset(name), Workload(mode="infer", batch=batch, seq=seq, kv_dtype=kv_dtype))
    return e.stage("prefill").kv_cache


def test_kv_cache_gqa_vs_mha():
    # Llama-2-7B (MHA): 2 * 32 layers * 32 KV heads * 128 * 2 B = 524,288 B per token.
    assert _kv("llama-2-7b", 1, 1024) == 1024 * 524_288
    # Llama-3.1-8B (GQA, 8 KV heads): 2 * 32 * 8 * 128 * 2 = 131,072 -- 4x less than hidden_size suggests.
    # batch 4 x 2048 tokens: 4 * 2048 * 131,072 = 1 GiB exactly; fp8 halves it.
    assert _kv("llama-3.1-8b", 4, 2048) == 2**30
    assert _kv("llama-3.1-8b", 4, 2048, "fp8") == 2**29


def test_kv_cache_mqa_falcon():
    # Falcon-7B multi-query: 1 KV head of 64 over 32 layers: 2 * 32 * 1 * 64 * 2 = 8,192 B per token.
    assert _kv("falcon-7b", 1, 512) == 512 * 8_192


def test_kv_cache_mla_deepseek_v2_lite_is_what_transformers_caches():
    # transformers 5.23's DeepseekV2Attention caches MLA's compressed latent (kv_lora_rank 512) and the decoupled
    # RoPE key (64) per layer, as vLLM/SGLang do: 27 layers * (512 + 64) * 2 B = 31,104 B per token, where the
    # expanded per-head K/V would be 27 * 16 * (192 + 128) * 2 = 276,480 (the profile reads this from the code).
    assert _kv("deepseek-v2-lite", 1, 256) == 256 * 31_104


# ---------------------------------------------------------------- overhead

def test_overhead_bytes():
    # 500 MiB context + 32 MiB cuBLAS workspace; + 512 MiB NCCL with more than one GPU
    assert comp.overhead_bytes(1) == 532 * MiB
    assert comp.overhead_bytes(8) == 1044 * MiB
    with pytest.raises(ValueError, match="^cuda_context_bytes:"):
        comp.Overhead(cuda_context_bytes=-1)


def test_cublas_workspaces_per_stage():
    # one workspace per (thread's handle, stream): none before a matmul, one in inference, two in training (autograd's
    # device thread has its own handle); measured on an H200, docs/measuring.md
    assert [comp.cublas_workspaces("train", s) for s in ("load", "forward", "backward", "optimizer")] == [0, 2, 2, 2]
    assert [comp.cublas_workspaces("infer", s) for s in ("load", "prefill", "decode")] == [0, 1, 1]
    assert comp.overhead_bytes(1, workspaces=2) == 564 * MiB
    name, cfg = load_config("llama-3.2-1b")
    model = from_hf_config(cfg, name)
    for w in (Workload(batch=2, seq=512), Workload(mode="infer", batch=2, seq=512, gen_tokens=2)):
        est = estimate(model, w)
        for stage, b in est.stages:
            n = comp.cublas_workspaces(w.mode, stage)
            assert est.allocated_at(stage) - b.tensor_bytes == est.workspace_at(stage) == n * 32 * MiB, (w, stage)
            assert b.overhead == comp.Overhead().cuda_context_bytes + n * 32 * MiB, (w, stage)
        assert est.allocator_overhead_bytes == est.workspace_at(est.peak_stage) > 0


def test_dtype_bytes_unknown():
    with pytest.raises(ValueError, match="^dtype:"):
        dtype_bytes("int4")


@pytest.mark.parametrize("workload", [Workload(batch=1, seq=512), Workload(method="lora", batch=1, seq=512),
                                      Workload(optimizer="adamw-8bit", batch=1, seq=512),
                                      Workload(method="qlora", batch=1, seq=512)])
def test_model_states_priced_at_once_are_the_estimates(workload):
    """What the app shows before a profile exists (components.model_state_bytes, the inventory alone) is what the
    traced estimate holds at its optimizer step, but for the step counters torch keeps beside each state (a few
    bytes per parameter tensor)."""
    from estimator.components import model_state_bytes
    from estimator.estimate import Options, estimate
    from estimator.model import from_hf_config
    from estimator.presets import load_config

    model = from_hf_config(load_config("llama-3.1-8b")[1], "llama-3.1-8b", derive=False)
    got = model_state_bytes(model.inventory, workload)
    at_step = estimate(model, workload, options=Options(derive=False)).stage("optimizer")
    for name, b in got.items():
        assert b <= getattr(at_step, name) <= b + 8 * 1024, (name, b, getattr(at_step, name))


def test_forloop_adam_peak_follows_the_parameter_order():
    # torch's _single_tensor_adam: denom = (exp_avg_sq.sqrt() / c).add_(eps) allocates two tensors the size of
    # parameter i while parameter i-1's denom is still bound. llama-3.2-1b's first parameter is the (tied) embedding,
    # the largest: 2 x 128256 x 2048 elements, nothing before it.
    from strategies import model

    m = model("llama-3.2-1b")
    assert m.inventory.forloop_elems(Workload()) == 2 * 128256 * 2048
    # LoRA on q_proj, v_proj: A_q (r x 2048), B_q (2048 x r), A_v (r x 2048), B_v (512 x r) per layer, in module
    # order: the largest 2 n_i + n_(i-1) is 2 x 2048r + 2048r
    for r in (1, 8, 64):
        w = Workload(method="lora", lora_rank=r, lora_targets=("v_proj", "q_proj"))
        assert m.inventory.forloop_elems(w) == 3 * 2048 * r
    assert m.inventory.forloop_elems(Workload(mode="infer")) == 0


def test_gpu_rows_pin_the_cublas_workspaces():
    # GPU truth (data/measured/: H100 and H200 rows of two small models, pure bf16, one GPU, no OOM): with none at
    # load, one workspace in inference and two in training, no measured stage after load is below its estimate, and
    # the closest of each kind is within 1 MiB of it; one workspace more or less would move that gap by 32 MiB
    import json
    from pathlib import Path

    from bench.accuracy.measured import stage_gaps
    from bench.accuracy.report import row_estimate

    models, gaps = {}, {}
    for f in sorted((Path(__file__).resolve().parents[1] / "data" / "measured").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r["model_name"] not in ("qwen2.5-0.5b", "llama-3.2-1b") or r["oom"] or r["strategy"] != "single" \
                    or r["recipe"] != "pure":
                continue
            if r["model_name"] not in models:
                models[r["model_name"]] = from_hf_config(load_config(r["model_name"])[1], r["model_name"])
            for stage, gap in stage_gaps(r, row_estimate(r, models[r["model_name"]])).items():
                if stage != "load":
                    gaps.setdefault((r["mode"], stage), []).append(gap)
    assert {k for k, v in gaps.items() if len(v) >= 30} == {("train", "forward"), ("train", "backward"),
                                                             ("train", "optimizer"), ("infer", "prefill"),
                                                             ("infer", "decode")}
    for key, g in gaps.items():
        assert 0 <= min(g) <= MiB, (key, min(g))
