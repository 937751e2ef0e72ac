"""The measured tier (bench/measure/harness.py, bench/measure/worker.py, bench/commands/measure.py) without a GPU.

What runs here: the real torchrun launch and rank gather on CPU (gloo) in the hidden `--device cpu` test
mode, the OOM row built in-process with a fake counting backend, resuming, failure reporting and the
refusal without CUDA. The CUDA counters themselves need a GPU (docs/measuring.md).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.measure import env

from bench.measure import harness as measure

from bench.measure import worker as measure_worker
from tracer import runner
from bench.__main__ import main as bench_main
from bench.store.rows import MAX_NOTES
from bench.store.validate import validate_row
from estimator.spec import Parallel, Workload
from rowfactory import TINY_LLAMA_CONFIG

TRAIN = Workload(batch=2, seq=16)


def cpu_case(workload=TRAIN, parallel=Parallel(), **kw) -> measure.Case:
    return measure.Case("tiny-llama", TINY_LLAMA_CONFIG, workload, parallel, device="cpu", **kw)


class CountingBackend:
    """Counts like CudaBackend, with made-up numbers: boundary n reports alloc 100*n, reserved 200*n."""

    counts = True
    device = torch.device("cpu")
    context_bytes = 123

    def __init__(self):
        self.n = 0

    def boundary(self):
        self.n += 1
        return 100 * self.n, 200 * self.n

    def reserved_bytes(self):
        return 200 * self.n

    def used_bytes(self):
        return 10_000 + 200 * self.n

    def clock(self):
        return float(self.n)


def test_cpu_launch_ddp_and_fsdp_write_one_gathered_row_each_and_resume(tmp_path, capsys):
    """torchrun with 2 CPU ranks per case (gloo): one row per case, both ranks gathered; a rerun skips them."""
    model = tmp_path / "tiny-llama.json"
    model.write_text(json.dumps(TINY_LLAMA_CONFIG))
    out = tmp_path / "runs.jsonl"
    argv = ["measure", "--device", "cpu", "--model", str(model), "--strategy", "ddp,fsdp", "--gpus", "2",
            "--batch", "2", "--seq", "16", "--out", str(out)]
    # a case whose worker dies without a row is left out and retried by the next run of the same command (the
    # harness's documented resume); under a loaded 2-core CI a gloo rank has aborted at exit ("terminate called
    # without an active exception") once, so a second run may measure what the first could not
    if bench_main(argv) != 0:
        first = capsys.readouterr().err
        assert "failed without a row" in first and "terminate called without an active exception" in first, first
        assert bench_main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["strategy"] for r in rows) == ["ddp", "fsdp"]
    total_param_bytes = rows[0]["params"] * 2  # bf16 weights (recipe pure)
    for row in rows:
        valid, errors = validate_row(row)
        assert errors == [] and valid["run_id"] == row["run_id"]
        assert row["world_size"] == row["gpu_count"] == 2 and row["source"] == "measured"
        assert measure.CPU_TEST_NOTE in row["notes"]
        assert row["peak_alloc_bytes"] is None and row["oom"] is False
        ranks = json.loads(row["per_rank_json"])
        assert [r["rank"] for r in ranks] == [0, 1]
        local = [r["local_param_bytes"] for r in ranks]
        if row["strategy"] == "ddp":  # every rank holds the whole model
            assert local == [total_param_bytes, total_param_bytes]
        else:  # FSDP2 shards dim 0 of every parameter: each rank about half, together all of it
            assert sum(local) == total_param_bytes and max(local) < 0.6 * total_param_bytes
    capsys.readouterr()
    assert bench_main(argv) == 0
    assert "skipped 2 already in the output" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 2


def test_oom_becomes_a_row_with_the_stage_it_hit(monkeypatch):
    """An OOM in backward: load and forward peaks kept, backward's partial peak kept, message truncated."""
    message = "CUDA out of memory. Tried to allocate 20.00 GiB. " + "x" * (2 * MAX_NOTES)

    def fake_stages(model, optimizer, workload, inputs, on_stage, steps=2, live=None):
        on_stage("forward")
        raise torch.OutOfMemoryError(message)

    monkeypatch.setattr(runner, "run_stages", fake_stages)
    case = measure.Case("tiny-llama", TINY_LLAMA_CONFIG, TRAIN, Parallel(), device="cuda")
    result = measure_worker.measure_case(case, CountingBackend())
    # boundaries: 1 opens the build, 2 drops the build's peak (the load starts with the model built), 3 closes load,
    # 4 closes forward, 5 is read after the OOM (backward)
    assert result["stages"] == {"load": (300, 600), "forward": (400, 800), "backward": (500, 1000)}
    assert result["oom"] and result["oom_stage"] == "backward"
    assert result["step_time_s"] is None and result["params"] > 0
    assert result["nvml_used_bytes"] == 10_000 + 800  # read at the last stage end (forward), not after the OOM
    row = measure.build_row(case, env.environment_fields(None), [result])
    assert validate_row(row)[1] == []
    assert row["oom"] is True and row["oom_stage"] == "backward"
    assert row["oom_message"].startswith("CUDA out of memory") and len(row["oom_message"]) == MAX_NOTES
    assert row["peak_alloc_bytes"] == 500 and row["peak_reserved_bytes"] == 1000
    assert row["cuda_context_bytes"] == 123 and row["per_rank_json"] is None
    assert "backward peak is what was reached before the failed allocation" in row["notes"]


def test_stage_after_each_marker_follows_the_runner_order():
    accum = Workload(grad_accum=2)
    assert measure_worker._next_stage("load", accum, 0) == "forward"
    assert measure_worker._next_stage("forward", accum, 0) == "backward"
    assert measure_worker._next_stage("backward", accum, 1) == "forward"   # second micro-batch
    assert measure_worker._next_stage("backward", accum, 2) == "optimizer"
    assert measure_worker._next_stage("optimizer", accum, 2) == "forward"
    infer = Workload(mode="infer", gen_tokens=4)
    assert [measure_worker._next_stage(s, infer, 0) for s in ("load", "prefill", "decode")] == \
        ["prefill", "decode", "decode"]


def test_counted_run_keeps_each_stage_maximum_and_times_the_second_pass():
    result = measure_worker.measure_case(cpu_case(), CountingBackend())
    # 1 opens the build; 2 drops its peak; 3 load; burn-in 4 fwd 5 bwd 6 opt; clock() reads n=6; timed 7 fwd 8 bwd
    # 9 opt; clock n=9
    assert result["stages"] == {"load": (300, 600), "forward": (700, 1400), "backward": (800, 1600),
                                "optimizer": (900, 1800)}
    assert result["step_time_s"] == 3.0 and not result["oom"]
    assert result["nvml_used_bytes"] == 10_000 + 1800


def test_row_from_two_ranks_takes_the_maximum_and_lists_both():
    case = cpu_case(parallel=Parallel("ddp", 2))
    r0 = measure_worker.measure_case(cpu_case(), CountingBackend())  # rank 0's figures, measured unwrapped
    r1 = dict(r0, rank=1, stages={**r0["stages"], "backward": (5000, 6000)}, oom=True, oom_stage="backward",
              oom_message="CUDA out of memory")
    row = measure.build_row(case, env.environment_fields(None), [r1, r0])
    assert validate_row(row)[1] == []
    assert row["backward_peak_alloc_bytes"] == 5000 and row["peak_reserved_bytes"] == 6000
    assert row["oom"] and row["oom_stage"] == "backward"
    assert [r["rank"] for r in json.loads(row["per_rank_json"])] == [0, 1]


def test_run_id_is_shared_by_the_probe_and_the_row_and_tracks_the_case():
    case = cpu_case()
    fields = env.environment_fields(None)
    row = measure.build_row(case, fields, [measure_worker.measure_case(case, measure_worker.CpuBackend())])
    assert row["run_id"] == measure.identity_columns(case, fields)["run_id"]
    other = cpu_case(Workload(batch=4, seq=16))
    assert measure.identity_columns(other, fields)["run_id"] != row["run_id"]


def test_case_round_trips_through_json_and_rejects_what_measure_cannot_run():
    case = cpu_case(Workload(method="lora", lora_targets=("q_proj", "k_proj", "v_proj")), contributor="me")
    assert measure.Case.from_json(json.loads(json.dumps(case.to_json()))) == case
    for workload, parallel, field in [
        (TRAIN, Parallel("zero3", 2), "strategy"),
        (Workload(mode="infer"), Parallel("ddp", 2), "strategy"),
        (Workload(mode="infer", kv_dtype="fp8"), Parallel(), "kv_dtype"),
        (Workload(method="qlora"), Parallel(), "weight_format"),
        (Workload(mode="infer", weight_format="int8"), Parallel(), "weight_format"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            cpu_case(workload, parallel)


def test_worker_refuses_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    case_file = tmp_path / "case.json"
    case_file.write_text(json.dumps(measure.Case("tiny-llama", TINY_LLAMA_CONFIG, TRAIN).to_json()))
    assert measure_worker.main(["--case", str(case_file), "--out", str(tmp_path / "row.json")]) == 2
    assert capsys.readouterr().err.strip() == measure_worker.REFUSAL
    assert not (tmp_path / "row.json").exists()


def test_command_exits_2_with_the_refusal(tmp_path, monkeypatch, capsys):
    def no_gpu(device, timeout_s=300):
        raise RuntimeError(measure_worker.REFUSAL)

    monkeypatch.setattr(measure, "probe_environment", no_gpu)
    out = tmp_path / "runs.jsonl"
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY_LLAMA_CONFIG))
    assert bench_main(["measure", "--model", str(model), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {measure_worker.REFUSAL}"
    assert not out.exists()


def test_resume_skips_stored_run_ids_and_failures_write_no_row(tmp_path, monkeypatch):
    fields = env.environment_fields(None)
    done, todo, broken = cpu_case(), cpu_case(Workload(batch=3, seq=16)), cpu_case(Workload(batch=5, seq=16))
    out = tmp_path / "runs.jsonl"
    out.write_text(json.dumps(measure.identity_columns(done, fields)) + "\n" + "{not json\n")
    launched = []

    def fake_measure_one(case, workdir, timeout_s, snapshot=None, stream_dir=None):
        launched.append(case)
        if case is broken:
            return None, "killed by signal SIGSEGV\nSegmentation fault"
        return dict(measure.identity_columns(case, fields), oom=True, oom_stage="forward"), ""

    monkeypatch.setattr(measure, "measure_one", fake_measure_one)
    summary = measure.run_cases([done, todo, broken], out, fields, progress=False)
    assert launched == [todo, broken]
    assert (summary.measured, summary.oom, summary.skipped) == (1, 1, 1)
    assert summary.failed == [(measure.describe(broken), "killed by signal SIGSEGV\nSegmentation fault")]
    assert "FAILED" in summary.text() and "SIGSEGV" in summary.text()
    assert len(out.read_text().splitlines()) == 3  # the two lines that were there, plus `todo`
    assert measure.existing_run_ids(out) == {measure.identity_columns(c, fields)["run_id"] for c in (done, todo)}


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (an orphan may wait to be reaped by init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_timeout_kills_the_whole_process_group(tmp_path):
    """A hung case (torchrun and its workers) is killed together: here a child and the grandchild it spawned."""
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    code, _ = measure.run_process([sys.executable, "-c", script], timeout_s=3.0)
    assert code is None
    pid = int(pid_file.read_text())  # the grandchild did start
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid)


def test_worker_command_uses_torchrun_for_every_distributed_strategy(tmp_path):
    single = measure.worker_command(cpu_case(), tmp_path / "c", tmp_path / "r", None)
    assert single[:3] == [sys.executable, "-m", "bench.measure.worker"]
    ddp = measure.worker_command(cpu_case(parallel=Parallel("ddp", 1)), tmp_path / "c", tmp_path / "r", "snap")
    assert ddp[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    assert ddp[-2:] == ["--snapshot", "snap"]


def test_cuda_backend_arithmetic_with_the_cuda_calls_faked(monkeypatch):
    """The CUDA-only code with torch.cuda's functions replaced (monkeypatch fails on a name torch lacks):
    context = NVML after - NVML before - the allocator's one small segment; a boundary reads then resets."""
    MiB = 2**20
    calls = []
    nvml = iter([1000 * MiB, 1500 * MiB + 2 * MiB])  # before, after the context and the 2 MiB segment
    monkeypatch.setattr(measure_worker.env, "nvml_handle", lambda index: "handle")
    monkeypatch.setattr(measure_worker.env, "nvml_used_bytes", lambda handle: next(nvml))
    for name in ("set_device", "init", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: calls.append(name))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 7 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 8 * MiB)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *size, device=None: real_empty(*size))
    backend = measure_worker.CudaBackend(0)
    backend.start()
    assert backend.context_bytes == 500 * MiB
    assert calls[:3] == ["set_device", "init", "synchronize"] and calls[-1] == "reset"
    calls.clear()
    assert backend.boundary() == (7 * MiB, 8 * MiB)
    assert calls == ["synchronize", "reset"]  # synchronised before reading, reset after


def test_every_measure_option_has_help_and_the_cpu_mode_is_hidden(capsys):
    import argparse

    from bench.commands import measure as cmd_measure

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cmd_measure.register(sub)
    for action in sub.choices["measure"]._actions:
        assert action.help, f"measure {action.option_strings or action.dest} has no help text"
    sub.choices["measure"].print_help()
    text = capsys.readouterr().out
    assert "--out" in text and "--batch" in text and "--device" not in text


def test_failure_report_names_the_workers_exception_not_only_torchruns_summary():
    output = "\n".join(["[rank1]: Traceback (most recent call last):",
                        "[rank1]: ValueError: optimizer: lion is not available in torch",
                        "E1121 agent: failed (exitcode: 1) local_rank: 1",
                        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
                        "Root Cause (first observed failure):"])
    text = measure._describe_exit(1, 60, output)
    assert text.splitlines()[0] == ("worker exited with status 1 without writing a row: "
                                    "ValueError: optimizer: lion is not available in torch")
    assert text.splitlines()[-1] == "Root Cause (first observed failure):"
    text = measure._describe_exit(-11, 60, "[rank0]: ValueError: optimizer: lion is not available in torch")
    assert text.splitlines()[0] == "killed by signal SIGSEGV: ValueError: optimizer: lion is not available in torch"


def test_alloc_conf_reaches_the_worker_the_row_and_the_run_id(tmp_path, monkeypatch, capsys):
    """--alloc-conf: validated as torch parses it, set (or removed) in the worker's environment before CUDA
    starts, stored in the row's alloc_conf, and part of the run's identity (defaults keep the old run_ids)."""
    fields = env.environment_fields(None)
    plain, expandable = cpu_case(), cpu_case(alloc_conf="expandable_segments:True")
    assert measure.Case.from_json(json.loads(json.dumps(expandable.to_json()))) == expandable
    assert measure.identity_columns(expandable, fields)["alloc_conf"] == "expandable_segments:True"
    assert measure.identity_columns(expandable, fields)["run_id"] != measure.identity_columns(plain, fields)["run_id"]
    legacy = {k: v for k, v in measure.identity_columns(plain, fields).items() if k not in ("alloc_conf", "run_id")}
    assert measure.compute_run_id(legacy) == measure.identity_columns(plain, fields)["run_id"]
    with pytest.raises(ValueError, match="^PYTORCH_CUDA_ALLOC_CONF: unrecognized key 'bogus'"):
        cpu_case(alloc_conf="bogus:1")

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert measure._child_env("expandable_segments:True")["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in measure._child_env("")
    assert measure._child_env(None)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"
    script = "import os; print('CONF=' + os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'unset'))"
    code, out = measure.run_process([sys.executable, "-c", script], 30.0, "expandable_segments:True")
    assert code == 0 and "CONF=expandable_segments:True" in out

    # the grid: one case per setting; without the flag, this shell's setting
    out_file = tmp_path / "runs.jsonl"
    assert bench_main(["measure", "--model", "llama-3.2-1b", "--out", str(out_file), "--dry-run",
                       "--alloc-conf", "", "--alloc-conf", "expandable_segments:True"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "alloc_conf" not in lines[0] and lines[1].endswith("alloc_conf=expandable_segments:True")
    assert bench_main(["measure", "--model", "llama-3.2-1b", "--out", str(out_file), "--dry-run"]) == 0
    assert capsys.readouterr().out.strip().endswith("alloc_conf=max_split_size_mb:256")
    assert bench_main(["measure", "--model", "llama-3.2-1b", "--out", str(out_file), "--dry-run",
                       "--alloc-conf", "bogus:1"]) == 2
    assert capsys.readouterr().err.startswith("error: PYTORCH_CUDA_ALLOC_CONF: unrecognized key 'bogus'")


def test_reused_process_measures_in_turn_and_reports_a_refused_case_without_stopping(tmp_path):
    """--reuse-process: one worker measures the cases in turn; a case the runner refuses (an optimizer torch
    lacks) is reported with the runner's reason and the same process goes on with the next case."""
    fields = env.environment_fields(None)
    first, refused, last = cpu_case(), cpu_case(Workload(batch=2, seq=16, optimizer="lion")), cpu_case(
        Workload(batch=3, seq=16))
    out = tmp_path / "runs.jsonl"
    summary = measure.run_cases([first, refused, last], out, fields, timeout_s=300, progress=False,
                                reuse_process=True)
    assert (summary.measured, summary.unstarted) == (2, 0)
    assert [name for name, _ in summary.failed] == [measure.case_name(refused)]
    assert "lion" in summary.failed[0][1]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["run_id"] for r in rows] == [measure.identity_columns(c, fields)["run_id"] for c in (first, last)]
    assert all(validate_row(r)[1] == [] for r in rows)
    assert "reused process: case 1 of this worker" in rows[0]["notes"]
    assert "reused process: case 3 of this worker" in rows[1]["notes"]


def test_a_case_that_kills_its_process_is_reported_and_a_new_process_takes_the_rest(tmp_path, monkeypatch):
    fields = env.environment_fields(None)
    cases = [cpu_case(Workload(batch=b, seq=16)) for b in (1, 2, 3, 4)]
    launches = []

    def fake_run_process(cmd, timeout_s, alloc_conf=None):
        names = [json.loads(line)["workload"]["batch"] for line in Path(cmd[cmd.index("--cases") + 1]).open()]
        launches.append(names)
        out = Path(cmd[cmd.index("--out") + 1])
        with out.open("a") as f:
            for batch in names:
                if batch == 2:  # dies here: a segfault in the middle of the second case
                    return -11, "Fatal Python error: Segmentation fault"
                case = next(c for c in cases if c.workload.batch == batch)
                f.write(json.dumps(measure.build_row(case, fields, [_result()])) + "\n")
        return 0, ""

    monkeypatch.setattr(measure, "run_process", fake_run_process)
    results = list(measure.measure_group(cases, tmp_path, timeout_s=10))
    assert launches == [[1, 2, 3, 4], [3, 4]]
    assert [(c.workload.batch, row is not None) for c, row, _ in results] == [(1, True), (2, False), (3, True),
                                                                               (4, True)]
    assert results[1][2].startswith("killed by signal SIGSEGV")


def _result() -> dict:
    return {"rank": 0, "cuda_context_bytes": None, "oom": False, "oom_stage": None, "oom_message": None,
            "step_time_s": None, "params": 1, "trainable_params": 1, "local_param_bytes": None,
            "stages": {"load": (None, None)}, "nvml_used_bytes": None}


def test_a_deadline_starts_nothing_more_and_the_command_says_so(tmp_path):
    fields = env.environment_fields(None)
    out = tmp_path / "runs.jsonl"
    summary = measure.run_cases([cpu_case(), cpu_case(Workload(batch=3, seq=16))], out, fields, progress=False,
                                reuse_process=True, deadline=time.time() - 1)
    assert (summary.measured, summary.unstarted, summary.failed) == (0, 2, [])
    assert "2 not started before the deadline" in summary.text()
    assert not out.exists() or out.read_text() == ""


def test_groups_share_a_process_only_for_one_model_and_allocator_setting():
    a, b = cpu_case(), cpu_case(Workload(batch=3, seq=16))
    other_conf = cpu_case(alloc_conf="expandable_segments:True")
    ddp = cpu_case(parallel=Parallel(strategy="ddp", gpus=2))
    assert measure._groups([a, b, other_conf, ddp, a], True) == [[a, b], [other_conf], [ddp], [a]]
    assert measure._groups([a, b], False) == [[a], [b]]


@pytest.mark.parametrize("flag", ["--snapshot", "--stream-dir"])
def test_reuse_process_refuses_per_case_recordings_in_one_line(tmp_path, capsys, flag):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY_LLAMA_CONFIG))
    code = bench_main(["measure", "--device", "cpu", "--model", str(model), "--reuse-process", flag,
                       str(tmp_path), "--out", str(tmp_path / "o.jsonl")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: reuse-process: {flag} records one case per process; drop {flag} or --reuse-process"]


def test_a_stream_dir_reaches_the_worker_of_each_case(tmp_path):
    # the worker writes the stream (GPU only); the command line carries the folder to every process it starts
    case = cpu_case()
    cmd = measure.worker_command(case, tmp_path / "c.json", tmp_path / "r.json", None, str(tmp_path / "s"))
    assert cmd[cmd.index("--stream-dir") + 1] == str(tmp_path / "s")
    ddp = measure.worker_command(cpu_case(parallel=Parallel(strategy="ddp", gpus=2)), tmp_path / "c.json",
                                 tmp_path / "r.json", None, str(tmp_path / "s"))
    assert "torch.distributed.run" in ddp and "--stream-dir" in ddp


def test_the_gpu_session_plan_is_valid_grouped_and_names_phi3s_fused_projection(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import measure_plan

    cases = measure_plan.plan_cases()
    assert len(cases) >= 300 and len({measure.canonical_json(c.to_json()) for c in cases}) == len(cases)
    assert {c.model_name for c in cases} >= {"qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b", "gemma-3-4b", "phi-4",
                                             "qwen3-30b-a3b"}
    assert {c.alloc_conf for c in cases} == {"", "expandable_segments:True"}
    # one worker process per run of a model and allocator setting: phase 1 covers every model before any repeat
    keys = [(c.model_name, c.alloc_conf) for c in cases]
    runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    assert runs[:10] == [(m, "") for m in ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b",
                                            "gemma-3-4b", "qwen3-8b", "qwen2.5-7b", "mistral-7b", "phi-4",
                                            "qwen3-30b-a3b")]
    assert all(c.workload.lora_targets == ("qkv_proj",) for c in cases
               if c.model_name == "phi-4" and c.workload.method == "lora")
    assert measure_plan.main(["--out", "unused.jsonl", "--dry-run", "--only", "^phi-4$"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("7 cases") and "phi-4 mode=train method=lora lora_targets=qkv_proj" in out


def test_lora_targets_default_to_peft_per_architecture_unless_given(tmp_path, capsys):
    """Phi-3's attention is one fused qkv_proj: the Workload default (q_proj,v_proj) matches nothing there, and a GPU
    session lost four rows to it. Without --lora-targets, measure takes PEFT's default per architecture."""
    out = str(tmp_path / "o.jsonl")
    assert bench_main(["measure", "--model", "phi-4,llama-3.2-1b", "--method", "lora", "--batch", "1", "--seq",
                       "512", "--out", out, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "lora_targets=qkv_proj" in lines[0] and "lora_targets" not in lines[1]   # llama: q_proj,v_proj, the default
    assert bench_main(["measure", "--model", "phi-4", "--method", "lora", "--lora-targets", "o_proj", "--batch", "1",
                       "--seq", "512", "--out", out, "--dry-run"]) == 0
    assert "lora_targets=o_proj" in capsys.readouterr().out


def test_the_plan_runs_the_phases_asked_for_in_that_order(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import measure_plan

    every = measure_plan.plan_cases()
    later = measure_plan.plan_cases(phases=(2, 3))
    assert 0 < len(later) < len(every)
    assert later[0].alloc_conf == "expandable_segments:True"   # phase 2 first
    assert {c.model_name for c in later} >= {"qwen3-0.6b", "qwen3-1.7b"}  # phase 3's models
    assert len(measure_plan.plan_cases(phases=(2, 3, 1))) == len(every)
    assert measure_plan.main(["--out", "unused.jsonl", "--dry-run", "--phases", "7"]) == 2
    assert (capsys.readouterr().err.strip() ==
            "error: --phases: '7'; allowed: a comma-separated list of 1, 2, 3, 4, 5, 6")
    # the hybrid phases: every config they name exists, and the kernel probe names the same ones
    hybrid = measure_plan.plan_cases(phases=(4, 6))
    assert {c.model_name for c in hybrid} == set(measure_plan.KERNEL_MODELS)
    import kernel_probe
    assert set(kernel_probe.MODULES.values()) == set(measure_plan.KERNEL_MODELS)


def test_a_workers_output_is_kept_where_asked(tmp_path, monkeypatch):
    log = tmp_path / "workers.log"
    code, out = measure.run_process([sys.executable, "-c", "print('from the worker')"], 60)
    assert (code, out.strip(), log.exists()) == (0, "from the worker", False)   # unset: kept nowhere
    monkeypatch.setenv(measure.WORKER_LOG_ENV, str(log))
    measure.run_process([sys.executable, "-c", "print('one')"], 60)
    measure.run_process([sys.executable, "-c", "print('two')"], 60)
    assert log.read_text().split() == ["one", "two"]
