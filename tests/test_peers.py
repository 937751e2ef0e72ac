"""Peer estimators (offline/peers.py): each rule against a number worked by hand from its source.

Sources: /work/shared/seeds/000..003, huggingface/accelerate src/accelerate/commands/estimate.py,
deepspeedai/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, arXiv 2205.05198 Table 2,
tvosch/VRAM-estimator vram_estimator.py and its README.
"""
from __future__ import annotations

import pytest

from offline import peers
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.spec import Parallel, Workload

P7B = 7_000_000_000

def test_seed000_training_7b_fp16():
    # will_it_fit(7, "fp16") with its defaults batch 1, seq 2048, hidden 4096, layers 32:
    # params 7e9 * 2 = 14e9; Adam "3 FP32 copies" 7e9 * 12 = 84e9; grads 14e9;
    # activations 12 * 4096 * 2048 * 32 * 2 * 1 = 6,442,450,944  -> total 118,442,450,944 B
    assert peers.seed000_will_it_fit_bytes(P7B, "fp16") == 14e9 + 84e9 + 14e9 + 6_442_450_944
    # SGD keeps one fp32 copy (7e9 * 4), and an optimizer the seed has no branch for gets nothing
    assert peers.seed000_will_it_fit_bytes(P7B, "fp16", optimizer="sgd") == 14e9 + 28e9 + 14e9 + 6_442_450_944
    assert peers.seed000_will_it_fit_bytes(P7B, "fp16", optimizer="lion") == 14e9 + 14e9 + 6_442_450_944

def test_seed000_inference_kv_is_mha():
    # inference, batch 8, seq 2048: weights 14e9 + KV 2 * 32 layers * (4096 // 128 = 32 heads) * 128 * 2 B
    # = 524,288 B per token (the seed's own figure, line 155) * 8 * 2048 = 8,589,934,592 B
    assert peers.seed000_will_it_fit_bytes(P7B, "fp16", training=False, batch_size=8) == 14e9 + 8_589_934_592
    # int4: bpp 0.5 for weights and cache alike: 3.5e9 + 131,072 * 2048
    assert peers.seed000_will_it_fit_bytes(P7B, "int4", training=False) == 3.5e9 + 131_072 * 2048

def test_seed002_training_and_its_wrong_example():
    # (14 + 14 + 56 + 1.5 * 14 = 21) GB * 1.15 = 120.75 GB; the post prints "~73.6 GB" beside it
    assert peers.seed002_training_bytes(P7B) == 120_750_000_000
    # SGD: (14 + 14 + 28 + 21) * 1.15 = 88.55 GB
    assert peers.seed002_training_bytes(P7B, 2, "sgd") == 88_550_000_000

def test_seed003_inference():
    # (7e9 * 2) * 1.2 = 16.8e9; int4: 7e9 * 0.5 * 1.2 = 4.2e9
    assert peers.seed003_inference_bytes(P7B, "fp16") == 16_800_000_000
    assert peers.seed003_inference_bytes(P7B, "int4") == 4_200_000_000

def test_accelerate_max_not_sum():
    # fp32 size S = 4 * 7e9 = 28e9. Total Size: float32 S, float16 S/2, int8 S/4, int4 S/8.
    assert peers.accelerate_estimate_memory_bytes(P7B, "float32") == 28e9
    assert peers.accelerate_estimate_memory_bytes(P7B, "int4") == 3.5e9
    # Training using Adam: float32 max(S, S, 2S, 4S) = 4S = 112e9; float16 max(S, 1.5S, 2S, 2S) = 2S = 56e9,
    # i.e. 4x the float16 size. The sum would have been 8S / 6.5S. (The Space's Baichuan-7B table shows the
    # same 4x: 26.2 GB -> 104.82 GB, 13.1 GB -> 52.41 GB.)
    assert peers.accelerate_estimate_memory_bytes(P7B, "float32", training=True) == 112e9
    assert peers.accelerate_estimate_memory_bytes(P7B, "float16", training=True) == 56e9
    assert peers.accelerate_estimate_memory_bytes(P7B, "int8", training=True) == -1  # "N/A"

def test_deepspeed_zero2_and_zero3_no_offload():
    # ZeRO-2: 2 * P + int(18 * P / gpus). P = 1e9: one GPU 20e9, four GPUs 2e9 + 4.5e9 = 6.5e9
    assert peers.deepspeed_zero2_model_states_bytes(10**9) == 20 * 10**9
    assert peers.deepspeed_zero2_model_states_bytes(10**9, num_gpus_per_node=4) == 6_500_000_000
    assert peers.deepspeed_zero2_model_states_bytes(10**9, num_gpus_per_node=2, num_nodes=2) == 6_500_000_000
    # ZeRO-3: 4 * largest layer + int(18 * P / gpus). P = 1e9, largest 1e8, 8 GPUs: 4e8 + 2.25e9
    assert peers.deepspeed_zero3_model_states_bytes(10**9, 10**8, num_gpus_per_node=8) == 2_650_000_000

def test_korthikanti_table2_gpt3():
    # GPT-3 175B (paper sec. 4): s 2048, b 1, h 12288, a 96, per layer s*b*h*(34 + 5*a*s/h)
    # = 25,165,824 * (34 + 80) = 2,868,903,936 B; times 96 layers
    per_layer = 2048 * 12288 * (34 + 5 * 96 * 2048 // 12288)
    assert per_layer == 2_868_903_936
    assert peers.korthikanti_activation_bytes(2048, 1, 12288, 96, 96) == 96 * per_layer

def test_vram_estimator_reproduces_its_readme_tinyllama():
    # README: TinyLlama-1.1B, micro batch 1, 1 GPU, ZeRO 0 -> "34.3 GB". The tool's own parameter count rounds
    # to 1.17e9 (vram_estimator.py get_model_size_from_autoconfig); seq = max_position_embeddings = 2048,
    # h 2048, 22 layers, 32 heads, AdamW. States: 1.17e9 * (2 + 4 + 2*4) = 16.38e9. Activations:
    # 22 * 2048 * 1 * 2048 * (34 + 5 * 32 * 2048 / 2048) = 22 * 813,694,976 = 17,901,289,472 -> 34.28 GB
    got = peers.vram_estimator_training_bytes(1_170_000_000, 2048, 1, 2048, 32, 22)
    assert got == 16_380_000_000 + 17_901_289_472
    assert round(got / 1e9, 1) == 34.3
    # mixed precision weights 6 B; ZeRO-3 over 4 GPUs divides all three model-state terms
    mixed = peers.vram_estimator_training_bytes(10**9, 1, 1, 1, 1, 1, mixed_precision=True, zero_stage=3, num_gpus=4)
    assert mixed == round((6 + 4 + 8) * 10**9 / 4 + (34 + 5))

@pytest.fixture(scope="module")
def llama7b():
    return from_hf_config(load_config("llama-2-7b")[1], "llama-2-7b")

def test_peer_predictions_apply_each_rule_as_its_user_would(llama7b):
    m = llama7b
    train = dict(peers.peer_predictions(m, Workload(batch=4, seq=512)))
    assert list(train) == ["seed000", "seed002", "accelerate", "deepspeed-zero2", "deepspeed-zero3", "korthikanti"]
    assert train["seed000"] == peers.seed000_will_it_fit_bytes(m.params, "bf16", True, "adam", 4, 512, 4096, 32)
    assert train["accelerate"] == 8 * m.params  # bf16 -> "float16": 2 x the fp32 size
    assert train["deepspeed-zero2"] == 20 * m.params
    # LoRA: none of the rules knows it; the user reads the full fine-tuning number
    lora = dict(peers.peer_predictions(m, Workload(batch=4, seq=512, method="lora")))
    assert lora == train
    infer = dict(peers.peer_predictions(m, Workload(mode="infer", batch=2, seq=1000, gen_tokens=24)))
    assert list(infer) == ["seed000", "seed003", "accelerate"]
    assert infer["seed000"] == peers.seed000_will_it_fit_bytes(m.params, "bf16", False, "adam", 2, 1024, 4096, 32)
    assert infer["accelerate"] == 2 * m.params

def test_peers_with_a_gpu_count_get_the_shard_group(llama7b):
    m, w = llama7b, Workload(batch=1, seq=512)
    fsdp = dict(peers.peer_predictions(m, w, Parallel(strategy="fsdp", gpus=8)))
    single = dict(peers.peer_predictions(m, w))
    assert fsdp["deepspeed-zero3"] == 4 * peers.largest_module_params(m) + int(18 * m.params / 8)
    assert fsdp["seed000"] == single["seed000"]  # no notion of parallelism: the whole-model number
    assert fsdp["korthikanti"] < single["korthikanti"]
    # the largest module of Llama-2-7B is the 32000 x 4096 embedding (or lm_head)
    assert peers.largest_module_params(m) == 32000 * 4096

def test_rules_that_do_not_cover_a_workload_say_nothing(llama7b):
    lion = dict(peers.peer_predictions(llama7b, Workload(optimizer="lion")))
    assert lion == {}  # no rule has a constant for Lion's states (seed 000 would silently count none)
    gguf = dict(peers.peer_predictions(llama7b, Workload(mode="infer", weight_format="gguf-q4_k_m")))
    assert gguf == {}
    nf4 = dict(peers.peer_predictions(llama7b, Workload(mode="infer", weight_format="nf4", seq=128)))
    assert nf4["seed003"] == round(llama7b.params * 0.5 * 1.2)  # int4 row of seed 003's table
    assert nf4["accelerate"] == 4 * llama7b.params // 8
