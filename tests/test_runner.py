"""tracer.runner on real (tiny) CPU tensors: model building, optimizers, inputs and the stage sequence."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tracer import runner
from estimator.spec import Workload

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "max_position_embeddings": 128, "tie_word_embeddings": True}


def stages_of(workload: Workload, steps: int = 2) -> tuple[list[str], dict]:
    model = runner.build_model(TINY, workload)
    optimizer = runner.make_optimizer(model, workload)
    inputs = runner.make_inputs(TINY, workload, "cpu")
    seen, live = [], {}
    runner.run_stages(model, optimizer, workload, inputs, seen.append, steps=steps, live=live)
    return seen, live


@pytest.mark.parametrize("recipe, precision, weights", [
    ("pure", "bf16", torch.bfloat16), ("amp", "bf16", torch.float32), ("mixed", "fp16", torch.float16),
    ("fp32", "fp32", torch.float32),
])
def test_recipe_sets_weight_dtype(recipe, precision, weights):
    model = runner.build_model(TINY, Workload(recipe=recipe, precision=precision))
    assert {p.dtype for p in model.parameters()} == {weights}
    assert torch.get_default_dtype() == torch.float32  # restored after building


def test_meta_then_empty_keeps_embeddings_tied():
    model = runner.build_model(TINY, Workload(), meta_then_empty=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_lora_freezes_base_and_keeps_fp32_adapters():
    model = runner.build_model(TINY, Workload(method="lora", lora_rank=2))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable)
    assert sum(p.numel() for _, p in trainable) == model.get_nb_trainable_parameters()[0]


def test_attention_and_checkpointing_settings():
    assert runner.attn_implementation(Workload(attention="flash"), "cpu") == "sdpa"
    assert runner.attn_implementation(Workload(attention="eager"), "cpu") == "eager"
    model = runner.build_model(TINY, Workload(checkpointing="selective", attention="eager"))
    assert model.config._attn_implementation == "willitfit_selective_eager"
    model = runner.build_model(TINY, Workload(checkpointing="full"))
    assert model.is_activation_checkpointing


@pytest.mark.parametrize("config, attention", [
    (TINY, "eager"), (TINY, "sdpa"),
    # a sliding window shorter than the sequence: SDPA needs its mask
    ({**TINY, "model_type": "mistral", "sliding_window": 8}, "sdpa"),
])
def test_selective_checkpointing_computes_what_the_model_computes(config, attention):
    """Checkpointing changes when tensors live, never the function: the wrapped attention gets the mask the model's
    own attention gets (transformers makes none for an attention name it has no mask function for; eager attention
    ran unmasked, a window was not applied, and the step left the mask's bytes out, until 2026-11-28)."""
    ids = torch.randint(0, TINY["vocab_size"], (2, 32))
    out = {}
    for ckpt in ("none", "selective"):
        model = runner.build_model(config, Workload(checkpointing=ckpt, attention=attention, recipe="fp32",
                                                    precision="fp32"), seed=0)
        model.eval()   # no dropout
        with torch.no_grad():
            out[ckpt] = model(input_ids=ids).logits
    torch.testing.assert_close(out["selective"], out["none"])


@pytest.mark.parametrize("impl, flags", [("foreach", {"foreach": True}), ("forloop", {"foreach": False}),
                                         ("fused", {"fused": True})])
def test_optimizer_impl_flags(impl, flags):
    model = runner.build_model(TINY, Workload(optimizer_impl=impl))
    group = runner.make_optimizer(model, Workload(optimizer_impl=impl)).param_groups[0]
    assert all(group[k] == v for k, v in flags.items())


@pytest.mark.parametrize("workload, message", [
    (Workload(optimizer="lion"), "^optimizer: lion is not available in torch"),
    (Workload(optimizer="adafactor", optimizer_impl="fused"), "^optimizer_impl: torch has no fused adafactor"),
])
def test_optimizer_errors(workload, message):
    model = runner.build_model(TINY, Workload())
    with pytest.raises(ValueError, match=message):
        runner.make_optimizer(model, workload)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_adamw_8bit_needs_bitsandbytes():
    model = runner.build_model(TINY, Workload())
    with pytest.raises(ValueError, match="^optimizer: adamw-8bit needs bitsandbytes"):
        runner.make_optimizer(model, Workload(optimizer="adamw-8bit"))


@pytest.mark.parametrize("config, message", [
    ({"hidden_size": 8}, "^model_type: missing"),
    ({"model_type": "no-such-model"}, "^model_type: transformers .* does not know 'no-such-model'"),
    ({**TINY, "num_key_value_heads": "two"}, "^model_type: transformers cannot build"),
    ({"model_type": "my_arch", "auto_map": {"AutoModelForCausalLM": "x.Y"}}, "^model_type: .* remote code"),
])
def test_bad_configs_raise_value_error(config, message):
    with pytest.raises(ValueError, match=message):
        runner.build_model(config, Workload())


def test_qlora_and_quantized_weights_are_refused():
    with pytest.raises(ValueError, match="^method: qlora"):
        runner.build_model(TINY, Workload(method="qlora"))
    with pytest.raises(ValueError, match="^weight_format: 'int8'"):
        runner.weight_dtype(Workload(mode="infer", weight_format="int8"))


def test_inputs_have_batch_by_seq_shape():
    inputs = runner.make_inputs(TINY, Workload(batch=3, seq=5), "cpu")
    assert inputs["input_ids"].shape == (3, 5) and torch.equal(inputs["labels"], inputs["input_ids"])
    assert set(runner.make_inputs(TINY, Workload(mode="infer", batch=3, seq=5), "cpu")) == {"input_ids"}


def test_training_stage_sequence_with_accumulation():
    seen, _ = stages_of(Workload(batch=1, seq=4, grad_accum=2), steps=2)
    assert seen == ["forward", "backward", "forward", "backward", "optimizer"] * 2


def test_inference_prefill_then_one_decode_per_token():
    seen, live = stages_of(Workload(mode="infer", batch=2, seq=6, gen_tokens=3))
    assert seen == ["prefill", "decode", "decode", "decode"]
    cache = live["kv_cache"]
    assert cache.get_seq_length() == 6 + 3                    # the real HF DynamicCache grew per token
    assert all(t.shape[2] == 9 for t in runner.kv_cache_tensors(cache))


def test_mixed_recipe_steps_fp32_masters_and_copies_back():
    workload = Workload(recipe="mixed", precision="bf16", batch=1, seq=4)
    model = runner.build_model(TINY, workload)
    optimizer = runner.make_optimizer(model, workload)
    before = [p.detach().clone() for p in optimizer.params]
    runner.run_stages(model, optimizer, workload, runner.make_inputs(TINY, workload, "cpu"), lambda s: None, steps=1)
    assert all(m.dtype == torch.float32 and m.grad is None for m in optimizer.master_params)
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(optimizer.params, optimizer.master_params))
    assert any(not torch.equal(b, p) for b, p in zip(before, optimizer.params))
    assert all(p.grad is None for p in model.parameters())


def test_building_the_hf_config_leaves_the_callers_config_untouched():
    """transformers edits nested dicts in place (rope_scaling gains rope_theta); the runner must hand it a copy,
    or a row's config_hash would differ from the run_id computed before the run and resume would never match."""
    import copy

    from tracer import runner
    from bench.store.rows import config_hash
    from estimator.presets import load_config

    _, cfg = load_config("llama-3.2-1b")
    before = copy.deepcopy(cfg)
    runner._hf_config(cfg)
    assert cfg == before and config_hash(cfg) == config_hash(before)


def test_selective_checkpointing_of_a_model_with_its_own_attention_table_is_refused_in_one_line():
    # Falcon picks its attention class from FALCON_ATTENTION_CLASSES, never transformers' AttentionInterface, where
    # selective checkpointing registers its wrapped attention: one line naming the field, not a KeyError
    import json
    from pathlib import Path

    cfg = json.loads((Path(__file__).parent / "data" / "tiny" / "t-falcon.json").read_text())
    with pytest.raises(ValueError, match=r"^checkpointing: selective checkpointing wraps transformers' attention "
                                         r"interface, which falcon's attention does not call .*; use none, full or "
                                         r"op-sac$"):
        runner.build_model(cfg, Workload(checkpointing="selective"), meta_then_empty=True)
    runner.build_model(cfg, Workload(checkpointing="full"), meta_then_empty=True)   # the others build
