"""Hypothesis strategies for valid (model, Workload, Parallel) triples, shared by the property and sweep tests.

Every traced workload class needs a profile; the shipped ones (data/profiles/) are what these draw from:
training (full fine-tuning and LoRA, pure bf16) and inference (SDPA) on every preset. Everything the estimator
prices analytically on top of a profile varies freely: sizes, optimizers and their implementation, stored weight
formats, QLoRA, the LoRA rank (where the preset ships a rank-free profile), the KV-cache dtype, ZeRO-1/2, tensor / pipeline / expert parallelism, DDP, CPU offload.
Valid specs are built constructively (each choice allowed by the previous ones), not by filtering.
"""
from __future__ import annotations

from functools import cache

from hypothesis import strategies as st

from estimator.model import Model, from_hf_config
from estimator.presets import config_hash, load_config, preset_names
from estimator import store
from estimator.parallel import steppable
from estimator.spec import KV_DTYPES, MAX_LORA_RANK, OPTIMIZER_IMPLS, OPTIMIZERS, WEIGHT_FORMATS, Parallel, Workload
from estimator.vision import geometry, is_vision
from estimator.store import SHIPPED_DIR
from tracer.lora import default_lora_targets



@cache
def model(name: str) -> Model:
    return from_hf_config(load_config(name)[1], name, derive=False)


def lora_names(m: Model) -> list[str]:
    return m.inventory.lora_target_names()


def attention(m: Model) -> str:
    return m.default_attention  # eager where transformers has no SDPA path (Gemma-2, gpt-oss)


def lora_targets(m: Model) -> tuple[str, ...]:
    return default_lora_targets(m.model_type)   # PEFT's defaults, as the shipped profiles were derived


def _has_shipped_profiles(name: str) -> bool:
    """A preset whose profiles are shipped in data/profiles/ (beside its inventory). Presets added with their
    inventory only (their profiles are derived later with `python -m bench derive --model NAME --ship`) are left
    out: estimate() would otherwise trace them on first use, which takes minutes and is not what these test."""
    shipped = SHIPPED_DIR / config_hash(load_config(name)[1])[:16]
    return any(f.name != "inventory.json" for f in shipped.glob("*.json"))


@cache
def _rank_free(name: str) -> bool:
    """Whether the preset ships its default LoRA class's rank-free profile (scripts/ship_profiles.py --lora-only)."""
    m = model(name)
    w = Workload(method="lora", lora_targets=lora_targets(m), attention=attention(m))
    key = store.stored_key(m.config, w, Parallel(), ship=True)
    return key is not None and key == store.profile_key(w, Parallel())


# encoder-decoder presets are drawn by tests/test_seq2seq.py: their lengths, layouts and T5's SDPA decoding have rules
# of their own (estimator.seq2seq.check), which the draws below do not follow
PROFILED_PRESETS = [n for n in preset_names() if _has_shipped_profiles(n) and not load_config(n)[1].get(
    "is_encoder_decoder")]
models = st.sampled_from(PROFILED_PRESETS).map(model)


@st.composite
def workloads(draw, m: Model, max_batch: int = 64, max_seq: int = 8192) -> Workload:
    """A workload of a shipped class with its analytic fields and sizes drawn freely."""
    mode = draw(st.sampled_from(("train", "infer")) if m.causal else st.just("train"))
    seq = draw(st.integers(1, min(max_seq, m.max_positions)))
    common = dict(batch=draw(st.integers(1, max_batch)), seq=seq, attention=attention(m))
    if is_vision(m):  # sized by its image: a multiple of its patch size, up to 64 patches a side; batch 2 and up:
        # at batch 1 the optimizer step holds one more patches x hidden gradient than the batch >= 2 line, so batch 1
        # can hold more than batch 2 on tiny images, as traced
        # (tests/test_vision.py::test_batch_one_keeps_a_patch_gradient_through_the_optimizer_step)
        common.update(seq=Workload().seq, image_size=geometry(m)["patch_size"] * draw(st.integers(1, 64)),
                      batch=draw(st.integers(2, max(2, max_batch))))
    if mode == "infer":
        return Workload(mode="infer", weight_format=draw(st.sampled_from(tuple(f for f in WEIGHT_FORMATS
                                                                                 if f not in ("fp32", "fp16")))),
                        kv_dtype=draw(st.sampled_from(KV_DTYPES)),
                        gen_tokens=draw(st.integers(0, min(512, m.max_positions - seq))), **common)
    method = draw(st.sampled_from(("full", "lora", "qlora")))
    optimizer = draw(st.sampled_from(OPTIMIZERS))
    impls = ("foreach", "forloop") if optimizer in ("adamw-8bit", "paged-adamw", "paged-adamw-8bit") \
        else OPTIMIZER_IMPLS
    extra = {}
    if method != "full":
        extra["lora_targets"] = lora_targets(m)
        if _rank_free(m.name):  # one shipped profile answers every rank: draw it (else the shipped rank, 8)
            extra["lora_rank"] = draw(st.integers(1, MAX_LORA_RANK))
    if method == "qlora":
        extra["weight_format"] = draw(st.sampled_from(("auto", "nf4", "fp4")))
        extra["quantize_scope"] = draw(st.sampled_from(("all", "adapted")))
        extra["double_quant"] = draw(st.booleans())
    elif method == "lora":  # a quantized or bf16 base (fp32/fp16 bases are other traced classes)
        extra["weight_format"] = draw(st.sampled_from(tuple(f for f in WEIGHT_FORMATS if f not in ("fp32", "fp16"))))
    return Workload(mode="train", method=method, optimizer=optimizer, optimizer_impl=draw(st.sampled_from(impls)),
                    **extra, **common)


@st.composite
def parallels(draw, m: Model | None = None, max_gpus: int = 64) -> Parallel:
    """Strategies priced over the single-GPU profile (FSDP's own traced profiles are tested apart)."""
    strategies = ["single", "ddp", "zero1", "zero2", "tp", "pp"] + (["ep"] if m is not None and m.is_moe else [])
    strategy = draw(st.sampled_from(strategies))
    if strategy == "single":
        return Parallel(offload=draw(st.sampled_from(("none", "optimizer", "optimizer+params"))))
    gpus = draw(st.integers(2, max_gpus))
    if strategy == "tp" and m is not None:
        gpus = draw(st.sampled_from([n for n in (2, 4, 8) if m.heads % n == 0 and
                                     (m.kv_heads % n == 0 or n % m.kv_heads == 0)] or [1]))
        if gpus == 1:
            return Parallel()
    if strategy == "pp" and m is not None:
        gpus = min(gpus, m.layers)
    if strategy == "ep":
        gpus = draw(st.sampled_from([n for n in (2, 4, 8) if m.n_experts % n == 0]))
    sp = strategy == "tp" and draw(st.booleans())
    offload = draw(st.sampled_from(("none", "optimizer", "optimizer+params"))) if strategy in ("zero1", "zero2") \
        else "none"
    return Parallel(strategy=strategy, gpus=gpus, sequence_parallel=sp, offload=offload)


def runnable(w: Workload, p: Parallel) -> Workload:
    """The drawn workload as a run under `p` can step it (estimator.parallel.steppable: fused SGD over FSDP2's or
    TP's parameters, which check_optimizer refuses, is drawn as foreach)."""
    return steppable(w, p)
