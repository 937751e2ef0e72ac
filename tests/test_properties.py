"""Property tests (hypothesis): invariants of estimate() over random valid and invalid specs."""
from __future__ import annotations

import re
from dataclasses import fields, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator.breakdown import COMPONENTS
from estimator.estimate import estimate
from estimator.profile.poly import MASK_ALIGNMENT
from estimator.spec import Parallel, Workload
from strategies import lora_names, model, models, parallels, runnable, workloads

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    m = draw(models)
    w, p = draw(workloads(m)), draw(parallels(m))
    return m, runnable(w, p), p


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
    """Over the multiples of 16 memory never falls as seq grows; a seq that is no multiple of 16 may cost more than the
    multiple above it (past a sliding window CUDA's memory-efficient attention copies the mask there:
    estimator.search.max_seq), never less than the one below it."""
    m, w, p = case
    base = estimate(m, w, p).total_bytes
    assert estimate(m, replace(w, batch=w.batch + db), p).total_bytes >= base
    aligned = w.seq - w.seq % MASK_ALIGNMENT
    if aligned and aligned != w.seq:
        below = estimate(m, replace(w, seq=aligned), p).total_bytes
        assert base >= below
        base = below
    assert estimate(m, replace(w, seq=w.seq + ds), p).total_bytes >= base


@SETTINGS
@given(cases())
def test_memory_never_falls_as_bytes_per_value_grow(case):
    m, w, p = case
    if w.mode == "infer":
        # KV cache fp8 -> bf16 -> fp32; stored weights nf4 -> int8 -> bf16 (embeddings, lm_head and norms
        # stay in the bf16 precision whatever the format of the block Linears)
        kv = [estimate(m, replace(w, kv_dtype=d), p).total_bytes for d in ("fp8", "bf16", "fp32")]
        assert kv == sorted(kv)
        wf = [estimate(m, replace(w, weight_format=f), p).total_bytes for f in ("nf4", "int8", "bf16")]
        assert wf == sorted(wf)
    else:
        # optimizer states: sgd (none) <= 8-bit AdamW (2 B + absmax) <= AdamW (2 states in the state dtype)
        opts = [estimate(m, replace(w, optimizer=o, optimizer_impl="foreach"), p).total_bytes
                for o in ("sgd", "adamw-8bit", "adamw")]
        assert opts == sorted(opts)


@SETTINGS
@given(st.data())
def test_more_gpus_never_cost_more_when_sharding(data):
    # From 2 GPUs on (1 -> 2 adds NCCL buffers): ZeRO-1/2 shard the optimizer states (and the gradients), TP
    # shards the model and the activations; doubling the world size never raises per-GPU memory.
    m = data.draw(models)
    w = data.draw(workloads(m))
    strategy = data.draw(st.sampled_from(("zero1", "zero2", "tp")))
    sizes = [n for n in (2, 4, 8, 16) if strategy != "tp" or (m.heads % (2 * n) == 0 and
                                                               (m.kv_heads % (2 * n) == 0 or (2 * n) % m.kv_heads == 0))]
    if not sizes:
        return
    n = data.draw(st.sampled_from(sizes))
    w = runnable(w, Parallel(strategy=strategy, gpus=n))
    small = estimate(m, w, Parallel(strategy=strategy, gpus=n)).total_bytes
    assert estimate(m, w, Parallel(strategy=strategy, gpus=2 * n)).total_bytes <= small


def test_fsdp_more_gpus_cost_less():
    """FSDP's own traced profile (one FSDP2 rank with a fake process group): its 1/n terms fall with n."""
    m = model("llama-3.1-8b")
    totals = [estimate(m, Workload(), Parallel(strategy="fsdp", gpus=n)).total_bytes for n in (2, 4, 8, 16, 64)]
    assert totals == sorted(totals, reverse=True)


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
    with pytest.raises(ValueError, match=r"^lora_targets: q_proj, v_proj match no Linear"):
        m.inventory.trainable_params(Workload(method="lora"))
