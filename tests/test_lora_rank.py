"""LoRA's rank as a variable of the profile: one derived profile answers every rank, to the byte.

Every LoRA tensor is linear in r (A: r x in, B: out x r, their gradients and AdamW states, the (b, s, r) product
x @ A^T that autograd saves), so a tick's bytes are P0(b, s, ...) + r * P1(b, s, ...) (estimator.profile.poly
RANK_MONOMIALS). tracer.derive fits them from ranks 8 and 16 and verifies at rank 3; estimator.store keys the
profile without the rank and folds r in (Profile.at_rank). Here: the folding by hand; the store's keys and their
fallback to a per-rank file; a tiny Llama's rank-free profile against full-depth traces at drawn ranks and sizes;
a second rank answered with no derivation; QLoRA (traced as LoRA) the same as from a per-rank profile.

    python -m pytest tests/test_lora_rank.py -q
"""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from estimator import store
from estimator.evaluate import StagePlan
from estimator.profile import poly
from estimator.profile.profile import RANK_MARK, Moment, Piece, Profile
from estimator.spec import Parallel, Workload

TINY = Path(__file__).parent / "data" / "tiny"
LORA = dict(method="lora", recipe="pure", attention="sdpa", lora_targets=("q_proj", "v_proj"))


# ---------------------------------------------------------------- folding r, by hand (no torch)

def _ranked_profile() -> Profile:
    # activations = 5 + 7*b*s + r*(3 + 2*b*s) over den 1; weights = 11*r: at r = 4, b = 2, s = 10:
    # activations 5 + 140 + 4 * (3 + 40) = 317, weights 44
    monos = (poly.ONE, poly.BS) + poly.RANK_MONOMIALS       # 1, b*s, r, b*r, s*r, b*s*r
    num = {"activations": (5, 7, 3, 0, 0, 2), "weights": (0, 0, 11, 0, 0, 0)}
    piece = Piece.from_moments(0, None, [Moment("forward", "forward: tick 0", monos, 1, num)])
    return Profile("h", "llama", {"method": "lora", "lora_rank": RANK_MARK}, {"strategy": "single"}, 1, (piece,))


def test_at_rank_folds_r_into_the_coefficients_exactly():
    prof = _ranked_profile()
    assert prof.rank_variable
    at4 = prof.at_rank(4)
    assert not at4.rank_variable and at4.workload_class["lora_rank"] == 4
    m = at4.pieces[0].moment("forward", 0)
    assert all(poly.rank_degree(x) == 0 for x in m.monomials) and len(m.monomials) == 4  # 1, b*s, b, s
    got = m.bytes_at(2, 10)
    assert (got["activations"], got["weights"]) == (317, 44)
    # the same at a huge rank, in exact integers: 5 + 140 + 65536 * 43 = 2_818_193
    assert at4 is prof.at_rank(4) and prof.at_rank(65536).pieces[0].moment("forward", 0).bytes_at(2, 10)[
        "activations"] == 2_818_193
    # poly.monomial_value and Poly read r the same way (a point's fifth coordinate)
    assert poly.monomial_value(poly.RANK_MONOMIALS[3], (2, 10, 0, 1, 4)) == 80
    assert Moment("forward", "x", (poly.ONE, poly.BS) + poly.RANK_MONOMIALS, 1,
                  {"activations": (5, 7, 3, 0, 0, 2)}).poly("activations")(2, 10, r=4) == 317


def test_a_rank_variable_profile_is_refused_unfolded_and_a_per_rank_one_is_returned_as_it_is():
    prof = _ranked_profile()
    with pytest.raises(ValueError, match="Profile.at_rank"):
        StagePlan(prof.pieces[0], "forward", _NoSwap())
    with pytest.raises(ValueError, match="Profile.at_rank"):
        prof.pieces[0].moment("forward", 0).bytes_at(2, 10)      # r never silently 1
    with pytest.raises(ValueError, match="^lora_rank: 0"):
        prof.at_rank(0)
    legacy = Profile("h", "llama", {"method": "lora", "lora_rank": 8}, {"strategy": "single"}, 1, prof.pieces)
    assert legacy.at_rank(64) is legacy


class _NoSwap:
    composed = False
    sharded_off, gathered_weights = (), 1.0   # (FSDP2's offload and a stored base: evaluate.Swap._fsdp_rank)

    def activation_scale(self, monos):
        return np.ones(len(monos))

    def rules(self, stage):
        return ()


def test_the_class_leaves_the_rank_out_for_lora_only_and_the_legacy_key_comes_second():
    p = Parallel()
    w8, w64 = Workload(method="lora", lora_rank=8), Workload(method="lora", lora_rank=64)
    assert store.workload_class(w8)["lora_rank"] == RANK_MARK
    assert store.profile_key(w8, p) == store.profile_key(w64, p)          # one profile for every rank
    k8, k64 = store.profile_keys(w8, p), store.profile_keys(w64, p)
    assert k8[0] == k64[0] and k8[1] != k64[1] and len(k8) == 2       # then the per-rank file of that rank
    assert store.workload_class(w8, rank_variable=False)["lora_rank"] == 8
    full = Workload()
    assert store.workload_class(full)["lora_rank"] == 8 and store.profile_keys(full, p) == (store.profile_key(full, p),)


def test_a_shipped_per_rank_lora_profile_still_answers(tmp_path, monkeypatch):
    # LoRA profiles were derived for rank 8 before the rank was a variable. Every preset ships a rank-free one since
    # 2026-11-29, and gemma-3-4b keeps its rank-8 file beside it: with that file alone shipped (a bank or a copy from
    # before), the lookup falls back to it (no derivation) and it is evaluated as it is
    from estimator.estimate import traced_class
    from estimator.presets import load_config
    from strategies import attention, lora_targets, model

    name, cfg = load_config("gemma-3-4b")
    m = model(name)
    w = Workload(method="lora", lora_targets=lora_targets(m), attention=attention(m))
    tw, tp, _ = traced_class(w, Parallel())
    per_rank = store.profile_keys(tw, tp)[1]
    h = store.config_hash(cfg)[:16]
    (tmp_path / "shipped" / h).mkdir(parents=True)
    for f in (f"{per_rank}.json", "inventory.json"):
        (tmp_path / "shipped" / h / f).write_bytes((store.SHIPPED_DIR / h / f).read_bytes())
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    store.clear_memo()
    key = store.stored_key(cfg, tw, tp)
    assert key == per_rank and store.where(cfg, key=key) == "shipped"
    prof = store.profile(cfg, tw, tp, name=name, derive=False)
    assert not prof.rank_variable and prof.workload_class["lora_rank"] == 8
    assert store.stored_key(cfg, replace(tw, lora_rank=64), tp) is None  # another rank: derived (rank-free)
    store.clear_memo()


def test_the_bank_checks_a_rank_free_file_against_its_address(monkeypatch, tmp_path):
    # a rank-free profile is the rank-free key's file: under a per-rank key (another class) it is skipped with one
    # line, under its own key it is taken, kept in the cache and folded at the asked rank
    from estimator import bank

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 99, "rank-bank": 1}
    h = store.config_hash(cfg)
    w, p = Workload(method="lora", lora_rank=4), Parallel()
    free_key, legacy_key = store.profile_keys(w, p)
    src = _ranked_profile()
    prof = Profile(h, "llama", store.workload_class(w), store.parallel_class(p), 1, src.pieces, {"kernels": "cuda"})
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(bank.ENV_VAR, f"memory://rank-bank-{tmp_path.name}")
    store.clear_memo()
    assert bank.put(bank.url(), h[:16], f"{legacy_key}.json", prof.to_json()) == "added"
    heard = []
    with pytest.raises(store.ProfileMissing):
        store.profile(cfg, w, p, derive=False, progress=lambda d, t, m: heard.append(m))
    assert any("skipped" in m and legacy_key in m for m in heard), heard
    assert bank.put(bank.url(), h[:16], f"{free_key}.json", prof.to_json()) == "added"
    got = store.profile(cfg, w, p, derive=False)
    assert got.workload_class["lora_rank"] == 4 and got.pieces[0].moment("forward", 0).bytes_at(2, 10)[
        "activations"] == 317
    assert store.stored_key(cfg, w, p) == free_key   # now in the local cache
    store.clear_memo()


def test_bench_derive_keeps_one_class_per_rank_where_a_per_rank_file_may_answer():
    # `python -m bench derive --lora-rank 8,32`: rank 8 may be answered by a shipped per-rank file, which says
    # nothing of rank 32, so both classes stay (each then reads the rank-free file, a per-rank one, or derives)
    from types import SimpleNamespace

    from bench.commands.derive import _classes

    cases = [SimpleNamespace(model_name="m", workload=Workload(method="lora", lora_rank=r), parallel=Parallel())
             for r in (8, 32, 8)] + [SimpleNamespace(model_name="m", workload=Workload(lora_rank=r),
                                                     parallel=Parallel()) for r in (8, 8)]
    assert [(c.workload.method, c.workload.lora_rank) for c in _classes(cases)] == [("lora", 8), ("lora", 32),
                                                                                      ("full", 8)]


# ---------------------------------------------------------------- against full-depth traces (torch)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.trace.cases import trace_case  # noqa: E402
from estimator.estimate import Options, estimate  # noqa: E402
from estimator.model import from_hf_config  # noqa: E402
from tracer.derive import derive_profile  # noqa: E402
from tracer.lora import LORA_RANKS  # noqa: E402


def _config() -> dict:
    return json.loads((TINY / "t-llama.json").read_text())


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    """The tiny Llama's rank-free LoRA profile, derived once, in a cache of its own (the store reads it there)."""
    cache = tmp_path_factory.mktemp("rank-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("WILLITFIT_CACHE", str(cache))
    store.clear_memo()
    cfg, w = _config(), Workload(**LORA)
    store.inventory(cfg, "tiny")
    prof = store.stored_profile(cfg, w, Parallel(), name="tiny")     # derived on the miss: rank-free
    yield cfg, prof, cache
    mp.undo()
    store.clear_memo()


def _stage_peaks(cfg, w: Workload, options=Options()) -> tuple[dict, dict]:
    est = estimate(from_hf_config(cfg, "tiny"), w, Parallel(), options)
    assert not est.notes, est.notes
    got = {name: b.tensor_bytes for name, b in est.stages}
    row = trace_case(cfg, "tiny", w)
    return got, {name: row[f"{name}_peak_alloc_bytes"] for name in got}


def test_the_derivation_is_rank_free_and_verified_at_a_third_rank(ranked):
    cfg, prof, cache = ranked
    assert prof.rank_variable and prof.provenance["lora_ranks"] == {"fit": list(LORA_RANKS), "verified": 3}
    assert any(poly.rank_degree(tuple(m)) for p in prof.pieces for d in p.stage_data.values() for m in d["monomials"])
    key = store.profile_key(Workload(**LORA), Parallel())
    assert (cache / store.config_hash(cfg)[:16] / f"{key}.json").is_file()


def test_seeded_ranks_and_sizes_equal_a_full_depth_trace(ranked):
    # ranks the fit never saw (1 and odd ones, up to 4096), sizes it never traced: every stage peak to the byte
    cfg, _, _ = ranked
    rng = random.Random(20261125)
    draws = [(1, 2, 64)] + [(rng.choice([rng.randint(2, 31), rng.randint(33, 512), rng.randint(513, 4096)]),
                             rng.randint(1, 4), rng.randint(17, 300)) for _ in range(2)]
    for r, b, s in draws:
        got, traced = _stage_peaks(cfg, Workload(**LORA, lora_rank=r, batch=b, seq=s), Options(derive=False))
        assert got == traced, (r, b, s)


def test_a_second_rank_reuses_the_profile_without_deriving(ranked, monkeypatch):
    cfg, prof, _ = ranked
    store.clear_memo()
    calls = []
    monkeypatch.setattr(store, "_derivation", lambda: calls.append(1))   # any derivation would fail loudly
    model = from_hf_config(cfg, "tiny", derive=False)
    a = estimate(model, Workload(**LORA, lora_rank=8, batch=2, seq=64), Parallel(), Options(derive=False))
    b = estimate(model, Workload(**LORA, lora_rank=96, batch=2, seq=64), Parallel(), Options(derive=False))
    assert not calls and b.allocated_bytes > a.allocated_bytes
    stored = store.stored_profile(cfg, Workload(**LORA, lora_rank=96), Parallel(), derive=False)
    assert stored.rank_variable and stored.to_json() == prof.to_json()


def test_qlora_at_any_rank_equals_its_per_rank_profile(ranked, tmp_path, monkeypatch):
    # QLoRA is traced as LoRA with bf16 base weights (estimate.traced_class): the rank-free profile at rank r and a
    # profile derived for rank r alone give the same QLoRA estimate, field by field
    cfg, _, _ = ranked
    r = 24
    w = Workload(method="qlora", weight_format="nf4", recipe="pure", attention="sdpa",
                 lora_targets=("q_proj", "v_proj"), lora_rank=r, batch=3, seq=80)
    model = from_hf_config(cfg, "tiny", derive=False)
    store.clear_memo()
    from_free = estimate(model, w, Parallel(), Options(derive=False))
    tw = Workload(**LORA, lora_rank=r)
    legacy = derive_profile(cfg, tw, Parallel(), rank_variable=False)
    assert not legacy.rank_variable and legacy.workload_class["lora_rank"] == r
    d = tmp_path / store.config_hash(cfg)[:16]
    d.mkdir(parents=True)
    (d / f"{store.profile_keys(tw, Parallel())[1]}.json").write_text(legacy.to_json())
    (d / "inventory.json").write_text(store.local_text(cfg, "inventory.json"))
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))   # only the per-rank file there: the fallback reads it
    store.clear_memo()
    from_legacy = estimate(model, w, Parallel(), Options(derive=False))
    assert [(n, b) for n, b in from_free.stages] == [(n, b) for n, b in from_legacy.stages]
    assert from_free.notes and from_free.allocated_bytes == from_legacy.allocated_bytes
    store.clear_memo()


@pytest.mark.slow
def test_more_ranks_and_sizes_equal_a_full_depth_trace(ranked):
    cfg, _, _ = ranked
    rng = random.Random()
    for _ in range(8):
        r, b, s = rng.randint(1, 2048), rng.randint(1, 6), rng.randint(1, 400)
        got, traced = _stage_peaks(cfg, Workload(**LORA, lora_rank=r, batch=b, seq=s), Options(derive=False))
        assert got == traced, (r, b, s)



@pytest.mark.slow
def test_fsdp_rank_free_profile_equals_a_trace_where_the_shards_divide_the_rank(tmp_path, monkeypatch):
    # FSDP shards the adapters too (r/n): fit at ranks 8, 16 on 2 and 4 ranks, verified at rank 24 on 8. At rank 40
    # on 4 GPUs (40 rows of A split evenly) every stage equals the traced rank 0 to the byte; a rank the shard count
    # does not divide is low by FSDP2's row padding (docs/estimator.md)
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    store.clear_memo()
    cfg, par = _config(), Parallel(strategy="fsdp", gpus=4)
    prof = store.stored_profile(cfg, Workload(**LORA), par, name="tiny")
    assert prof.rank_variable and prof.provenance["lora_ranks"] == {"fit": list(LORA_RANKS), "verified": 24}
    w = Workload(**LORA, lora_rank=40, batch=2, seq=64)
    est = estimate(from_hf_config(cfg, "tiny"), w, par, Options(derive=False))
    got = {name: b.tensor_bytes for name, b in est.stages}
    row = trace_case(cfg, "tiny", w, par)
    assert got == {name: row[f"{name}_peak_alloc_bytes"] for name in got}
    store.clear_memo()


def test_folding_r_is_the_same_integers_in_int64_and_in_python():
    """profile._fold folds r^k into the numerators in int64 where no sum can overflow, else in Python's integers."""
    from estimator.profile.profile import CATEGORIES, _fold

    k, width, where, power = 3, 2, [0, 1, 1], [1, 16, 256]
    n = len(CATEGORIES) * k
    small = [[(i * 7919 + j * 104729) % 2 ** 40 - 2 ** 39 for j in range(n)] for i in range(4)]
    want = [[sum(row[c * k + i] * power[i] for i in range(k) if where[i] == t) for c in range(len(CATEGORIES))
             for t in range(width)] for row in small]
    assert _fold(small, where, power, k, width) == want
    huge = [[v * 2 ** 40 for v in row] for row in small]   # past int64 once scaled: Python's integers
    assert _fold(huge, where, power, k, width) == [[v * 2 ** 40 for v in row] for row in want]
