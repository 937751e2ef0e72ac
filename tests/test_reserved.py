"""Reserved and device bytes: the three levels of every estimate, --alloc-conf, the verdict on the device, the
device capacity and CUDA context, the expandable_segments advice, and allocation streams of traced runs
(bench trace --stream, bench replay)."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from bench import __main__ as bench_main
from bench.trace.streams import trace_stream
from estimator import cli, reserved, search
from estimator import estimate as est_mod
from offline.allocator.replay import replay
from offline.allocator.stream import Stream, stream_from_snapshot
from estimator.device import capacity_bytes, context_bytes
from estimator.estimate import Options, estimate
from estimator.gpus import get_gpu
from estimator.model import from_hf_config
from estimator.spec import Parallel, Workload
from strategies import model

L1 = "llama-3.2-1b"
# Hand-written tiny Llama, as tests/test_trace.py (nothing fetched): traces in well under a second
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("w, p", [(Workload(batch=2, seq=512), Parallel()),
                                  (Workload(method="lora", batch=1, seq=1024), Parallel()),
                                  (Workload(mode="infer", batch=4, seq=256, gen_tokens=16), Parallel()),
                                  (Workload(batch=1, seq=512), Parallel(strategy="fsdp", gpus=4))])
def test_three_levels_in_order_and_named(w, p):
    e = estimate(model(L1), w, p)
    assert 0 < e.allocated_bytes <= e.reserved_bytes <= e.device_bytes == e.total_bytes
    parts = dict((n, b) for n, b, _ in e.device_parts())
    assert sum(parts.values()) == e.device_bytes
    assert parts["allocator_cache"] == e.reserved_bytes - e.allocated_bytes == e.components.allocator_cache
    assert parts["nccl"] == (0 if p.gpus == 1 else e.components.overhead - parts["cuda_context"]
                             - parts["cublas_workspace"])
    assert all(src for _, _, src in e.device_parts())
    # the cache is the fitted class's form on the allocated peak (estimator.reserved, data/allocator_fit.json)
    f = reserved.fit_for(w, p)
    assert e.components.allocator_cache == f.cache_bytes(e.allocated_bytes)
    for _, b in e.stages:
        assert b.tensor_bytes + b.allocator_cache + b.overhead == b.total


def test_json_carries_the_three_and_fits_uses_device(capsys):
    assert cli.main(["--model", L1, "--batch", "2", "--seq", "1024", "--gpu", "l4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["allocated_bytes"] <= out["reserved_bytes"] <= out["device_bytes"] == out["total_bytes"]
    assert out["gpu_bytes"] == capacity_bytes(get_gpu("l4"))
    assert out["fits"] == (out["device_bytes"] <= out["gpu_bytes"])
    assert out["headroom_bytes"] == out["gpu_bytes"] - out["device_bytes"]
    assert [p["name"] for p in out["device_parts"]] == ["tensors", "cublas_workspace", "allocator_cache",
                                                        "cuda_context", "nccl"]


def test_alloc_conf_changes_reserved_as_the_fitted_classes_say():
    m, w = model(L1), Workload(batch=2, seq=1024)
    base = estimate(m, w)
    exp = estimate(m, w, Parallel(), Options(alloc_conf="expandable_segments:True"))
    assert exp.allocated_bytes == base.allocated_bytes
    f0, f1 = reserved.fit_for(w, Parallel(), "default"), reserved.fit_for(w, Parallel(), "expandable")
    assert base.reserved_bytes - base.allocated_bytes == f0.cache_bytes(base.allocated_bytes)
    assert exp.reserved_bytes - exp.allocated_bytes == f1.cache_bytes(base.allocated_bytes)
    assert exp.reserved_bytes != base.reserved_bytes
    # a key the classes do not fit is priced as its mode, and said so
    other = estimate(m, w, Parallel(), Options(alloc_conf="max_split_size_mb:512"))
    assert other.reserved_bytes == base.reserved_bytes
    assert any("max_split_size_bytes" in n for n in other.notes)


def test_bad_alloc_conf_is_one_line(capsys):
    assert cli.main(["--model", L1, "--alloc-conf", "expandable_segments:maybe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expandable_segments" in err
    with pytest.raises(ValueError, match="^PYTORCH_CUDA_ALLOC_CONF: unrecognized key 'foo'"):
        Options(alloc_conf="foo:1")


def test_verdict_flips_on_device_bytes_when_allocated_alone_would_fit():
    m, w = model(L1), Workload(batch=2, seq=1024)
    e = estimate(m, w)
    l4 = get_gpu("l4")
    reserve = l4.memory_bytes - capacity_bytes(l4)
    without_cache = e.device_bytes - e.components.allocator_cache  # tensors + CUDA context (no NCCL on one GPU)
    assert e.allocated_bytes < without_cache < e.device_bytes
    for usable, verdict in (((e.allocated_bytes + without_cache) // 2, "oom"),   # the context does not fit
                            ((without_cache + e.device_bytes) // 2, "tight"),    # only the allocator's cache does not
                            (e.device_bytes, "fits")):
        gpu = replace(l4, name="test-card", memory_bytes=usable + reserve)
        assert capacity_bytes(gpu) == usable
        r = cli.report(m, e, gpu, Options(), None)
        assert r["verdict"] == verdict == e.verdict(usable)
        assert r["fits"] is (verdict == "fits")
        # max batch uses the strict verdict (device bytes): the current batch fits only where the verdict says so
        assert (r["max_batch"] >= w.batch) is (verdict == "fits")


def test_capacity_and_context_data():
    h100 = get_gpu("h100-sxm-80gb")
    assert capacity_bytes(h100) == 81079 * 2**20 < h100.memory_bytes == 81559 * 2**20  # measured, driver 580
    t4 = get_gpu("t4")                                     # 14.75 GiB in torch's OOM message
    assert capacity_bytes(t4) == 15104 * 2**20
    b200 = get_gpu("b200")                                 # no sourced entry: memory.total minus the default
    assert capacity_bytes(b200) == b200.memory_bytes - 870 * 2**20
    assert context_bytes(None) == context_bytes(get_gpu("a100-80gb")) == 500 * 2**20  # no lazy 'step' row: default
    assert context_bytes(h100) == context_bytes(get_gpu("h200")) == 804_061_184  # Hopper: measured after a step
    e = estimate(model(L1), Workload(), Parallel(), Options(gpu="h100-sxm-80gb"))
    assert e.cuda_context_bytes == 804_061_184


def test_expandable_advice_when_fragmentation_decides(tmp_path, monkeypatch):
    # A fit file where expandable_segments halves nothing but the cache: the advice must list it, priced
    fit = {"classes": {"train-full": {
        "default": {"ratio": 0.10, "const_bytes": 0, "n": 1, "median_rel_error": 0, "worst_rel_error": 0},
        "expandable": {"ratio": 0.01, "const_bytes": 0, "n": 1, "median_rel_error": 0, "worst_rel_error": 0}}}}
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(fit))
    monkeypatch.setattr(reserved, "FIT_PATH", path)
    est_mod.reserved_fit.cache_clear()
    try:
        m, w = model(L1), Workload(batch=2, seq=1024)
        e = estimate(m, w)
        assert e.components.allocator_cache == round(e.allocated_bytes * 0.10)
        cap = e.device_bytes - e.components.allocator_cache // 2   # tensors fit, the cache does not
        items = search.advice(m, w, Parallel(), cap, Options(derive=False))
        a = next(a for a in items if a.change == {"alloc_conf": "expandable_segments:True"})
        new = estimate(m, w, Parallel(), Options(alloc_conf="expandable_segments:True"))
        assert a.new_total_bytes == new.device_bytes and a.saving_bytes == e.device_bytes - new.device_bytes
        assert a.fits and a.note.startswith("Fragmentation decides the verdict")
        assert not any("alloc_conf" in b.change for b in search.advice(
            m, w, Parallel(), cap, Options(derive=False, alloc_conf="expandable_segments:True")))
    finally:
        est_mod.reserved_fit.cache_clear()


# ---------------------------------------------------------------- streams of traced runs

@pytest.fixture(scope="module")
def tiny_stream():
    row, stream = trace_stream(TINY, "tiny", Workload(batch=1, seq=8))
    return row, stream


def test_stream_round_trip_from_a_traced_tiny_model(tiny_stream, tmp_path):
    row, s = tiny_stream
    assert {"load", "forward", "backward", "optimizer"} <= set(s.stage_names)
    assert s.meta["model"] == "tiny" and s.meta["workload"]["batch"] == 1 and s.meta["kernels"] == "cuda"
    assert s.meta["versions"]["torch_version"]
    s.save(tmp_path / "s.npz")
    back = Stream.load(tmp_path / "s.npz")
    for name in ("kind", "handle", "nbytes", "stage"):
        assert np.array_equal(getattr(back, name), getattr(s, name))
    assert back.stage_names == s.stage_names and back.meta == s.meta
    # the live bytes of the stream peak exactly where the tracer's counter does
    live = np.cumsum(np.where(s.kind == 0, s.nbytes, -s.nbytes))
    assert live.max() == row["peak_alloc_bytes"] == s.meta["peak_alloc_bytes"]
    r = replay(back)
    assert r.overall.peak_allocated_bytes >= row["peak_alloc_bytes"]   # 512-byte rounding, never less
    assert r.overall.peak_reserved_bytes >= r.overall.peak_allocated_bytes


def test_replay_command_output(tiny_stream, tmp_path, capsys):
    _, s = tiny_stream
    path = tmp_path / "s.npz"
    s.save(path)
    assert bench_main.main(["replay", str(path)]) == 0
    text = capsys.readouterr().out
    r = replay(s)
    for st in ("load", "forward", "backward", "optimizer", "PEAK (step)", "oom_capacity", "segments"):
        assert st in text, st
    assert f"({r.overall.peak_reserved_bytes:,} B)" in text
    assert bench_main.main(["replay", str(path), "--json", "--alloc-conf", "expandable_segments:True",
                            "--capacity-gib", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    re = replay(s, _conf("expandable_segments:True"))
    assert d["overall"]["peak_reserved_bytes"] == re.overall.peak_reserved_bytes
    assert [x["name"] for x in d["stages"]] == [x.name for x in re.stages if x.events]
    assert d["oom"] is None and d["oom_capacity_bytes"] >= d["overall"]["peak_allocated_bytes"]
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    assert bench_main.main(["replay", str(tmp_path / "bad.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stream file" in err


def _conf(text):
    from estimator.alloc_conf import parse_alloc_conf
    return parse_alloc_conf(text)


def test_trace_command_writes_a_stream(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "run.npz"
    assert bench_main.main(["trace", "--model", str(cfg), "--batch", "1", "--seq", "8", "--stream", str(out),
                            "--db", str(tmp_path / "none.duckdb")]) == 0
    s = Stream.load(out)
    assert len(s) > 0 and "forward" in s.stage_names
    assert bench_main.main(["trace", "--model", str(cfg), "--batch", "1,2", "--seq", "8", "--stream",
                            str(out), "--db", str(tmp_path / "none.duckdb")]) == 2
    assert "stream: --stream FILE takes one case" in capsys.readouterr().err


def test_snapshot_stream_takes_the_stage_names_of_the_run():
    snap = {"device_traces": [[
        {"action": "alloc", "addr": 0, "size": 100, "time_us": 10},
        {"action": "alloc", "addr": 512, "size": 50, "time_us": 20},
        {"action": "free_completed", "addr": 0, "size": 100, "time_us": 30},
        {"action": "free_completed", "addr": 512, "size": 50, "time_us": 45}]]}
    s = stream_from_snapshot(snap, stage_ends=[(15, "load"), (30, "forward")])
    assert [s.stage_names[i] for i in s.stage] == ["load", "forward", "forward", "end"]
    assert stream_from_snapshot(snap).stage_names == ("trace",)


def test_published_comparison_is_robust_to_zero_rows_and_compares_a_row():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from rowfactory import make_row
    from scripts import allocator_vs_published as avp

    comps, skipped = avp.comparisons([])
    assert comps == [] and "No published run" in avp.report(comps, skipped, 0)
    from estimator.presets import load_config
    name, cfg = load_config(L1)
    e = estimate(model(L1), Workload(batch=2, seq=1024))
    row = make_row(config=cfg, model_name=name, source="published", batch=2, seq=1024,
                   peak_reserved_bytes=e.reserved_bytes + 2**30, nvml_used_bytes=None)
    comps, _ = avp.comparisons([row])
    (c,) = comps
    assert c["metric"] == "reserved" and c["predicted_bytes"] == e.reserved_bytes
    assert c["rel_error"] == (e.reserved_bytes - (e.reserved_bytes + 2**30)) / (e.reserved_bytes + 2**30)
    assert "| reserved | 1 |" in avp.report(comps, {}, 1)


def test_cache_is_capped_at_the_largest_share_a_replayed_case_showed():
    # Below the fitted sizes the constant alone would dominate: a 10 MB step is never given ~0.9 GiB of cache.
    doc = json.loads(reserved.CASES_PATH.read_text())
    for cls in reserved.CLASSES:
        for mode in reserved.MODES:
            f = reserved.fit_for_class(cls, mode)
            shares = [(c[f"reserved_{mode}_bytes"] - c["allocated_bytes"]) / c["allocated_bytes"]
                      for c in doc["cases"] if c["class"] == cls]
            assert f.max_ratio == max(shares)
            assert f.cache_bytes(10_000_000) <= round(10_000_000 * f.max_ratio)
            big = 200 * 2**30   # far above every case: the fitted form, the cap does not bind
            assert f.cache_bytes(big) == round(big * f.ratio) + f.const_bytes
    tiny = estimate(from_hf_config(TINY, "t-tiny"), Workload(batch=1, seq=64))
    share = (tiny.reserved_bytes - tiny.allocated_bytes) / tiny.allocated_bytes
    assert 0 <= share <= reserved.fit_for(Workload(), Parallel()).max_ratio + 1e-6  # rounding to whole bytes
