"""Searches (max batch/seq, fewest GPUs, advice) and the vectorised sweep, checked against estimate() itself."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator.breakdown import Breakdown
from estimator.estimate import Options, estimate
from estimator.search import advice, max_batch, max_seq, min_gpus, valid_world_sizes
from estimator.spec import Parallel, Workload
from estimator.sweep import ROUNDING_TOL_BYTES, sweep, sweep_points
from estimator.units import GiB
from estimator.vision import SEQ_UNSET, geometry, is_vision
from strategies import model, models, parallels, runnable, workloads

L8 = "llama-3.1-8b"
SHIPPED = Options(derive=False)  # advice prices only what has a profile on disk: the tests never trace


def _total(m, w, p=Parallel(), o=Options()):
    return estimate(m, w, p, o).total_bytes


# ---------------------------------------------------------------- max_batch / max_seq

@pytest.mark.parametrize("w", [Workload(method="qlora"), Workload(method="lora", optimizer="adamw-8bit", seq=512),
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


@pytest.mark.parametrize("cap_gib", [80, 100])
def test_max_seq_past_a_window_equals_a_scan_of_every_seq(cap_gib):
    """mistral-7b past its 4096-token window: CUDA's memory-efficient attention copies the mask on every seq that is
    no multiple of 16 (seq 4097 costs more than 4112), so memory is not monotone in seq; the search still finds the
    longest seq that fits, as a scan of every seq up to the limit does."""
    m, w, cap, limit = model("mistral-7b"), Workload(batch=1), cap_gib * GiB, 8000
    assert _total(m, replace(w, seq=4097)) > _total(m, replace(w, seq=4112))
    fits = [s for s in range(1, limit + 1) if _total(m, replace(w, seq=s)) <= cap]
    assert max_seq(m, w, Parallel(), cap, limit=limit) == max(fits)
    assert any(s % 16 for s in fits) and any(s % 16 == 0 and s - 1 not in fits for s in fits)   # not monotone


def test_advice_pads_an_unaligned_seq_past_a_window():
    m = model("mistral-7b")
    rows = {a.title: a for a in advice(m, Workload(batch=1, seq=8191), Parallel(), 141 * GiB)}
    pad = rows["Pad each sequence to 8192 tokens (a multiple of 16)"]
    assert pad.fits and pad.saving_bytes == _total(m, Workload(batch=1, seq=8191)) - _total(m, Workload(batch=1, seq=8192))
    assert pad.saving_bytes > 100 * GiB   # every layer's copied mask, kept for backward
    below = advice(m, Workload(batch=1, seq=3001), Parallel(), 24 * GiB)   # below the window: no mask, no copy
    assert not any(a.title.startswith("Pad each") for a in below)


# ---------------------------------------------------------------- min_gpus

@pytest.mark.parametrize("name, strategy", [("llama-3.1-70b", s) for s in ("tp", "pp")]
                         + [(L8, "zero2"), (L8, "fsdp"), (L8, "zero3")])  # zero1 keeps full weights and grads: 8B never fits 24 GiB
def test_min_gpus_is_the_smallest_valid_size(name, strategy):
    # 70B: weights, grads and states need sharding; 8B at 24 GiB: its 128k-vocabulary logits need a short seq
    # (8B at seq 512: with the allocator's cache of the train-full class, seq 1024 no longer fits 24 GiB on ZeRO-2)
    m, w, cap = model(name), Workload(seq=512 if name == L8 else 2048), (24 if name == L8 else 80) * GiB
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
    pf = {k: v for k, v in change.items() if k not in wf and k != "alloc_conf"}  # alloc_conf: an Options field
    return replace(w, **wf), replace(p, **pf)


@pytest.mark.parametrize("name, w, p", [
    (L8, Workload(batch=4), Parallel()),
    (L8, Workload(batch=8, method="lora"), Parallel()),
    ("llama-3.1-70b", Workload(batch=2), Parallel(strategy="ddp", gpus=8)),
    (L8, Workload(mode="infer", batch=64, seq=8192), Parallel()),
    ("gpt2", Workload(batch=64, seq=1024), Parallel()),
])
def test_advice_is_priced_by_estimate(name, w, p):
    m, cap = model(name), 24 * GiB
    current = _total(m, w, p)
    items = advice(m, w, p, cap, SHIPPED)
    assert items, "an OOM config must get advice"
    singles = [a for a in items if not a.title.startswith("Combine") and a.priced]
    assert [a.saving_bytes for a in singles] == sorted((a.saving_bytes for a in singles), reverse=True)
    assert items[:len(singles)] == singles  # unpriced ones (no profile on disk) come last, without numbers
    for a in (a for a in items if a.priced):
        w2, p2 = _apply(w, p, a.change)
        assert a.new_total_bytes == _total(m, w2, p2, Options(alloc_conf=a.change.get("alloc_conf", "")))
        assert a.saving_bytes == current - a.new_total_bytes > 0
        assert a.fits == (a.new_total_bytes <= cap)


def test_advice_for_microbatch_keeps_the_effective_batch():
    m, w = model(L8), Workload(method="lora", batch=8, lora_targets=("q_proj", "v_proj"))
    by_title = {a.title: a for a in advice(m, w, Parallel(), 24 * GiB, SHIPPED)}
    micro = next(a for t, a in by_title.items() if t.startswith("Micro-batch"))
    assert micro.change["batch"] * micro.change["grad_accum"] == 8  # same effective batch
    # grad_accum >= 2 is one traced class (store.GRAD_ACCUM_CLASS), shipped for llama-3.1-8b: priced at once
    assert micro.priced
    changed = replace(w, batch=micro.change["batch"], grad_accum=micro.change["grad_accum"])
    assert micro.new_total_bytes == estimate(m, changed, Parallel(), SHIPPED).total_bytes


def test_advice_lora_uses_the_models_module_names():
    # small batch: the optimizer states dominate, so LoRA saves (at batch 64 x 1024 its fp32 adapters and their
    # inputs cost more than the states they spare, and advice rightly leaves it out)
    titles = {a.title: a for a in advice(model("gpt2"), Workload(batch=1, seq=256), Parallel(), GiB // 2, SHIPPED)}
    lora = titles["Fine-tune with LoRA (r=8) instead of all weights"]
    # GPT-2 has no q_proj/v_proj: PEFT's default for it, its fused attention projection (shipped: priced at once)
    assert lora.change["lora_targets"] == ("c_attn",) and lora.priced


def test_combined_advice_fits_when_no_single_change_does():
    m, w, cap = model(L8), Workload(batch=4), 24 * GiB
    items = advice(m, w, Parallel(), cap, SHIPPED)
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
    p = draw(parallels(m, max_gpus=16))
    w = runnable(w, p)
    k = draw(st.one_of(st.none(), st.floats(2.0, 60.0)))
    n = draw(st.integers(1, 12))
    bs = draw(st.lists(st.integers(1, 64), min_size=n, max_size=n))
    # a vision encoder's seq: tokens per image, and not the unset default (estimator.vision.sized reads that as "the
    # config's image size")
    vision = is_vision(m)
    seqs = st.integers(1 + (geometry(m)["extra_tokens"] if vision else 0), min(8192, m.max_positions))
    ss = draw(st.lists(seqs.filter(lambda s: not vision or s != SEQ_UNSET), min_size=n, max_size=n))
    return m, w, p, Options(activation_k=k), np.array(bs), np.array(ss)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sweep_cases())
def test_sweep_points_equal_estimate(case):
    # The same plans evaluated as one tensor product: equal up to float rounding of sums of exact terms.
    m, w, p, o, bs, ss = case
    got = sweep_points(m, w, bs, ss, p, o)
    # image_size=0: a vision encoder's seq axis is its tokens per image (estimator.sweep.sweep_points)
    want = np.array([_total(m, replace(w, batch=int(b), seq=int(s), image_size=0), p, o) for b, s in zip(bs, ss)])
    assert np.abs(got - want).max() <= ROUNDING_TOL_BYTES


def test_sweep_equals_estimate_where_components_are_truncated():
    # hypothesis found it: TP 2 halves odd byte counts and 8-bit states are fractional; estimate() truncates each
    # component, the sweep rounds the float sum once (5 B apart here, within ROUNDING_TOL_BYTES)
    m, w, p = model("deepseek-v2-lite"), Workload(optimizer="adamw-8bit", batch=1), Parallel(strategy="tp", gpus=2)
    got = sweep_points(m, w, np.array([1]), np.array([932]), p, Options())
    want = _total(m, replace(w, seq=932), p)
    assert abs(int(got[0]) - want) <= ROUNDING_TOL_BYTES


@pytest.mark.slow  # derives profiles for a minute of CPU: the slow tier (WILLITFIT_SLOW=1)
def test_sweep_grid_matches_estimate_everywhere():
    m = model(L8)
    ws = [Workload(method="lora"), Workload(mode="infer", gen_tokens=64), Workload(optimizer="adamw-8bit")]
    ps = [Parallel(), Parallel(strategy="zero2", gpus=4), Parallel(strategy="fsdp", gpus=4)]
    bs, ss = np.array([1, 3, 8, 17]), np.array([64, 200, 333, 345, 1000, 2048, 4095])
    r = sweep(m, ws, ps, bs, ss)
    assert r.total_bytes.shape == (3, 3, 4, 7) and r.total_bytes.dtype == np.int64
    for i, w in enumerate(ws):
        for j, p in enumerate(ps):
            if w.mode == "infer" and p.strategy == "fsdp":
                continue
            for bi, b in enumerate(bs):
                for si, s in enumerate(ss):
                    want = _total(m, replace(w, batch=int(b), seq=int(s)), p)
                    assert abs(int(r.total_bytes[i, j, bi, si]) - want) <= ROUNDING_TOL_BYTES


def test_sweep_crosses_profile_pieces():
    # Mistral-7B's 4096-token sliding window splits its profile at s = 4096, and batch 1 is its own piece: a
    # sweep across both boundaries still equals estimate() point by point.
    m, w = model("mistral-7b"), Workload(mode="infer", gen_tokens=8)
    ss = np.array([1, 17, 512, 4095, 4096, 4097, 5000, 9000])
    for b in (1, 2, 5):
        got = sweep_points(m, w, np.full(ss.shape, b), ss)
        want = np.array([_total(m, replace(w, batch=b, seq=int(s))) for s in ss])
        assert np.abs(got - want).max() <= ROUNDING_TOL_BYTES


def test_sweep_k_form():
    m, w, o = model("bert-large-uncased"), Workload(), Options(activation_k=7.03)
    bs, ss = np.array([1] * 9), np.array([1, 2, 3, 4, 5, 6, 7, 154, 481])
    got = sweep_points(m, w, bs, ss, Parallel(), o)
    want = np.array([_total(m, replace(w, batch=int(b), seq=int(s)), Parallel(), o) for b, s in zip(bs, ss)])
    assert np.abs(got - want).max() <= ROUNDING_TOL_BYTES


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


def _preset(name):
    from estimator.model import from_hf_config
    from estimator.presets import load_config

    return from_hf_config(load_config(name)[1], name)


def _capacity(gpu):
    from estimator.device import capacity_bytes
    from estimator.gpus import get_gpu

    return capacity_bytes(get_gpu(gpu))


def test_a_lora_run_that_does_not_fit_a_24gb_card_is_offered_qlora():
    m, w = _preset("llama-3.1-8b"), Workload(method="lora", seq=2048)
    cap = _capacity("rtx-4090")
    assert _total(m, w) > cap
    qlora = [a for a in advice(m, w, Parallel(), cap, Options(derive=False)) if a.change.get("method") == "qlora"]
    assert qlora and qlora[0].title.startswith("Fine-tune with QLoRA")
    assert not qlora[0].priced or qlora[0].saving_bytes > 0


@pytest.mark.parametrize("name, w", [("llama-3.2-1b", Workload(mode="infer", batch=4, seq=2048)),
                                     ("qwen2.5-0.5b", Workload(method="lora", batch=4, seq=2048))])
def test_advice_that_saves_less_than_a_hundredth_of_a_gib_is_not_shown(name, w):
    # "Cut the sequence length to 2047" saved 0.4 MB; offloading LoRA's optimizer states 4.7 MB: "saves 0.00 GiB"
    shown = advice(_preset(name), w, Parallel(), _capacity("l4"), Options(derive=False))
    assert shown and all(a.saving_bytes >= GiB // 200 for a in shown if a.priced)
    assert not any(a.title == f"Cut the sequence length to {w.seq - 1}" for a in shown)


def test_why_no_fit_names_activations_as_the_cause_and_prices_checkpointing():
    from estimator.search import why_no_fit

    m, cap, w = _preset("llama-3.1-70b"), _capacity("h100-sxm-80gb"), Workload()
    assert min_gpus(m, w, "fsdp", cap, options=Options(derive=False)) is None
    fix = min_gpus(m, replace(w, checkpointing="full"), "fsdp", cap, options=Options(derive=False))
    text = why_no_fit(m, w, "fsdp", cap, options=Options(derive=False))
    assert text.startswith("does not fit on up to 1024 GPUs: at 1024, activations alone are")
    assert "not activations" in text and f"with activation checkpointing (full) it fits on {fix}" in text


def test_sequence_searches_step_by_a_loss_split_in_16_chunks_or_more(monkeypatch):
    # a loss in 16+ chunks is exact on multiples of them, and past a window with a mask priced on those alone
    # (Profile.piece_for refuses the others): the searches propose only such seqs
    from estimator.search import seq_step

    m = model("qwen2.5-7b")   # fused-linear's bound: 152,064 / 3,584 -> inc_factor 43, k = 16
    assert seq_step(m, Workload(loss="chunked", loss_chunks=16), Parallel()) == 16
    assert seq_step(m, Workload(loss="chunked", loss_chunks=32), Parallel()) == 32
    assert seq_step(m, Workload(loss="chunked", loss_chunks=8), Parallel()) == 1    # every seq, as before
    assert seq_step(m, Workload(loss="fused-linear"), Parallel()) == 16
    assert seq_step(m, Workload(loss="chunked", loss_chunks=16), Parallel("fsdp", gpus=8, cp=4)) == 16
    assert seq_step(m, Workload(), Parallel("fsdp", gpus=8, cp=4)) == 8   # ring attention's 2 x cp chunks
    import estimator.search as search

    asked = []
    monkeypatch.setattr(search, "_fits", lambda model, w, p, cap, o: asked.append(w.seq) or w.seq <= 3000)
    w = Workload(loss="chunked", loss_chunks=16, batch=2, seq=4096)
    assert max_seq(m, w, Parallel(), 30 * GiB) == 2992   # the largest multiple of 16 up to 3000
    assert asked and all(x % 16 == 0 for x in asked)


def test_advice_that_moves_fused_sgd_onto_dtensors_prices_its_foreach_step():
    """Fused SGD over FSDP2's or TP's parameters cannot run (estimator.parallel.check_optimizer): the ZeRO-3 row of
    a DDP run with it is priced with the foreach step and says so, where it was dropped without a word."""
    from estimator.search import advice

    m = model("llama-3.1-8b")
    w = Workload(recipe="pure", optimizer="sgd", optimizer_impl="fused", batch=1, seq=1024)
    rows = {a.title: a for a in advice(m, w, Parallel(strategy="ddp", gpus=8), 20 * 2 ** 30, Options(derive=False))}
    zero3 = rows["Shard parameters too: ZeRO-3 over the same 8 GPUs"]
    assert zero3.change == {"optimizer_impl": "foreach", "strategy": "zero3"} and zero3.priced
    assert zero3.note.endswith("priced with its foreach step.")
    assert zero3.saving_bytes > 30 * 2 ** 30
