"""Property tests (hypothesis): invariants of estimate() over random valid and invalid specs."""
from __future__ import annotations

import re
from dataclasses import fields, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator.estimate import COMPONENTS, estimate
from estimator.spec import Parallel, Workload
from strategies import lora_names, model, models, parallels, workloads

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    m = draw(models)
    return m, draw(workloads(m)), draw(parallels())


@SETTINGS
@given(cases())
def test_no_valid_spec_raises_and_totals_add_up(case):
    m, w, p = case
    e = estimate(m, w, p)
    for name, b in e.stages:
        assert b.total == sum(b.as_dict()[c] for c in COMPONENTS) == sum(b.as_dict().values())
        assert all(v >= 0 for v in b.as_dict().values()), name
    assert e.total_bytes == max(b.total for _, b in e.stages) == e.stage(e.peak_stage).total
    assert 0 < e.allocated_bytes <= e.total_bytes


@SETTINGS
@given(cases(), st.integers(1, 64), st.integers(1, 4096))
def test_memory_never_falls_as_batch_or_seq_grow(case, db, ds):
    m, w, p = case
    base = estimate(m, w, p).total_bytes
    assert estimate(m, replace(w, batch=w.batch + db), p).total_bytes >= base
    assert estimate(m, replace(w, seq=w.seq + ds), p).total_bytes >= base


@SETTINGS
@given(cases())
def test_memory_never_falls_as_bytes_per_value_grow(case):
    m, w, p = case
    base = estimate(m, w, p).total_bytes
    if w.mode == "infer":
        # KV cache fp8 -> bf16 -> fp32; weights nf4 -> int8 -> bf16 -> fp32; compute bf16 -> fp32
        kv = [estimate(m, replace(w, kv_dtype=d), p).total_bytes for d in ("fp8", "bf16", "fp32")]
        assert kv == sorted(kv)
        if w.precision != "fp32":
            # Quantizers keep embeddings, lm_head and norms in `precision`; with precision fp32 an int8 model's
            # fp32 embeddings can outweigh a bf16 model's (more so gathered as FSDP's root), so the order
            # nf4 < int8 < bf16 holds only when the unquantized parts are half precision.
            wf = [estimate(m, replace(w, weight_format=f), p).total_bytes for f in ("nf4", "int8", "bf16", "fp32")]
            assert wf == sorted(wf)
        if w.precision != "fp32":
            assert estimate(m, replace(w, precision="fp32"), p).total_bytes >= base
    elif w.method != "qlora" and w.recipe == "pure" and w.precision != "fp32" and w.attention != "eager":
        # Not for eager attention: transformers' eager softmax runs in fp32 and keeps a half copy for the
        # matmul with V (4 + 2 B per score), while in fp32 the copy is a no-op (4 B): there, bf16 really
        # saves more per score than fp32 does (traced), so "more bytes per value" is not monotone.
        assert estimate(m, replace(w, precision="fp32"), p).total_bytes >= base
        assert estimate(m, replace(w, recipe="fp32", precision="fp32"), p).total_bytes >= base


@SETTINGS
@given(st.data())
def test_more_gpus_never_cost_more_when_sharding(data):
    # From 2 GPUs on (1 -> 2 adds NCCL buffers): ZeRO-3/FSDP shard the model states, TP shards the model and
    # the activations; doubling the world size never raises per-GPU memory.
    m = data.draw(models)
    w = data.draw(workloads(m))
    strategy = data.draw(st.sampled_from(("zero3", "fsdp", "tp")))
    n = data.draw(st.sampled_from((2, 4, 8, 16, 32)))
    small = estimate(m, w, Parallel(strategy=strategy, gpus=n)).total_bytes
    assert estimate(m, w, Parallel(strategy=strategy, gpus=2 * n)).total_bytes <= small


WORKLOAD_FIELDS = {f.name for f in fields(Workload)}
PARALLEL_FIELDS = {f.name for f in fields(Parallel)}
ANY_VALUE = st.one_of(st.text(max_size=8), st.integers(-5, 1 << 25), st.booleans(), st.none(),
                      st.tuples(st.text(max_size=5)), st.floats(allow_nan=True))


def _named_field(message: str, allowed: set[str]) -> bool:
    m = re.match(r"^(\w+): ", message)
    return bool(m) and m.group(1) in allowed


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(WORKLOAD_FIELDS)), ANY_VALUE | st.sampled_from(
    ("train", "infer", "full", "lora", "qlora", "pure", "amp", "fp32", "bf16", "nf4", "eager", "full")), max_size=4))
def test_invalid_workload_raises_valueerror_naming_a_field(kwargs):
    try:
        Workload(**kwargs)
    except ValueError as e:
        assert _named_field(str(e), WORKLOAD_FIELDS), str(e)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(PARALLEL_FIELDS)), ANY_VALUE | st.integers(0, 64) | st.sampled_from(
    ("single", "ddp", "zero3", "tp", "pp", "hsdp", "optimizer")), max_size=4))
def test_invalid_parallel_raises_valueerror_naming_a_field(kwargs):
    try:
        Parallel(**kwargs)
    except ValueError as e:
        assert _named_field(str(e), PARALLEL_FIELDS), str(e)


@pytest.mark.parametrize("kwargs, field", [
    ({"mode": "infer", "method": "lora"}, "method"),
    ({"method": "qlora", "weight_format": "int8"}, "weight_format"),
    ({"method": "qlora", "weight_format": "auto", "recipe": "fp32", "precision": "fp32"}, "recipe"),
    ({"batch": 0}, "batch"),
    ({"attention": "xformers"}, "attention"),
    ({"lora_targets": ()}, "lora_targets"),
])
def test_known_invalid_workloads(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        Workload(**kwargs)


def test_lora_target_missing_from_model_names_field():
    m = model("gpt2")
    assert "q_proj" not in lora_names(m)
    with pytest.raises(ValueError, match=r"^lora_targets: 'q_proj' matches no Linear"):
        estimate(m, Workload(method="lora"))
