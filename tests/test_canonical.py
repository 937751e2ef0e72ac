"""One profile per workload class, exactly: `estimator.store.canonical_class` folds the knobs that do not apply to a
workload (an inference run's optimizer, a full fine-tune's LoRA rank) and every grad_accum >= 2 into one class, used
for the profile's key and its derivation alike. These tests check that the folding is what the tracer does: a trace
with the folded knobs set equals one without, byte for byte, and grad_accum 3, 4 and 7 trace like 2.

    python -m pytest tests/test_canonical.py -q
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from estimator import knobs, store
from estimator.estimate import Options, estimate, traced_class
from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.profile.profile import RANK_MARK
from estimator.spec import Parallel, Workload

TINY = Path(__file__).parent / "data" / "tiny"
TRAIN_STAGES = ("load", "forward", "backward", "optimizer")


def _alternatives(d: knobs.Declared) -> list:
    """Every other value a field could take (a few for integers and module lists)."""
    if d.kind == "bool":
        return [not d.default]
    if d.kind == "int":
        return [v for v in (d.default + 1, 3, 7, 64) if v != d.default and d.knob.lo <= v <= d.knob.hi]
    if d.kind == "multi":
        return [("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj",)]
    return [c for c in d.knob.choices if c != d.default]


BASES = [Workload(mode="infer"), Workload(), Workload(method="lora"), Workload(method="qlora"),
         Workload(recipe="amp", checkpointing="full", grad_accum=2)]


@pytest.mark.parametrize("base", BASES, ids=lambda w: f"{w.mode}-{w.method}-{w.recipe}")
def test_a_knob_splits_the_class_exactly_when_it_applies(base):
    # Each field changed alone to each value the workload allows: a field that does not apply (Knob.applies) leaves
    # the canonical class and the profile key as they were; one that applies changes both (grad_accum past 2 and
    # weight_format, which a full fine-tune's runner honours, are the stated exceptions; double_quant is QLoRA's).
    key = store.profile_key(base, Parallel())
    seen = 0
    for d in knobs.declared():
        if d.name in knobs.SIZE_FIELDS or d.name == "mode":
            continue
        for v in _alternatives(d):
            if v == getattr(base, d.name):
                continue
            try:
                w = replace(base, **{d.name: v})
            except ValueError:
                continue  # not a workload this base allows
            seen += 1
            applies = knobs.applies(d, w.mode, w.method)
            if d.name in ("images", "audios", "audio_seconds"):
                applies = True  # whether a model takes images (audio) is the model's: every class keeps them
            if d.name == "target_seq":
                applies = w.mode == "train"   # an encoder-decoder model's decoder length: every training class
            if d.name == "double_quant":
                applies = w.method == "qlora"
            if d.name == "weight_format":
                applies = True  # kept in every class: a full fine-tune's runner stores its weights in it
            expect_same = not applies or (d.name == "grad_accum" and min(v, 2) == min(base.grad_accum, 2))
            assert (store.canonical_class(w) == store.canonical_class(base)) == expect_same, (d.name, v)
            # LoRA's rank is a variable of its profile: another rank is the same file (the per-rank key, which a
            # lookup tries second, still tells ranks apart: tests/test_lora_rank.py)
            same_file = expect_same or (d.name == "lora_rank" and store.is_rank_variable(w))
            assert (store.profile_key(w, Parallel()) == key) == same_file, (d.name, v)
            if d.name == "lora_rank" and store.is_rank_variable(w):
                assert store.profile_keys(w, Parallel())[1] != store.profile_keys(base, Parallel())[1]
    assert seen > 20


def test_irrelevant_knobs_share_one_class_and_one_traced_stand_in():
    infer = Workload(mode="infer", batch=4, seq=512)
    noisy = replace(infer, optimizer="sgd", recipe="amp", optimizer_impl="fused", lora_rank=64, double_quant=False)
    assert store.canonical_class(noisy) == infer
    assert traced_class(noisy, Parallel()) == traced_class(infer, Parallel())   # no note about the optimizer either
    full = Workload()
    assert store.canonical_class(replace(full, lora_rank=64, lora_targets=("q_proj",), kv_dtype="fp8")) == full
    lora = Workload(method="lora")
    assert store.canonical_class(replace(lora, double_quant=False)) == lora
    assert store.canonical_class(replace(lora, lora_rank=64)) != lora
    for ga in (3, 4, 7, 1000):
        assert store.canonical_class(replace(full, grad_accum=ga)) == replace(full, grad_accum=2)
    assert store.canonical_class(replace(full, grad_accum=2)) != full


def test_traced_stand_ins_are_canonical():
    # what traced_class hands the store is already its own canonical class: the key and the derivation agree
    for w in (Workload(mode="infer", optimizer="lion", recipe="mixed"), Workload(method="qlora", double_quant=False),
              Workload(optimizer="adamw-8bit", grad_accum=5), Workload(kv_dtype="int8", lora_rank=32)):
        tw, _, _ = traced_class(w, Parallel())
        assert store.canonical_class(tw) == tw


def test_every_shipped_profile_is_reachable_by_its_own_class():
    # A shipped file is found by the key its stored class maps to: no key change strands one.
    files = [f for f in sorted(store.SHIPPED_DIR.glob("*/*.json")) if f.name != "inventory.json"]
    assert len(files) > 100
    for f in files:
        data = json.loads(f.read_text())
        rank_free = data["workload_class"].get("lora_rank") == RANK_MARK   # one file for every LoRA rank
        w = knobs.workload_from_row({**data["workload_class"], **({"lora_rank": 8} if rank_free else {})})
        pc = data["parallel_class"]
        wrap = {"fsdp_wrap": pc["wrap"]} if "wrap" in pc else {}   # FSDP2's units (spec.FSDP_WRAPS)
        p = Parallel(strategy=pc["strategy"], gpus=2, **wrap) if pc["strategy"] != "single" else Parallel()
        if "cp" in pc:   # a context-parallel rank (estimator.cp): its degree, TP inside, and which rank
            p = Parallel(strategy=pc["strategy"], gpus=2 * pc["cp"] * pc.get("tp", 1), cp=pc["cp"],
                         tp=pc.get("tp", 1), sequence_parallel=pc.get("sp", False), **wrap)
        cls = store.workload_class(w, rank_variable=rank_free)   # a per-rank LoRA file: the legacy class
        assert cls == data["workload_class"], f
        kernels = data.get("provenance", {}).get("kernels", "cuda")
        assert store.class_key(cls, store.parallel_class(p, pc.get("rank", 0)), kernels) == f.stem, f


# ---------------------------------------------------------------- against the tracer (tiny models, fake tensors)

def _config(family: str = "llama", **overrides) -> dict:
    return {**json.loads((TINY / f"t-{family}.json").read_text()), **overrides}


SHALLOW = dict(num_hidden_layers=2)  # the default tier's traces: two layers keep them fast (< 1 s of CPU each)


def _peaks(config: dict, w: Workload, p: Parallel = Parallel()) -> dict:
    pytest.importorskip("torch")
    from bench.trace.cases import trace_case

    row = trace_case(config, "tiny", w, p)
    stages = TRAIN_STAGES if w.mode == "train" else ("load", "prefill", "decode")
    return {s: row[f"{s}_peak_alloc_bytes"] for s in stages}


@pytest.mark.parametrize("w, noisy", [
    (Workload(mode="infer", batch=2, seq=24, gen_tokens=1),
     dict(optimizer="sgd", recipe="amp", optimizer_impl="fused", lora_rank=64, double_quant=False)),
    (Workload(batch=2, seq=24), dict(lora_rank=64, lora_targets=("q_proj", "k_proj"), double_quant=False)),
    (Workload(batch=2, seq=24, method="lora"), dict(double_quant=False)),
], ids=["infer", "full", "lora"])
def test_a_trace_with_irrelevant_knobs_equals_one_without(w, noisy):
    noisy_w = replace(w, **noisy)
    assert store.canonical_class(noisy_w) == w
    assert _peaks(_config(**SHALLOW), noisy_w) == _peaks(_config(**SHALLOW), w)


def test_grad_accum_past_two_traces_like_two():
    # Two optimizer steps of grad_accum micro-batches, the last step's ticks kept: from the second micro-batch on
    # each runs with the accumulated gradients held, so 3, 4 and 7 repeat 2 byte for byte (1 does not: no
    # gradients live through its forward)
    cfg = _config(**SHALLOW)
    w = Workload(batch=1, seq=16, method="lora")
    two = _peaks(cfg, replace(w, grad_accum=2))
    assert _peaks(cfg, replace(w, grad_accum=1)) != two
    for ga in (3, 4, 7):
        assert _peaks(cfg, replace(w, grad_accum=ga)) == two, ga


GA_CASES = [  # the cases behind the comment on estimator.store.GRAD_ACCUM_CLASS
    ("llama", {}, Parallel()),
    ("llama", dict(method="lora", lora_targets=("q_proj", "v_proj")), Parallel()),
    ("llama", dict(recipe="amp"), Parallel()),
    ("llama", dict(recipe="mixed"), Parallel()),
    ("llama", dict(checkpointing="full"), Parallel()),
    ("llama", dict(checkpointing="selective"), Parallel()),
    ("llama", dict(checkpointing="op-sac"), Parallel()),
    ("llama", dict(loss="chunked"), Parallel()),
    ("llama", dict(loss="fused-linear"), Parallel()),
    ("llama", dict(loop="keep-output"), Parallel()),
    ("llama", dict(activation_offload=True), Parallel()),
    ("llama", dict(optimizer="sgd"), Parallel()),
    ("llama", dict(optimizer_impl="fused"), Parallel()),
    ("llama", dict(compile=True), Parallel()),
    ("llama", {}, Parallel(strategy="fsdp", gpus=2)),
    ("llama", {}, Parallel(strategy="fsdp-grad-op", gpus=2)),
    ("gpt2", {}, Parallel()),
    ("mixtral", {}, Parallel()),
    ("bert", {}, Parallel()),
    ("gemma2", dict(attention="eager"), Parallel()),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, knob, par", GA_CASES,
                         ids=[f"{f}-{'-'.join(map(str, k.values())) or 'plain'}-{p.strategy}" for f, k, p in GA_CASES])
def test_grad_accum_past_two_traces_like_two_everywhere(family, knob, par):
    cfg = _config(family)
    for b, s in ((2, 64), (1, 37)):
        w = Workload(batch=b, seq=s, **knob)
        two = _peaks(cfg, replace(w, grad_accum=2), par)
        for ga in (3, 4, 7):
            assert _peaks(cfg, replace(w, grad_accum=ga), par) == two, (b, s, ga)


@pytest.mark.slow
@pytest.mark.parametrize("ga", [3, 7])
def test_the_grad_accum_2_profile_prices_more_micro_batches_exactly(ga):
    # estimate() at grad_accum 3 and 7 evaluates the grad_accum=2 profile: each stage equals a trace at that
    # grad_accum, at a size the fit did not use
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    cfg = _config()
    w = Workload(batch=2, seq=64, grad_accum=ga)
    est = estimate(from_hf_config(cfg, "tiny"), w)
    assert est.profile and not est.notes
    got = {name: b.tensor_bytes for name, b in est.stages if name in TRAIN_STAGES}
    assert got == _peaks(cfg, w)


def test_lora_target_order_shares_one_class():
    a = Workload(method="lora", lora_targets=("v_proj", "q_proj", "o_proj"))
    b = replace(a, lora_targets=("o_proj", "q_proj", "v_proj"))
    assert store.canonical_class(a) == store.canonical_class(b) == b
    assert store.profile_key(a, Parallel()) == store.profile_key(b, Parallel())


def test_lora_target_order_changes_no_traced_byte():
    # PEFT matches module names against the set of targets: the same adapters in the same modules, whatever the order
    w = Workload(method="lora", lora_targets=("v_proj", "q_proj", "down_proj"), batch=2, seq=48)
    assert _peaks(_config(**SHALLOW), w) == _peaks(_config(**SHALLOW), replace(w, lora_targets=tuple(sorted(w.lora_targets))))


def test_flash_on_a_text_step_is_sdpas_traced_class():
    # FlashAttention-2 is traced as SDPA on the CPU: a text step (no images) shares SDPA's profile, derived or shipped
    for w in (Workload(attention="flash"), Workload(mode="infer", attention="flash", kv_dtype="fp8"),
              Workload(method="lora", attention="flash", checkpointing="selective")):
        tw, tp, notes = traced_class(w, Parallel())
        assert (tw, tp, notes) == traced_class(replace(w, attention="sdpa"), Parallel())
        assert tw.attention == "sdpa" and store.canonical_class(tw) == tw
    # a VLM's images keep it: its vision tower's packed varlen call is flash's alone (tracer.vlm_grid)
    assert traced_class(Workload(attention="flash", images=1), Parallel())[0].attention == "flash"


@pytest.mark.parametrize("w", [Workload(batch=2, seq=40), Workload(mode="infer", batch=2, seq=40, gen_tokens=2),
                               Workload(method="lora", batch=1, seq=33, checkpointing="selective")],
                         ids=["full", "infer", "lora-selective"])
def test_a_flash_trace_equals_an_sdpa_trace(w):
    # what the folding above assumes, checked: the same step to the byte
    assert _peaks(_config(**SHALLOW), replace(w, attention="flash")) == _peaks(_config(**SHALLOW), w)


def test_a_flash_estimate_is_read_from_the_shipped_sdpa_profile():
    m = from_hf_config(load_config("llama-3.1-8b")[1], "llama-3.1-8b", derive=False)
    w = Workload(mode="infer", batch=1, seq=126976, gen_tokens=4096, kv_dtype="fp8")
    sdpa = estimate(m, w, Parallel(), Options(derive=False))   # nothing derived: both from the shipped file
    flash = estimate(m, replace(w, attention="flash"), Parallel(), Options(derive=False))
    assert flash.stages == sdpa.stages and flash.allocated_bytes == sdpa.allocated_bytes > 0
