"""`bench.accuracy.report` and the `report` / `accuracy` commands, on temporary databases.

Two databases: a few rowfactory rows (synthetic peaks, traced and measured) whose errors are recomputed here
by hand from estimate() and the peers, and ten real traced runs of the tiny configs in tests/data/tiny
(three families, so that every leave-one-architecture-out fit has other families to learn from).
"""
from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest

from bench.accuracy import measured as measured_tier
from bench.accuracy import report as accuracy

from bench.commands import accuracy as cmd_accuracy
from bench.__main__ import COMMANDS, main
from bench.store.ingest import ingest_files
from offline import peers
from estimator.device import context_bytes
from estimator.estimate import Options, estimate
from estimator.gpus import get_gpu
from estimator.model import from_hf_config
from estimator.spec import Workload
from rowfactory import TINY_LLAMA_CONFIG, make_row

TINY = "tests/data/tiny"


def _ingest(tmp_path, rows, name="runs") -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    db_path = tmp_path / f"{name}.duckdb"
    ingest_files([path], db_path)
    return str(db_path)


def _synthetic_rows() -> list[dict]:
    """Three traced rows of the tiny Llama (batch 1, 2, 4) and one measured row, plus an OOM row."""
    rows = [make_row(batch=b, peak_alloc_bytes=p, forward_peak_alloc_bytes=p - 100_000)
            for b, p in ((1, 2_500_000), (2, 3_100_000), (4, 4_000_000))]
    rows.append(make_row(source="measured", gpu_name="NVIDIA H100 80GB HBM3", batch=2, peak_alloc_bytes=40_000_000,
                         peak_reserved_bytes=44_040_192, nvml_used_bytes=600_000_000, forward_peak_alloc_bytes=39_000_000))
    rows.append(make_row(batch=8, oom=True, oom_stage="forward", peak_alloc_bytes=None))
    return rows


@pytest.fixture(scope="module")
def synthetic_db(tmp_path_factory):
    return _ingest(tmp_path_factory.mktemp("acc_syn"), _synthetic_rows())


@pytest.fixture(scope="module")
def traced_db(tmp_path_factory):
    """Ten real traced runs: tiny Llama (full, LoRA, inference) and tiny GPT-2 / GPT-NeoX (full), and their
    profiles on disk (what the app, which never derives, reads): a test of the summary then does not depend on
    another test of this worker having derived them first."""
    d = tmp_path_factory.mktemp("acc_traced")
    out, db_path = str(d / "runs.jsonl"), str(d / "traced.duckdb")
    common = ["--batch", "1,2", "--seq", "32", "--out", out, "--db", db_path]
    assert main(["trace", "--model", f"{TINY}/t-llama.json", "--mode", "train,infer", "--method", "full,lora",
                 *common]) == 0
    assert main(["trace", "--model", f"{TINY}/t-gpt2.json,{TINY}/t-neox.json", *common, "--ingest"]) == 0
    accuracy.evaluate(accuracy.load_runs(db_path))   # derives each run's profile into the session's cache
    return db_path


# ------------------------------------------------------------------------------------------ numbers


def test_summary_equals_a_direct_computation(synthetic_db):
    ev = accuracy.evaluate(accuracy.load_runs(synthetic_db))
    model = from_hf_config(TINY_LLAMA_CONFIG, "tiny-llama")
    # traced tier: ours = total - overhead (no context, no cuBLAS workspace); truth = peak_alloc_bytes
    errs = []
    for b, truth in ((1, 2_500_000), (2, 3_100_000), (4, 4_000_000)):
        est = estimate(model, Workload(batch=b, seq=128))
        errs.append(abs((est.components.tensor_bytes - truth) / truth))
    s = accuracy.summarize(ev.errors)
    row = s[(s.method == "ours") & (s.tier == "traced") & (s["mode"] == "train-full")].iloc[0]
    assert row.n == 3  # the OOM row is left out
    assert row["median"] == pytest.approx(np.median(errs), rel=1e-12)
    assert row["worst"] == pytest.approx(max(errs), rel=1e-12)
    assert row["p90"] == pytest.approx(np.percentile(errs, 90), rel=1e-12)
    # a peer, recomputed from its rule: seed 000 at batch 1
    seed = ev.errors[(ev.errors.method == "seed000") & (ev.errors.batch == 1)].iloc[0]
    pred = peers.seed000_will_it_fit_bytes(model.params, "bf16", True, "adam", 1, 128, 64, 2)
    assert seed.pred_bytes == pred and seed.rel_err == pytest.approx((pred - 2_500_000) / 2_500_000, rel=1e-12)


def test_measured_row_is_scored_in_three_tiers(synthetic_db):
    ev = accuracy.evaluate(accuracy.load_runs(synthetic_db))
    m = ev.errors[(ev.errors.source == "measured") & (ev.errors.method == "ours")].set_index("tier")
    est = estimate(from_hf_config(TINY_LLAMA_CONFIG), Workload(batch=2, seq=128))
    allocated = est.components.tensor_bytes + est.allocator_overhead_bytes  # + cuBLAS workspace
    assert m.loc["measured-allocated", "pred_bytes"] == allocated
    assert m.loc["measured-allocated", "truth_bytes"] == 40_000_000
    assert m.loc["measured-reserved", "pred_bytes"] == est.reserved_bytes > allocated  # + the allocator's cache
    assert m.loc["measured-reserved", "truth_bytes"] == 44_040_192
    # the device tier prices the row on its own GPU: torch's name resolves to the H100 preset, whose CUDA context
    # and kernel images are measured (data/cuda_context.json), not the file's default
    on_h100 = estimate(from_hf_config(TINY_LLAMA_CONFIG), Workload(batch=2, seq=128), options=Options(gpu="h100"))
    assert m.loc["measured-device", "pred_bytes"] == on_h100.device_bytes == on_h100.total_bytes
    assert on_h100.device_bytes - est.device_bytes == context_bytes(get_gpu("h100")) - context_bytes(None) > 0
    assert m.loc["measured-device", "truth_bytes"] == 600_000_000
    # one family only: no other family to learn k from, so no calibrated prediction at all
    assert all(f.fit is None and f.run_ids == () for f in ev.fits.values())
    assert "ours-calibrated" not in set(ev.errors.method)


def test_loao_never_uses_the_held_out_family(traced_db):
    runs = accuracy.load_runs(traced_db)
    ev = accuracy.evaluate(runs)
    family_of = dict(zip(ev.errors.run_id, ev.errors.family))
    assert {f.family for f in ev.fits.values()} == {"llama", "gpt2", "gpt_neox"}
    for (fam, _, _), fit in ev.fits.items():
        assert fit.fit is not None and fit.run_ids
        used = {family_of[r] for r in fit.run_ids}
        assert fam not in used and used  # only the other families' runs
        # every other family's training run except CPU-artefact traces (bench.accuracy.calibrate.cpu_math_sdpa)
        assert len(fit.run_ids) == sum(1 for r in family_of if family_of[r] != fam
                                       and (ev.errors[ev.errors.run_id == r]["mode"] != "infer").all()
                                       and not (ev.errors[ev.errors.run_id == r]["cause"]
                                                .str.contains("cpu-math-sdpa")).any())
    # the calibrated estimate of a llama run uses exactly the k fitted on gpt2 + gpt_neox
    cases, _ = accuracy.cases_of(runs)
    pts = accuracy.points_of(cases)
    others = pts[pts.family != "llama"]
    k = float(np.dot(others.x, others.y) / np.dot(others.x, others.x))
    assert ev.fits[("llama", "sdpa", "none")].fit.k == pytest.approx(k, rel=1e-9)


def test_coverage_counts_truths_inside_the_interval(traced_db):
    ev = accuracy.evaluate(accuracy.load_runs(traced_db))
    cal = ev.errors[ev.errors.method == "ours-calibrated"]
    cov = accuracy.coverage(ev.errors)
    inside = ((cal.pi_low_bytes <= cal.truth_bytes) & (cal.truth_bytes <= cal.pi_high_bytes)).sum()
    assert cov["n"].sum() == len(cal) and cov["inside"].sum() == inside
    assert (cal.pi_high_bytes > cal.pred_bytes).all() and (cal.pi_low_bytes < cal.pred_bytes).all()


def test_known_cause_flags_sdpa_dropout_traces(traced_db):
    ev = accuracy.evaluate(accuracy.load_runs(traced_db))
    ours = ev.errors[ev.errors.method == "ours"]
    flagged = set(ours[ours.cause == "cpu-math-sdpa"].model_name)
    # GPT-2's default attn_pdrop is 0.1, but the tracer now runs CUDA's SDPA kernels (flash applies the dropout
    # in-kernel, tracer.kernels) and says so in the notes: such rows are not CPU artefacts any more
    assert flagged == set()
    runs = accuracy.load_runs(traced_db)
    gpt2 = runs[runs.model_name == "t-gpt2"]
    assert len(gpt2) and gpt2.notes.str.contains("kernels cuda").all()
    # a row traced before that (no note) is still recognised as the math-kernel artefact
    from bench.accuracy import calibrate
    from estimator.model import from_hf_config as build
    row = gpt2.iloc[0].to_dict()
    model = build(json.loads(row["config_json"]), "t-gpt2")
    w = calibrate.workload_from_row(row)
    assert calibrate.cpu_math_sdpa("traced", model, w, "traced on fake CPU tensors")
    assert not calibrate.cpu_math_sdpa("traced", model, w, row["notes"])
    t = accuracy.targets(ev.errors)
    assert set(t.met) <= {"yes", "no", "no data"}
    assert (t[t.tier.str.startswith("measured")].met == "no data").all()


def test_accuracy_summary_for_the_app(traced_db):
    s = accuracy.accuracy_summary(traced_db)
    assert tuple(s.columns) == accuracy.SUMMARY_COLUMNS
    assert set(s.tier) == {"traced"} and {"ours", "ours-calibrated", "seed000", "accelerate"} <= set(s.method)


# ------------------------------------------------------------------------------------------ the commands


def _strip_date(text: str) -> str:
    return re.sub(r"on \d{4}-\d{2}-\d{2} \(UTC\)", "on DATE (UTC)", text)


def test_doc_is_regenerated_identically(traced_db, tmp_path, capsys):
    a, b, j = tmp_path / "a.md", tmp_path / "b.md", tmp_path / "s.json"
    assert main(["accuracy", "--db", traced_db, "--out", str(a), "--json", str(j)]) == 0
    assert main(["accuracy", "--db", traced_db, "--out", str(b)]) == 0
    text = a.read_text()
    assert _strip_date(text) == _strip_date(b.read_text())
    assert text.count("no measured rows yet") == 3  # measured-allocated, -reserved, -device
    assert "## Worst" in text and "## Appendix" in text and "10 runs by source: traced 10" in text
    data = json.loads(j.read_text())
    assert {"summary", "targets", "coverage", "fits"} <= set(data) and data["n_runs"] == 10
    assert data["summary"][0]["method"] == "ours"


def test_doc_shows_measured_tiers_when_present(synthetic_db, tmp_path):
    out = tmp_path / "m.md"
    assert main(["accuracy", "--db", synthetic_db, "--out", str(out)]) == 0
    text = out.read_text()
    assert "no measured rows yet" not in text and "### measured-reserved" in text


def test_report_prints_stages_and_worst(traced_db, capsys):
    assert main(["report", "--db", traced_db, "--worst", "3"]) == 0
    out = capsys.readouterr().out
    assert "forward" in out and "optimizer" in out and "prefill" in out and "worst 3 runs" in out
    assert main(["report", "--db", traced_db, "--family", "gpt2", "--worst", "0"]) == 0
    out = capsys.readouterr().out
    assert "\ngpt2 " in out and "llama" not in out.split("\n", 1)[1] and "by |peak error|" not in out


def test_cli_exit_codes(traced_db, tmp_path, capsys):
    assert main(["report", "--db", traced_db, "--family", "nope"]) == 2
    assert "family: 'nope' is not known" in capsys.readouterr().err
    assert main(["report", "--db", traced_db, "--worst", "-1"]) == 2
    assert main(["report", "--db", str(tmp_path / "absent.duckdb")]) == 2
    assert "no database" in capsys.readouterr().err and not (tmp_path / "absent.duckdb").exists()
    assert main(["report", "--db", traced_db, "--source", "measured"]) == 1  # no measured runs
    assert main(["accuracy", "--db", traced_db, "--out", str(tmp_path / "x.md"), "--wait", "-1"]) == 2
    empty = _ingest(tmp_path, [make_row(oom=True, oom_stage="forward", peak_alloc_bytes=None)], "empty")
    assert main(["accuracy", "--db", empty, "--out", str(tmp_path / "e.md")]) == 1
    assert not (tmp_path / "e.md").exists()
    with pytest.raises(SystemExit) as e:
        main(["report", "--source", "published"])
    assert e.value.code == 2


def test_every_option_has_help_and_commands_route_here():
    assert COMMANDS["report"] == COMMANDS["accuracy"] == "bench.commands.accuracy"
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cmd_accuracy.register(sub)
    for name in ("report", "accuracy"):
        p = sub.choices[name]
        assert p.description
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings} has no help text"


# ---------------------------------------------------------------- the measured tier's own section

H100_MESSAGE = ("CUDA out of memory. Tried to allocate 15.66 GiB. GPU 0 has a total capacity of 79.18 GiB of which 8.30 "
                "GiB is free. Including non-PyTorch memory, this process has 70.87 GiB memory in use. Of the allocated "
                "memory 55.33 GiB is allocated by PyTorch, and 14.79 GiB is reserved by PyTorch but unallocated.")


def test_an_oom_message_gives_the_bytes_the_tensors_needed():
    need, unusable, rounding = measured_tier.oom_need(H100_MESSAGE)
    assert need == int((55.33 + 15.66) * 2**30) and unusable == int(14.79 * 2**30)
    assert rounding == int(0.01 * 2**30)
    assert measured_tier.oom_need("CUDA out of memory.") is None and measured_tier.oom_need(None) is None


def test_measured_section_scores_every_verdict_and_leaves_each_model_out(tmp_path):
    model = from_hf_config(TINY_LLAMA_CONFIG, "tiny-llama")
    est = estimate(model, Workload(batch=2, seq=128), options=Options(gpu="h100"))
    h100 = get_gpu("h100")
    total = 85_017_493_504
    reserve = h100.memory_bytes - total            # what NVML counts and cudaMemGetInfo's total leaves out
    first = "reused process: case 1 of this worker"

    def row(name, **kw):
        base = dict(source="measured", gpu_name="NVIDIA H100 80GB HBM3", gpu_total_bytes=total, batch=2,
                    model_name=name, peak_alloc_bytes=est.allocated_bytes, peak_reserved_bytes=est.reserved_bytes)
        return make_row(**{**base, **kw})

    rows = [row("a", nvml_used_bytes=est.reserved_bytes + reserve + 800_000_000, notes=first),
            row("b", batch=3, nvml_used_bytes=est.reserved_bytes + reserve + 900_000_000, notes=first),  # a new run_id
            # called fits, ran out of memory: listed, with what torch's message says the tensors needed
            row("b", seq=127, oom=True, oom_stage="backward", oom_message=H100_MESSAGE, gpu_total_bytes=
                est.device_bytes + 2**20, peak_reserved_bytes=None, nvml_used_bytes=None),
            # called oom (tensors alone do not fit) and ran out of memory: agreed
            row("a", seq=126, oom=True, oom_stage="forward", gpu_total_bytes=est.allocated_bytes // 2,
                peak_reserved_bytes=None, nvml_used_bytes=None)]
    db_path = _ingest(tmp_path, rows, "measured")
    text = "\n".join(measured_tier.section(db_path))
    assert "4 measured rows (2 OOM) on NVIDIA H100 80GB HBM3" in text
    assert "| fits | 2 | 1 |" in text and "| tight | 0 | 0 |" in text and "| oom | 0 | 1 |" in text
    assert "OOM in backward (tensors needed 70.99; 14.79 reserved but unusable)" in text
    # each model's constant comes from the other model's first-case training row alone
    assert "| a | 858.3 | 1 |" in text and "| b | 762.9 | 1 |" in text   # 900e6 and 800e6 B in MiB
    assert measured_tier.section(_ingest(tmp_path, [make_row()], "traced_only")) == []


def test_stage_gaps_are_measured_minus_estimated_for_the_stages_a_row_has():
    model = from_hf_config(TINY_LLAMA_CONFIG, "tiny-llama")
    est = estimate(model, Workload(batch=2, seq=128))
    row = {"forward_peak_alloc_bytes": est.allocated_at("forward") + 5, "load_peak_alloc_bytes": float("nan"),
           "backward_peak_alloc_bytes": None, "prefill_peak_alloc_bytes": 10**9}   # prefill: not a training stage
    assert measured_tier.stage_gaps(row, est) == {"forward": 5}


def test_the_same_case_on_two_gpus_is_compared_to_the_byte(tmp_path):
    def row(gpu, **kw):
        base = dict(source="measured", gpu_name=gpu, gpu_total_bytes=80 * 2**30, model_name="m",
                    nvml_used_bytes=3 * 2**30)
        return make_row(**{**base, **kw})

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    rows = [row(h100), row(h200),                                                   # identical
            row(h100, batch=2), row(h200, batch=2, peak_reserved_bytes=6_291_456,   # the cache's history
                                    notes="reused process: case 7 of this worker"),
            row(h100, batch=4, oom=True, oom_stage="forward", peak_reserved_bytes=None, nvml_used_bytes=None),
            row(h200, batch=4),                                                     # fits the larger card only
            row(h100, batch=8)]                                                     # one GPU only: not a pair
    text = "\n".join(measured_tier.section(_ingest(tmp_path, rows, "two_gpus")))
    assert ("3 cases were measured on more than one GPU (same model, workload, allocator setting, torch and "
            "transformers). 2 ran on every GPU: the allocated peak was the same to the byte in 2 and the reserved "
            "peak in 1; 1 ran out of memory on one GPU and not on the larger one.") in text
    assert "| 2 | 128 | NVIDIA H100 80GB HBM3 / NVIDIA H200 | 0.1.0 / 0.1.0 | 0 | 2,097,152 | 1, 7 |" in text
    assert "| 1 | 128 |" not in text    # identical peaks are not listed
    one = [row(h100), row(h100, batch=2)]
    assert "### The same case on two GPUs" not in "\n".join(measured_tier.section(_ingest(tmp_path, one, "one")))
