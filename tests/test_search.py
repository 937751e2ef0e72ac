"""Searches (max batch/seq, fewest GPUs, advice) and the vectorised sweep, checked against estimate() itself."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator import sweep as sweep_mod
from estimator.estimate import Breakdown, Options, estimate
from estimator.search import advice, max_batch, max_seq, min_gpus, valid_world_sizes
from estimator.spec import Parallel, Workload
from estimator.sweep import ROUNDING_TOL_BYTES, sweep, sweep_points
from estimator.units import GiB
from strategies import model, models, parallels, workloads

L8 = "llama-3.1-8b"


def _total(m, w, p=Parallel(), o=Options()):
    return estimate(m, w, p, o).total_bytes


# ---------------------------------------------------------------- max_batch / max_seq

@pytest.mark.parametrize("w", [Workload(method="qlora"), Workload(method="lora", checkpointing="full"),
                               Workload(mode="infer", seq=4096, gen_tokens=256)])
def test_max_batch_is_the_boundary(w):
    m, cap = model(L8), 24 * GiB
    b = max_batch(m, w, Parallel(), cap)
    assert b >= 1
    assert _total(m, replace(w, batch=b)) <= cap < _total(m, replace(w, batch=b + 1))


def test_max_batch_zero_when_nothing_fits():
    # Full bf16 fine-tune of 8B: weights + grads + AdamW states alone are 64 GB.
    assert max_batch(model(L8), Workload(), Parallel(), 24 * GiB) == 0


def test_max_seq_is_the_boundary_and_respects_limit():
    m, w, cap = model(L8), Workload(method="qlora", batch=2), 24 * GiB
    s = max_seq(m, w, Parallel(), cap)
    assert _total(m, replace(w, seq=s)) <= cap < _total(m, replace(w, seq=s + 1))
    assert max_seq(m, w, Parallel(), cap, limit=100) == 100


# ---------------------------------------------------------------- min_gpus

@pytest.mark.parametrize("name, strategy", [("llama-3.1-70b", s) for s in ("zero3", "fsdp", "hsdp", "tp", "pp")]
                         + [(L8, "zero2"), (L8, "zero1")])  # zero1/2 keep full weights: 70B never fits
def test_min_gpus_is_the_smallest_valid_size(name, strategy):
    m, w, cap = model(name), Workload(checkpointing="full"), 80 * GiB
    n = min_gpus(m, w, strategy, cap, max_gpus=256)
    assert n is not None
    sizes = valid_world_sizes(m, strategy, 256)
    assert n in sizes
    assert _total(m, w, Parallel(strategy=strategy, gpus=n)) <= cap
    for smaller in (k for k in sizes if k < n):
        assert _total(m, w, Parallel(strategy=strategy, gpus=smaller)) > cap


def test_min_gpus_none_when_impossible():
    # DDP replicates everything: a 70B full fine-tune never fits an 80 GB GPU however many there are.
    assert min_gpus(model("llama-3.1-70b"), Workload(), "ddp", 80 * GiB) is None
    assert min_gpus(model(L8), Workload(mode="infer"), "single", 1 * GiB) is None


def test_valid_world_sizes():
    m = model(L8)  # 32 heads, 8 KV heads, 32 layers
    assert valid_world_sizes(m, "tp", 64) == [1, 2, 4, 8, 16, 32]
    assert valid_world_sizes(m, "pp", 64) == list(range(1, 33))
    assert valid_world_sizes(m, "hsdp", 8) == [2, 4, 6, 8]
    assert valid_world_sizes(model("mixtral-8x7b"), "ep", 16) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="^strategy: 'ep'"):
        valid_world_sizes(m, "ep")
    with pytest.raises(ValueError, match="^strategy: "):
        valid_world_sizes(m, "zero4")


# ---------------------------------------------------------------- advice

def _apply(w, p, change):
    wf = {k: v for k, v in change.items() if hasattr(w, k)}
    return replace(w, **wf), replace(p, **{k: v for k, v in change.items() if k not in wf})


@pytest.mark.parametrize("name, w, p", [
    (L8, Workload(batch=4), Parallel()),
    (L8, Workload(batch=8, attention="eager", recipe="amp"), Parallel()),
    ("llama-3.1-70b", Workload(batch=2), Parallel(strategy="ddp", gpus=8)),
    (L8, Workload(mode="infer", batch=64, seq=8192, precision="fp32"), Parallel()),
    ("gpt2", Workload(batch=64, seq=1024), Parallel()),
])
def test_advice_is_priced_by_estimate(name, w, p):
    m, cap = model(name), 24 * GiB
    current = _total(m, w, p)
    items = advice(m, w, p, cap)
    assert items, "an OOM config must get advice"
    singles = [a for a in items if not a.title.startswith("Combine")]
    assert [a.saving_bytes for a in singles] == sorted((a.saving_bytes for a in singles), reverse=True)
    for a in items:
        w2, p2 = _apply(w, p, a.change)
        assert a.new_total_bytes == _total(m, w2, p2)
        assert a.saving_bytes == current - a.new_total_bytes > 0
        assert a.fits == (a.new_total_bytes <= cap)


def test_advice_for_eager_and_microbatch():
    m, w = model(L8), Workload(method="lora", batch=8, attention="eager", grad_accum=2)
    by_title = {a.title: a for a in advice(m, w, Parallel(), 24 * GiB)}
    assert by_title["Use SDPA attention instead of eager"].change == {"attention": "sdpa"}
    micro = next(a for t, a in by_title.items() if t.startswith("Micro-batch"))
    assert micro.change["batch"] * micro.change["grad_accum"] == 8 * 2  # same effective batch


def test_advice_lora_uses_the_models_module_names():
    # small batch: the optimizer states dominate, so LoRA saves (at batch 64 x 1024 its fp32 adapters and their
    # inputs cost more than the states they spare, and advice rightly leaves it out)
    titles = {a.title: a for a in advice(model("gpt2"), Workload(batch=1, seq=256), Parallel(), GiB // 2)}
    lora = titles["Fine-tune with LoRA (r=8) instead of all weights"]
    assert lora.change["lora_targets"] == ("c_attn", "c_proj")


def test_combined_advice_fits_when_no_single_change_does():
    m, w, cap = model(L8), Workload(batch=4), 24 * GiB
    items = advice(m, w, Parallel(), cap)
    assert not any(a.fits for a in items if not a.title.startswith("Combine"))
    combined = items[-1]
    assert combined.title.startswith("Combine") and combined.fits
    w2, p2 = _apply(w, Parallel(), combined.change)
    assert _total(m, w2, p2) == combined.new_total_bytes <= cap


# ---------------------------------------------------------------- sweep == estimate

@st.composite
def sweep_cases(draw):
    m = draw(models)
    w = draw(workloads(m))
    p = draw(parallels(max_gpus=16))
    k = draw(st.one_of(st.none(), st.floats(2.0, 60.0)))
    n = draw(st.integers(1, 12))
    bs = draw(st.lists(st.integers(1, 64), min_size=n, max_size=n))
    ss = draw(st.lists(st.integers(1, 8192), min_size=n, max_size=n))
    return m, w, p, Options(activation_k=k), np.array(bs), np.array(ss)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sweep_cases())
def test_sweep_points_equal_estimate(case):
    # Exact where estimate() is integer arithmetic; within ROUNDING_TOL_BYTES (4) where it rounds a float
    # (tp/pp fractions, the k form) -- worst case seen over 1,800 random and clustered grids: 1 byte.
    m, w, p, o, bs, ss = case
    got = sweep_points(m, w, bs, ss, p, o)
    want = np.array([_total(m, replace(w, batch=int(b), seq=int(s)), p, o) for b, s in zip(bs, ss)])
    assert np.abs(got - want).max() <= ROUNDING_TOL_BYTES


def test_sweep_grid_matches_estimate_everywhere():
    m = model(L8)
    ws = [Workload(method="lora"), Workload(mode="infer", attention="eager", gen_tokens=64),
          Workload(checkpointing="full", attention="eager")]
    ps = [Parallel(), Parallel(strategy="zero3", gpus=4)]
    bs, ss = np.array([1, 3, 8, 17]), np.array([64, 200, 333, 345, 1000, 2048, 4095])
    r = sweep(m, ws, ps, bs, ss)
    assert r.total_bytes.shape == (3, 2, 4, 7) and r.total_bytes.dtype == np.int64
    for i, w in enumerate(ws):
        for j, p in enumerate(ps):
            for bi, b in enumerate(bs):
                for si, s in enumerate(ss):
                    assert r.total_bytes[i, j, bi, si] == _total(m, replace(w, batch=int(b), seq=int(s)), p)


def test_sweep_handles_the_kink_of_eager_prefill_exactly():
    # Eager prefill holds max(attention scores ~ s, MLP intermediates), a kink near s = 341 for Llama-3.1-8B:
    # no quadratic fits across it, the check points catch that, and the per-seq fit is exact.
    m, w = model(L8), Workload(mode="infer", attention="eager")
    ss = np.arange(1, 2049, 7)
    bs = np.full(ss.shape, 3)
    got = sweep_points(m, w, bs, ss)
    want = np.array([_total(m, replace(w, batch=3, seq=int(s))) for s in ss])
    assert np.array_equal(got, want)


@pytest.mark.parametrize("name, w, o, bs, ss", [
    # seqs clustered at one end: a quadratic through 1, 5, 481 would amplify the k form's rounding 26x at 154
    ("bert-large-uncased", Workload(), Options(activation_k=7.03), [1] * 9, [1, 2, 3, 4, 5, 6, 7, 154, 481]),
    # a kink (eager + full checkpointing) between a lone short seq and a cluster of long ones
    ("opt-1.3b", Workload(method="qlora", lora_targets=("fc1", "fc2"), checkpointing="full", attention="eager"),
     Options(), [18, 94, 1, 99, 1, 63], [1, 5005, 5004, 5007, 5008, 5001]),
])
def test_sweep_adversarial_grids(name, w, o, bs, ss):
    m = model(name)
    got = sweep_points(m, w, np.array(bs), np.array(ss), Parallel(), o)
    want = np.array([_total(m, replace(w, batch=b, seq=s), Parallel(), o) for b, s in zip(bs, ss)])
    assert np.abs(got - want).max() <= (ROUNDING_TOL_BYTES if o.activation_k else 0)


def test_sweep_falls_back_to_scalar_when_not_polynomial(monkeypatch):
    # Make every moment grow with batch^2: no fit in b holds, so every point must come from estimate().
    real_moments, real_estimate = sweep_mod.moments, sweep_mod.estimate

    def bent_moments(m, w, p, o):
        return tuple((ps, n, replace(b, temporaries=b.temporaries + 1000 * w.batch ** 2)) for ps, n, b in real_moments(m, w, p, o))

    def bent_estimate(m, w, p, o):
        e = real_estimate(m, w, p, o)
        return replace(e, stages=tuple((n, replace(b, temporaries=b.temporaries + 1000 * w.batch ** 2)) for n, b in e.stages))

    monkeypatch.setattr(sweep_mod, "moments", bent_moments)
    monkeypatch.setattr(sweep_mod, "estimate", bent_estimate)
    m, w = model(L8), Workload(method="lora")
    r = sweep(m, [w], [Parallel()], np.array([1, 2, 5, 9]), np.array([100, 200, 300, 400, 500, 600]))
    assert r.fallback_points > 0
    for bi, b in enumerate((1, 2, 5, 9)):
        for si, s in enumerate((100, 200, 300, 400, 500, 600)):
            assert r.total_bytes[0, 0, bi, si] == _total(m, replace(w, batch=b, seq=s)) + 1000 * b * b


def test_sweep_validates_axes():
    m, w = model(L8), Workload()
    with pytest.raises(ValueError, match="^batch: "):
        sweep_points(m, w, np.array([0, 1]), np.array([1, 1]))
    with pytest.raises(ValueError, match="^seq: "):
        sweep_points(m, w, np.array([1]), np.array([1.5]))
    with pytest.raises(ValueError, match="^batch: .* give one seq per batch"):
        sweep_points(m, w, np.array([1, 2]), np.array([1]))
    assert sweep_points(m, w, np.array([], dtype=int), np.array([], dtype=int)).size == 0
    assert isinstance(Breakdown().total, int)
