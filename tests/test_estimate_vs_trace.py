"""estimate() against the traced tier, family by family: every stage's tensor bytes equal a traced run, to the byte.

Each case traces a tiny config with its family's real module structure (tests/data/tiny, 3 layers of hidden
size 128) on fake CPU tensors running CUDA's kernels (bench.trace.cases.trace_case: every live storage counted
exactly), and asserts that `estimator.estimate` (its profile derived at other sizes by the tracer, evaluated
at batch 2, seq 64) gives each stage's peak tensor bytes (`Breakdown.tensor_bytes`: no allocator cache, no
CUDA overhead) equal to the traced stage peak: load, forward, backward and optimizer in training, load,
prefill and decode in inference. The cases cover the eleven families' full fine-tuning, LoRA, amp, fp32,
eager/SDPA attention, checkpointing, dropout, and CUDA-only kernel choices (memory-efficient SDPA for unequal
head dims, autocast's fp32 lists).

    python -m pytest tests/test_estimate_vs_trace.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.trace.cases import trace_case  # noqa: E402
from estimator.estimate import estimate  # noqa: E402
from estimator.model import from_hf_config  # noqa: E402
from estimator.spec import Workload  # noqa: E402

TINY = Path(__file__).parent / "data" / "tiny"
NO_DROPOUT = {"gpt2": dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
              "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "opt": dict(dropout=0.0)}
B, S = 2, 64
# Routed experts: how many tokens each expert receives depends on the router's draw, so the few bytes of
# per-expert bookkeeping (index tensors, rounding of each expert's share) differ between two runs; the rest is exact.
MOE_TOLERANCE = 1e-4
MOE = ("mixtral", "qwen2_moe", "deepseek_v3")


def _config(family: str, **overrides) -> dict:
    cfg = json.loads((TINY / f"t-{family}.json").read_text())
    cfg.update(NO_DROPOUT.get(family, {}))
    cfg.update(overrides)
    return cfg


def case(family, *, config=None, slow=True, **workload):
    """One case; slow=True puts it in the slow tier (WILLITFIT_SLOW=1, tests/conftest.py): each case derives a
    profile, about 10 s of CPU, so the default run keeps one or two per family and the full set runs on demand."""
    label = family + "-" + "-".join(f"{v}" for v in workload.values() if not isinstance(v, tuple))
    return pytest.param(config or _config(family), workload, id=label, marks=[pytest.mark.slow] if slow else [])


LORA_QV = ("q_proj", "v_proj")
CASES = [
    # Llama-like
    case("llama", method="full", recipe="pure", attention="sdpa", slow=False),
    # forloop AdamW: traced as foreach, its step's temporaries from the parameter order (Inventory.forloop_elems)
    case("llama", method="full", recipe="pure", attention="sdpa", optimizer_impl="forloop", slow=False),
    case("gpt2", method="lora", recipe="pure", attention="sdpa", optimizer="adam", optimizer_impl="forloop",
         lora_targets=("c_fc", "c_attn")),
    case("llama", method="lora", recipe="amp", attention="eager", lora_targets=LORA_QV),
    case("llama", method="full", recipe="pure", attention="eager", checkpointing="selective"),
    case("llama", method="lora", recipe="pure", attention="sdpa", checkpointing="full", lora_targets=LORA_QV),
    case("llama", method="full", recipe="fp32", precision="fp32", attention="sdpa"),
    case("llama", mode="infer", attention="eager", gen_tokens=3, slow=False),
    case("qwen3", config=_config("llama", model_type="qwen3", head_dim=32), method="full", recipe="amp",
         attention="sdpa"),
    case("gemma2", method="full", recipe="pure", attention="eager"),
    case("gemma2", method="lora", recipe="amp", attention="eager", lora_targets=LORA_QV, slow=False),
    case("gemma2", mode="infer", attention="eager", gen_tokens=3),
    case("phi3", method="full", recipe="pure", attention="sdpa"),
    case("phi3", method="lora", recipe="amp", attention="eager", checkpointing="selective", lora_targets=("qkv_proj",), slow=False),
    # MoE: router + grouped_mm experts
    case("mixtral", method="full", recipe="pure", attention="sdpa", slow=False),
    case("mixtral", method="lora", recipe="pure", attention="eager", lora_targets=LORA_QV),
    case("mixtral", mode="infer", attention="eager", gen_tokens=3),
    case("qwenmoe", method="full", recipe="pure", attention="eager"),
    case("qwenmoe", mode="infer", attention="sdpa", gen_tokens=3, slow=False),
    # GPT-NeoX, Falcon (multi-query: the math SDPA kernel on every device), OPT, GPT-2, BERT, DeepSeek MLA
    case("neox", method="full", recipe="amp", attention="sdpa", slow=False),
    case("neox", method="lora", recipe="pure", attention="eager", lora_targets=("query_key_value",)),
    case("neox", mode="infer", attention="sdpa", gen_tokens=3),
    case("falcon", method="full", recipe="pure", attention="sdpa", slow=False),
    case("falcon", method="lora", recipe="amp", attention="eager", lora_targets=("query_key_value",)),
    case("falcon", mode="infer", attention="sdpa", gen_tokens=3),
    case("opt", method="full", recipe="pure", attention="eager"),
    case("opt", method="lora", recipe="amp", attention="sdpa", lora_targets=LORA_QV, slow=False),
    case("gpt2", method="full", recipe="pure", attention="sdpa"),
    case("gpt2", method="lora", recipe="pure", attention="eager", lora_targets=("c_attn",)),
    case("gpt2", mode="infer", attention="eager", gen_tokens=3),
    case("bert", method="full", recipe="pure", attention="sdpa"),
    case("bert", method="lora", recipe="amp", attention="sdpa", lora_targets=("query", "value"), slow=False),
    case("bert", mode="infer", attention="eager"),
    case("dsv3", method="full", recipe="pure", attention="eager", slow=False),
    case("dsv3", method="lora", recipe="pure", attention="eager", lora_targets=("q_b_proj", "kv_b_proj")),
    case("dsv3", mode="infer", attention="eager", gen_tokens=3),
    # CUDA's kernels, not the CPU's: flash applies attention dropout in-kernel, native_dropout's 1-byte masks,
    # autocast's fp32 lists (gelu_new's pow, softmax, layer_norm), memory-efficient SDPA for unequal head dims
    case("gpt2-dropout", config=json.loads((TINY / "t-gpt2.json").read_text()), method="full", recipe="pure",
         attention="sdpa"),
    case("opt-dropout", config=json.loads((TINY / "t-opt.json").read_text()), method="full", recipe="pure",
         attention="sdpa"),
    case("gpt2", method="full", recipe="amp", attention="sdpa", slow=False),
    case("bert", method="full", recipe="amp", attention="eager"),
    case("dsv3", method="full", recipe="pure", attention="sdpa"),
]


@pytest.mark.parametrize("config, workload", CASES)
def test_stage_peaks_equal_the_trace(config, workload):
    w = Workload(batch=B, seq=S, **workload)
    row = trace_case(config, "tiny", w)
    est = estimate(from_hf_config(config, "tiny"), w)
    assert not est.notes, est.notes                 # nothing priced analytically: all of it is the profile
    stages = ("load", "forward", "backward", "optimizer") if w.mode == "train" else \
        ("load", "prefill") + (("decode",) if w.gen_tokens else ())
    got = {name: b.tensor_bytes for name, b in est.stages if name in stages}
    traced = {name: row[f"{name}_peak_alloc_bytes"] for name in stages}
    assert set(got) == set(stages) and all(traced.values()), (got, traced)
    if config["model_type"] in MOE:
        assert all(abs(got[k] - traced[k]) <= MOE_TOLERANCE * traced[k] for k in stages), (got, traced)
    else:
        assert got == traced
