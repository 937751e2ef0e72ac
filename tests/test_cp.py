"""Context parallelism (estimator.cp, tracer.cp): one-line refusals before any trace, and each derived CP rank's
estimate equal to a full-depth trace of that rank at a size and world its fit did not use (the slow tier runs
scripts/parallel_check.py's cp cases, which trace every rank)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator import cp
from estimator.cli import main as cli_main
from estimator.estimate import Options, ensure_profile, estimate, resolve
from estimator.evaluate import stage_breakdowns
from estimator.model import from_hf_config
from estimator.search import max_seq
from estimator.spec import Parallel, Workload
from estimator.store import parallel_class

TINY = json.loads((Path(__file__).parent / "data" / "tiny" / "t-llama.json").read_text())


@pytest.mark.parametrize("kwargs, field", [
    (dict(strategy="ddp", gpus=4, cp=2), "cp"),
    (dict(strategy="zero2", gpus=8, cp=2), "cp"),
    (dict(strategy="fsdp", gpus=8, pp=2, cp=2), "cp"),
    (dict(strategy="fsdp", gpus=8, ep=2, cp=2), "cp"),
    (dict(strategy="fsdp", gpus=6, cp=4), "gpus"),
    (dict(strategy="fsdp", gpus=8, cp=0), "cp"),
])
def test_a_layout_cp_cannot_price_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        Parallel(**kwargs)
    assert str(e.value).startswith(f"{field}:") and "\n" not in str(e.value)


@pytest.mark.parametrize("w, field", [
    (Workload(batch=2, seq=300), "seq"),                           # not a multiple of 2 x cp = 8
    (Workload(mode="infer", batch=2, seq=256), "cp"),
    (Workload(batch=2, seq=256, attention="eager"), "attention"),
    (Workload(batch=2, seq=256, activation_offload=True), "activation_offload"),
])
def test_a_workload_cp_cannot_price_is_refused_before_any_trace(w, field, tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    model = from_hf_config(TINY, "t-llama", derive=True)
    with pytest.raises(ValueError) as e:
        estimate(model, w, Parallel("fsdp", gpus=8, cp=4))
    assert str(e.value).startswith(f"{field}:") and "\n" not in str(e.value)
    assert not [f for f in tmp_path.rglob("*.json") if f.name != "inventory.json"]   # no profile was derived


@pytest.mark.parametrize("tiny, message", [
    ("t-bert", "cp: torch's ring attention balances causal attention only"),     # an encoder, before any trace
    ("t-gemma2", "attention: the step would run eager attention"),              # no SDPA path in transformers
    ("t-falcon", "cp: this step does not run under torch's context_parallel"),  # SDPA with a mask: first trace
])
def test_a_model_whose_attention_the_ring_cannot_run_is_one_line(tiny, message, tmp_path, monkeypatch):
    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    config = json.loads((Path(__file__).parent / "data" / "tiny" / f"{tiny}.json").read_text())
    with pytest.raises(ValueError) as e:
        estimate(from_hf_config(config, tiny), Workload(batch=2, seq=256), Parallel("fsdp", gpus=4, cp=2))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_fsdp_group_spans_dp_shard_times_cp_and_the_class_names_the_rank():
    p = Parallel("fsdp", gpus=16, cp=4)
    assert p.dp_size == 4   # the ranks that take different batches
    from estimator.parallel import shard_group
    assert shard_group(p) == 16   # torchtitan's fsdp mesh: dp_shard x cp
    assert cp.traced(p) == Parallel("fsdp", gpus=8, cp=4)
    assert parallel_class(cp.traced(p), 3) == {"strategy": "fsdp", "cp": 4, "rank": 3}
    assert parallel_class(Parallel("fsdp", gpus=2)) == {"strategy": "fsdp"}   # plain FSDP's class is unchanged
    with pytest.raises(ValueError, match="^pp_rank: 4 is not a rank"):
        parallel_class(cp.traced(p), 4)
    assert cp.ranks(4) == (0, 3) and cp.rank_labels(2) == ("cp rank 0", "cp rank 1")
    from estimator.store import class_ranks
    assert class_ranks(cp.traced(p)) == (0, 3) and class_ranks(Parallel("fsdp", gpus=2)) == (0,)
    assert class_ranks(Parallel("pp", gpus=4)) == (0, 1, 2, 3)


@pytest.fixture(scope="module")
def cp2_model(tmp_path_factory):
    """t-llama with both CP ranks of cp 2 derived into a cache of its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WILLITFIT_CACHE", str(tmp_path_factory.mktemp("cp-cache")))
        model = from_hf_config(TINY, "t-llama", derive=True)
        ensure_profile(model, Workload(batch=2, seq=256), Parallel("fsdp", gpus=4, cp=2))   # both ranks
        yield model


def test_each_derived_cp_rank_equals_a_full_depth_trace_of_that_rank(cp2_model):
    from tracer.session import run_traced

    # the fit traced dp_shard 1 and 2 (n = 2, 4), batches 1-4 and seqs up to ~1000; checked at dp_shard 4 (n = 8)
    # and batch 5 x seq 300, neither of which it used (n = 8 is its verify world, so also a dp_shard of 8: n = 16)
    w, p = Workload(batch=5, seq=300), Parallel("fsdp", gpus=16, cp=2)
    tw, _, _, pairs = resolve(cp2_model, w, p, Options())
    assert [sh.stage for sh, _ in pairs] == ["cp rank 0", "cp rank 1"]
    peaks = []
    for rank, (sh, prof) in zip(cp.ranks(2), pairs):
        assert prof.parallel_class == {"strategy": "fsdp", "cp": 2, "rank": rank}
        ours = stage_breakdowns(cp2_model, prof, w, p, tw, sh, Options())
        trace = run_traced(TINY, w, p, rank=rank)
        for peak in trace.log.stages:
            assert ours[peak.stage][1].tensor_bytes == sum(peak.breakdown.values()), (rank, peak.stage)
        peaks.append(trace.log.peak.peak_bytes)
    est = estimate(cp2_model, w, p)
    assert est.components.tensor_bytes == max(peaks)   # the worse rank decides
    assert est.pipeline_stage == ("cp rank 0", "cp rank 1")[peaks.index(max(peaks))]
    assert any(n.startswith("cp: context parallelism 2") for n in est.notes)
    # a CP rank holds about the step at seq / cp, far less than one GPU at the whole seq
    one = estimate(cp2_model, w, Parallel("fsdp", gpus=16))
    assert est.components.activations < 0.75 * one.components.activations


def test_hsdp_with_cp_holds_what_fsdp_over_its_shard_group_times_cp_holds(cp2_model):
    """torchtitan's HSDP x CP: replicated over dp_replicate, FSDP2 over dp_shard x cp; priced as FSDP x CP over that
    group (the replicas hold the same, as HSDP alone does: tests/test_pp.py)."""
    w = Workload(batch=3, seq=512)
    hsdp = Parallel("hsdp", gpus=16, cp=2, hsdp_shard=2)   # 4 replicas of a 2 x 2 (dp_shard x cp) group
    from estimator.parallel import shard_group
    assert shard_group(hsdp) == 4 and hsdp.dp_size == 8
    a, b = estimate(cp2_model, w, hsdp), estimate(cp2_model, w, Parallel("fsdp", gpus=4, cp=2))
    assert a.stages == b.stages and a.pipeline_stage == b.pipeline_stage


def test_max_seq_under_cp_is_a_multiple_of_two_cp(cp2_model):
    w, p = Workload(batch=2, seq=256), Parallel("fsdp", gpus=4, cp=2)
    at = estimate(cp2_model, w, p).total_bytes
    s = max_seq(cp2_model, w, p, at, limit=1000)
    assert s % 4 == 0 and s >= 256
    assert estimate(cp2_model, Workload(batch=2, seq=s), p).total_bytes <= at


def test_the_cli_takes_cp_and_says_which_rank(cp2_model, capsys, tmp_path):
    cfg = tmp_path / "t-llama.json"
    cfg.write_text(json.dumps(TINY))
    # the fixture's cache holds both ranks' profiles: --no-derive answers from them
    assert cli_main(["--model", str(cfg), "--strategy", "fsdp", "--gpus", "4", "--cp", "2", "--batch", "2",
                     "--seq", "256", "--no-derive"]) == 0
    out = capsys.readouterr().out
    assert "4 GPU(s), strategy fsdp (cp 2)" in out
    assert "Per GPU at the peak (backward, cp rank" in out
    # torchtitan's HSDP x CP: 2 replicas x (dp_shard 1 x cp 2), priced from the same two ranks' profiles
    assert cli_main(["--model", str(cfg), "--dp-shard", "1", "--dp-replicate", "2", "--cp", "2", "--batch", "2",
                     "--seq", "256", "--no-derive"]) == 0
    assert "4 GPU(s), strategy hsdp (cp 2)" in capsys.readouterr().out
    # torchtitan's flags: world = dp_shard x cp; a seq the load balancer cannot cut is one line, before any trace
    assert cli_main(["--model", str(cfg), "--dp-shard", "2", "--cp", "2", "--batch", "2", "--seq", "250"]) == 2
    err = capsys.readouterr().err
    assert "seq: 250 is not a multiple of 2 x cp = 4" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_parallel_check_cp_cases_are_exact_and_no_rank_holds_more_than_the_derived_ones(tmp_path, monkeypatch,
                                                                                         capsys):
    from scripts.parallel_check import main as parallel_check

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))
    assert parallel_check(["--case", "fsdp16-cp2-train", "--case", "fsdp32-cp4-train-gqa", "--case",
                           "fsdp4-cp4-train-mixed-ckpt", "--case", "fsdp8-cp2-tp2-train", "--case",
                           "fsdp8-cp4-tp2-sp-train-mixed", "--quiet"]) == 0
    assert "5 of 5 cases exact" in capsys.readouterr().out


def test_cp_with_tp_inside_traces_each_cp_rank_in_one_process():
    """FSDP x CP x TP (+ sequence parallelism) on torchtitan's (dp_shard, cp, tp) mesh: the two CP ranks live on
    different TP groups ([0, 1] and [2, 3]), so DTensor's cached shardings of the first world must not reach the
    second (tracer.tp.forget_meshes); a TP rank holds less than the CP rank without TP."""
    from tracer.session import run_traced

    w = Workload(batch=2, seq=256)
    sp = Parallel("fsdp", gpus=8, cp=2, tp=2, sequence_parallel=True)
    first, second = (run_traced(TINY, w, sp, rank=r) for r in (1, 0))
    assert second.per_rank["traced_rank"] == 0 and first.per_rank["traced_rank"] == 2   # CP rank 1 is world rank 2
    assert any("TP 2 inside (apply_tp, sequence parallel)" in n for n in first.notes)
    alone = run_traced(TINY, w, Parallel("fsdp", gpus=4, cp=2), rank=0)
    assert second.log.peak.peak_bytes < alone.log.peak.peak_bytes


def test_advice_splits_a_long_sequence_with_cp_and_prices_it_from_shipped_profiles(monkeypatch, tmp_path):
    """A long-sequence FSDP run that does not fit: "What would help" proposes context parallelism over the same GPUs,
    priced from llama-3.2-1b's shipped cp 2 rank profiles (no derivation: Options(derive=False))."""
    from estimator.presets import load_config
    from estimator.search import advice

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))   # nothing cached: shipped profiles only
    name, config = load_config("llama-3.2-1b")
    model, w, p = from_hf_config(config, name), Workload(seq=4096), Parallel("fsdp", gpus=2)
    options = Options(derive=False)
    now = estimate(model, w, p, options).total_bytes
    rows = advice(model, w, p, now - 1, options)
    row = next(a for a in rows if a.change == {"cp": 2})
    with_cp = estimate(model, w, Parallel("fsdp", gpus=2, cp=2), options)
    assert row.priced and row.new_total_bytes == with_cp.total_bytes and row.saving_bytes == now - with_cp.total_bytes
    assert row.title == "Split each sequence over 2 GPUs (context parallelism 2)" and row.fits
    # short sequences and one GPU get no CP row; nor do inference, ddp, a degree whose chunks do not divide seq
    for w2, p2 in ((Workload(seq=2048), p), (w, Parallel())):
        assert not any(a.change.get("cp", 1) > 1 for a in advice(model, w2, p2, now - 1, options))
    from estimator.search import _cp_degree
    assert _cp_degree(Workload(mode="infer", seq=4096), p) == 0 and _cp_degree(w, Parallel("ddp", gpus=2)) == 0
    assert _cp_degree(Workload(seq=4100), Parallel("fsdp", gpus=8)) == 2        # 4100 = 4 x 1025: 2 x cp = 4 only
    assert _cp_degree(Workload(seq=8192), Parallel("fsdp", gpus=16, tp=2)) == 8
    # HSDP: a degree whose shard group no longer divides the data-parallel ranks is skipped, not raised
    assert _cp_degree(Workload(seq=8192), Parallel("hsdp", gpus=8, hsdp_shard=4)) == 2


def test_bench_trace_never_stores_or_finds_a_row_for_a_layout_rows_cannot_tell_apart(tmp_path, capsys):
    """A run row names the strategy and world size only: a CP (or FSDP x TP, SP, pipeline schedule) rank would be
    stored as plain FSDP, so --out is refused in one line, and the database's plain-FSDP row is never shown for it."""
    from bench.__main__ import main as bench_main
    from bench.trace.cases import unstorable

    cfg = tmp_path / "t-llama.json"
    cfg.write_text(json.dumps(TINY))
    argv = ["trace", "--model", str(cfg), "--batch", "2", "--seq", "256", "--strategy", "fsdp", "--gpus", "4"]
    assert bench_main([*argv, "--cp", "2", "--out", str(tmp_path / "rows.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("fsdp on 4 GPUs with cp 2 would be stored as plain fsdp; trace it without --out / "
                            "--ingest (the table is printed)") and not (tmp_path / "rows.jsonl").exists()
    assert unstorable(Parallel("fsdp", gpus=4)) is None and unstorable(Parallel("tp", gpus=4)) is None
    assert unstorable(Parallel("pp", gpus=4)) is None
    assert "tp 2, sequence parallelism" in unstorable(Parallel("fsdp", gpus=4, tp=2, sequence_parallel=True))
    assert "pipeline schedule gpipe" in unstorable(Parallel("pp", gpus=2, pp_schedule="gpipe"))


def test_layouts_rank_cp_layouts_whose_rank_profiles_are_on_disk(monkeypatch, tmp_path):
    from estimator.layouts import layouts
    from estimator.presets import load_config

    monkeypatch.setenv("WILLITFIT_CACHE", str(tmp_path))   # shipped profiles only: llama-3.2-1b's cp 2 ranks
    name, config = load_config("llama-3.2-1b")
    model, w, options = from_hf_config(config, name), Workload(), Options(derive=False)
    rows = {lay.label: lay for lay in layouts(model, w, 8, 80 << 30, options)}
    lay = rows["FSDP 4 x CP 2 x TP 1"]
    est = estimate(model, w, Parallel("fsdp", gpus=8, cp=2), options)
    assert lay.device_bytes == est.total_bytes and lay.priced == "traced per rank" and lay.cp == 2
    assert lay.worst_rank == est.pipeline_stage and lay.worst_rank.startswith("cp rank")
    assert "FSDP 2 x CP 4 x TP 1" not in rows   # cp 4 is not on disk: ranking derives nothing
    assert lay.device_bytes < rows["FSDP 8 x TP 1 x PP 1"].device_bytes
