"""Hypothesis strategies for valid (model, Workload, Parallel) triples, shared by the property and sweep tests.

Valid specs are built constructively (each choice allowed by the previous ones), not by filtering, so hypothesis
spends its examples on estimates rather than on rejected draws.
"""
from __future__ import annotations

from functools import cache

from hypothesis import strategies as st

from estimator.model import ModelSpec, from_hf_config
from estimator.presets import load_config, preset_names
from estimator.spec import ATTENTION, CHECKPOINTING, KV_DTYPES, OPTIMIZER_IMPLS, OPTIMIZERS, WEIGHT_FORMATS, Parallel, Workload


@cache
def model(name: str) -> ModelSpec:
    return from_hf_config(load_config(name)[1], name)


def lora_names(m: ModelSpec) -> list[str]:
    return sorted({lin.name.split(".")[-1] for _, lin in m.linears() if lin.role != "expert"})


models = st.sampled_from(preset_names()).map(model)


@st.composite
def workloads(draw, m: ModelSpec, max_batch: int = 64, max_seq: int = 8192) -> Workload:
    mode = draw(st.sampled_from(("train", "infer")))
    common = dict(batch=draw(st.integers(1, max_batch)), seq=draw(st.integers(1, max_seq)),
                  attention=draw(st.sampled_from(ATTENTION)), kv_dtype=draw(st.sampled_from(KV_DTYPES)))
    if mode == "infer":
        return Workload(mode="infer", precision=draw(st.sampled_from(("bf16", "fp16", "fp32"))),
                        weight_format=draw(st.sampled_from(WEIGHT_FORMATS)), gen_tokens=draw(st.integers(0, 512)),
                        **common)
    method = draw(st.sampled_from(("full", "lora", "qlora")))
    recipes = ("pure", "amp", "mixed") if method == "qlora" else ("pure", "amp", "mixed", "fp32")
    recipe = draw(st.sampled_from(recipes))
    if recipe == "fp32":
        precision = "fp32"
    elif recipe == "pure" and method != "qlora":
        precision = draw(st.sampled_from(("bf16", "fp16", "fp32")))
    else:
        precision = draw(st.sampled_from(("bf16", "fp16")))
    formats = {"full": ("auto", "fp32", "bf16", "fp16"), "qlora": ("auto", "nf4", "fp4")}.get(method, WEIGHT_FORMATS)
    optimizer = draw(st.sampled_from(tuple(o for o in OPTIMIZERS if not o.startswith("paged"))))
    impls = ("foreach", "forloop") if optimizer == "adamw-8bit" else OPTIMIZER_IMPLS
    names = lora_names(m)
    targets = tuple(draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)))
    return Workload(mode="train", method=method, recipe=recipe, precision=precision,
                    weight_format=draw(st.sampled_from(formats)), optimizer=optimizer,
                    optimizer_impl=draw(st.sampled_from(impls)), grad_accum=draw(st.integers(1, 8)),
                    checkpointing=draw(st.sampled_from(tuple(c for c in CHECKPOINTING if c != "op-sac"))), lora_rank=draw(st.integers(1, 64)),
                    lora_targets=targets, **common)


@st.composite
def parallels(draw, max_gpus: int = 64) -> Parallel:
    strategy = draw(st.sampled_from(("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp",
                                     "tp", "pp", "ep")))
    gpus = 1 if strategy == "single" else draw(st.integers(1, max_gpus))
    if strategy == "hsdp":
        gpus = 2 * max(1, gpus // 2)
    sp = strategy == "tp" and gpus > 1 and draw(st.booleans())
    offload = "none"
    if strategy in ("single", "zero1", "zero2", "zero3", "fsdp"):
        offload = draw(st.sampled_from(("none", "optimizer", "optimizer+params")))
    return Parallel(strategy=strategy, gpus=gpus, sequence_parallel=sp, offload=offload)
