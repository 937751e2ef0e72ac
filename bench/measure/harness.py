"""The measured tier: run a grid of cases on real GPUs, one subprocess per case, one JSON row per case.

    python -m bench measure --model llama-3.2-1b --batch 1,2,4 --seq 2048 --out runs.jsonl

Each case runs in its own process (`bench.measure.worker`; under torchrun for ddp/fsdp) so a CUDA OOM or
a crashed context cannot change later cases. Rows are appended to --out as they finish (one JSON line,
flushed), and a case whose run_id is already in --out is skipped, so an interrupted grid resumes.

A case that dies without writing a row (a segfault, a driver error, the per-case timeout) gets no row:
a made-up row would reach the database looking like a measurement of memory when it is only a failure
of the process, and leaving it out means the next run of the same command retries it. Such cases are
reported on stderr as they happen and in the summary, and the command exits 1.

This module imports neither torch nor DuckDB: the row format lives here so the worker and the
orchestrator build identical run_ids, and the orchestrator learns the GPU and versions from a probe
subprocess (so that this process never creates a CUDA context of its own on GPU 0).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench.trace.grid import describe
from bench.store.rows import (COLUMN_NAMES, MAX_NOTES, STAGES, canonical_json, compute_run_id, config_hash,
                              workload_row)
from estimator.spec import Parallel, Workload, spec_dict
from estimator.units import fmt_bytes
from bench.store.validate import validate_row
from bench.measure import env
from estimator.alloc_conf import parse_alloc_conf

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICES = ("cuda", "cpu")              # cpu = the launch-path test mode; it counts nothing
MEASURED_STRATEGIES = ("single", "ddp", "fsdp")
CPU_TEST_NOTE = "cpu launch-path test: nothing was counted; not a measurement"
ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_TIMEOUT_S = 1800               # one case; a 70B FSDP step with a cold cache takes minutes
REFUSED_KEY = "refused"                 # bench.measure.worker's line for a case it refused (no torch import here)
FAILURE_TAIL_LINES = 60                 # lines of a failed worker's output shown on stderr
WORKER_LOG_ENV = "WILLITFIT_MEASURE_LOG"  # a file every worker's whole output is appended to (unset: none)


@dataclass(frozen=True)
class Case:
    """One measurement: a model config, a workload, how it is split over GPUs, and where it runs."""

    model_name: str
    config: dict = field(hash=False)
    workload: Workload = Workload()
    parallel: Parallel = Parallel()
    device: str = "cuda"
    contributor: str | None = None
    notes: str | None = None
    alloc_conf: str = ""   # PYTORCH_CUDA_ALLOC_CONF the worker runs under ("" : torch's defaults)

    def __post_init__(self) -> None:
        if self.alloc_conf:
            parse_alloc_conf(self.alloc_conf)  # torch's parser, re-implemented: a bad key is one line
        if self.device not in DEVICES:
            raise ValueError(f"device: {self.device!r} is not allowed; choose one of {', '.join(DEVICES)}")
        if not isinstance(self.config, dict) or "model_type" not in self.config:
            raise ValueError("config: must be a config.json object with a model_type")
        check_measurable(self.workload, self.parallel)

    def to_json(self) -> dict:
        return {"model_name": self.model_name, "config": self.config, "workload": spec_dict(self.workload),
                "parallel": spec_dict(self.parallel), "device": self.device,
                "contributor": self.contributor, "notes": self.notes, "alloc_conf": self.alloc_conf}

    @classmethod
    def from_json(cls, d: dict) -> "Case":
        wl = dict(d["workload"])
        wl["lora_targets"] = tuple(t for t in str(wl["lora_targets"]).split(",") if t)
        return cls(model_name=d["model_name"], config=d["config"], workload=Workload(**wl),
                   parallel=Parallel(**d["parallel"]), device=d.get("device", "cuda"),
                   contributor=d.get("contributor"), notes=d.get("notes"), alloc_conf=d.get("alloc_conf", ""))

    def label(self) -> str:
        """Short name for the progress bar and snapshot files; bench.trace.grid.describe is the full one."""
        w, p = self.workload, self.parallel
        parts = [self.model_name, w.mode, w.method, w.precision, f"b{w.batch}", f"s{w.seq}"]
        if w.gen_tokens:
            parts.append(f"g{w.gen_tokens}")
        if p.strategy != "single":
            parts.append(f"{p.strategy}{p.gpus}")
        digest = hashlib.sha256(canonical_json(self.to_json()).encode()).hexdigest()[:8]
        return "-".join(parts + [digest])


def check_measurable(workload: Workload, parallel: Parallel) -> None:
    """Raise ValueError for a case the worker cannot run as labelled (the analytic tier still estimates it).

    Other refusals (an optimizer torch lacks, bitsandbytes missing) come from tracer.runner inside the
    worker and are reported as that case's failure.
    """
    if parallel.strategy not in MEASURED_STRATEGIES:
        raise ValueError(f"strategy: {parallel.strategy!r} is not measured; measured strategies are "
                         f"{', '.join(MEASURED_STRATEGIES)}")
    if parallel.tp_size > 1 or parallel.pp_size > 1 or parallel.ep_size > 1 or parallel.offload != "none":
        raise ValueError("tp: tensor/pipeline/expert parallelism and CPU offload are not measured; use "
                         "tp=pp=ep=1 and offload none")
    if parallel.strategy != "single" and workload.mode != "train":
        raise ValueError(f"strategy: {parallel.strategy} is a training strategy; measure inference with single")
    if workload.kv_dtype != "auto":
        raise ValueError(f"kv_dtype: {workload.kv_dtype!r} is not measured; the runner's KV cache has the "
                         "model's dtype (kv_dtype 'auto')")
    if workload.method == "qlora" or workload.weight_format not in ("auto", "fp32", "bf16", "fp16"):
        raise ValueError("weight_format: the runner builds float weights only (auto, fp32, bf16, fp16); "
                         "quantized weights and qlora are estimated analytically")


# ---------------------------------------------------------------------------------------------- rows

def identity_columns(case: Case, env_fields: dict) -> dict:
    """Every column known before the run, with run_id; the worker and the resume check share this."""
    wl = workload_row(case.workload)  # the workload columns, as bench.trace.cases writes them, so tiers join
    row = {
        "source": "measured",
        **env_fields,
        "gpu_count": case.parallel.gpus,
        "model_name": case.model_name,
        "model_type": case.config.get("model_type"),
        "config_hash": config_hash(case.config),
        "config_json": canonical_json(case.config),
        **wl,
        "strategy": case.parallel.strategy,
        "world_size": case.parallel.gpus,
        "alloc_conf": case.alloc_conf,
    }
    row["run_id"] = compute_run_id(row)
    return row


def _max(values):
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _rank_columns(r: dict) -> dict:
    """One rank's result under the row's column names (the per_rank_json entries)."""
    cols = {"rank": r["rank"]}
    for st, (alloc, reserved) in sorted(r["stages"].items()):
        cols[f"{st}_peak_alloc_bytes"], cols[f"{st}_peak_reserved_bytes"] = alloc, reserved
    cols["peak_alloc_bytes"] = _max(a for a, _ in r["stages"].values())
    cols["peak_reserved_bytes"] = _max(b for _, b in r["stages"].values())
    for k in ("nvml_used_bytes", "cuda_context_bytes", "oom", "oom_stage", "step_time_s", "local_param_bytes"):
        cols[k] = r[k]
    return cols


def build_row(case: Case, env_fields: dict, rank_results: list[dict], extra_notes: tuple[str, ...] = ()) -> dict:
    """The run row from every rank's result: each peak is the maximum over ranks (the rank that must fit)."""
    ranks = [_rank_columns(r) for r in sorted(rank_results, key=lambda r: r["rank"])]
    row = dict.fromkeys(COLUMN_NAMES)  # every column present, as bench.trace.cases writes rows
    row.update(identity_columns(case, env_fields))
    row["created_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    row["contributor"] = case.contributor
    first = rank_results[0]
    row["params"], row["trainable_params"] = first["params"], first["trainable_params"]
    for st in STAGES:
        for kind in ("alloc", "reserved"):
            name = f"{st}_peak_{kind}_bytes"
            row[name] = _max(rk.get(name) for rk in ranks)
    for name in ("peak_alloc_bytes", "peak_reserved_bytes", "nvml_used_bytes", "cuda_context_bytes", "step_time_s"):
        row[name] = _max(rk[name] for rk in ranks)
    oomed = [r for r in rank_results if r["oom"]]
    row["oom"] = bool(oomed)
    row["oom_stage"] = oomed[0]["oom_stage"] if oomed else None
    row["oom_message"] = oomed[0]["oom_message"] if oomed else None
    if case.parallel.gpus > 1:
        row["per_rank_json"] = canonical_json(ranks)
    row["notes"] = _notes(case, row, extra_notes)
    return row


def _notes(case: Case, row: dict, extra: tuple[str, ...]) -> str | None:
    parts = [CPU_TEST_NOTE] if case.device == "cpu" else []
    if row["oom"]:
        parts.append(f"the {row['oom_stage']} peak is what was reached before the failed allocation")
    if case.parallel.strategy == "fsdp":
        parts.append("fsdp: FSDP2 fully_shard per decoder layer and root, built on meta, values uninitialised")
    parts.extend(extra)
    if case.notes:
        parts.append(case.notes)
    return "; ".join(parts)[:MAX_NOTES] or None


# ------------------------------------------------------------------------------------------ running

def existing_run_ids(out: Path) -> set[str]:
    """run_ids already in the JSONL file (lines that do not parse are ignored, with a warning)."""
    ids: set[str] = set()
    if not out.exists():
        return ids
    for n, line in enumerate(out.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(json.loads(line)["run_id"])
        except (ValueError, KeyError, TypeError):
            print(f"{out}:{n}: not a run row; ignored for resuming", file=sys.stderr)
    return ids


def worker_command(case: Case, case_file: Path, row_file: Path, snapshot: str | None,
                   stream_dir: str | None = None) -> list[str]:
    """The worker's command line: a plain process for strategy single, else torchrun (also at one GPU,
    so that DDP's gradient buckets and FSDP's buffers are measured as they exist at any world size)."""
    worker = ["-m", "bench.measure.worker", "--case", str(case_file), "--out", str(row_file)]
    if snapshot:
        worker += ["--snapshot", snapshot]
    if stream_dir:
        worker += ["--stream-dir", stream_dir]
    if case.parallel.strategy == "single":
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={case.parallel.gpus}", *worker]


def _child_env(alloc_conf: str | None = None) -> dict:
    """This process's environment, the repository on PYTHONPATH and, when `alloc_conf` is given, exactly that
    PYTORCH_CUDA_ALLOC_CONF ("" removes it: torch's defaults), read by torch when the child first touches CUDA."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if alloc_conf is not None:
        env.pop(ALLOC_CONF_VAR, None)
        if alloc_conf:
            env[ALLOC_CONF_VAR] = alloc_conf
    return env


def run_process(cmd: list[str], timeout_s: float, alloc_conf: str | None = None) -> tuple[int | None, str]:
    """(exit code or None on timeout, combined output). The child gets its own process group so that on
    timeout torchrun *and* its workers are killed together."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_child_env(alloc_conf), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        _keep_output(output)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        output, _ = proc.communicate()
        _keep_output(output)
        return None, output
    except BaseException:  # Ctrl-C: the child's own session does not get the terminal's SIGINT
        _kill_group(proc.pid)
        proc.wait()
        raise


def _keep_output(output: str | None) -> None:
    """Append a worker's whole output to the file WORKER_LOG_ENV names, if set (what the worker printed is
    otherwise shown only for a case that failed: Triton's autotuning log, library warnings)."""
    path = os.environ.get(WORKER_LOG_ENV)
    if path and output:
        with open(path, "a", encoding="utf-8") as f:
            f.write(output)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group may have ended by itself meanwhile
        os.killpg(pid, signal.SIGKILL)


def probe_environment(device: str, timeout_s: float = 300) -> dict:
    """{"env": environment columns, "device_count": visible CUDA devices} from a short-lived subprocess.

    Raises RuntimeError carrying the worker's one-line refusal when device is 'cuda' and there is no GPU.
    The CPU test mode has no CUDA context to keep out of this process, so it asks in-process.
    """
    if device == "cpu":
        return {"env": env.environment_fields(None), "device_count": None}
    with tempfile.TemporaryDirectory(prefix="willitfit-probe-") as tmp:
        out = Path(tmp) / "env.json"
        cmd = [sys.executable, "-m", "bench.measure.worker", "--probe", device, "--out", str(out)]
        code, output = run_process(cmd, timeout_s)
        if code != 0 or not out.exists():
            lines = output.strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"the environment probe failed (exit {code})")
        return json.loads(out.read_text())


@dataclass
class Summary:
    measured: int = 0                                   # rows written (OOM rows included)
    oom: int = 0                                        # of which hit CUDA OOM
    skipped: int = 0                                    # already in --out
    unstarted: int = 0                                  # not started before the deadline
    failed: list[tuple[str, str]] = field(default_factory=list)  # (case label, why) for cases with no row

    def text(self) -> str:
        lines = [f"measured {self.measured} case(s) ({self.oom} OOM), skipped {self.skipped} already in the "
                 f"output, {len(self.failed)} failed without a row"
                 + (f", {self.unstarted} not started before the deadline" if self.unstarted else "")]
        lines += [f"  FAILED {label}: {why.splitlines()[0]}" for label, why in self.failed]
        return "\n".join(lines)


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception)\b.*)$")


def _describe_exit(code: int | None, timeout_s: float, output: str) -> str:
    """First line: how the process ended and the last exception it printed (torchrun's own report, which
    ends its output, does not repeat the workers' exceptions); then the output's last lines."""
    if code is None:
        how = f"timed out after {timeout_s:g} s; killed"
    elif code < 0:
        how = f"killed by signal {signal.Signals(-code).name}"
    else:
        how = f"worker exited with status {code} without writing a row"
    lines = output.rstrip().splitlines()
    matches = [m for m in map(_ERROR_LINE.match, lines) if m]
    from_ranks = [m for m in matches if m.string.startswith("[rank")]
    matches = from_ranks or matches  # a worker's exception, rather than torchrun's ChildFailedError about it
    head = f"{how}: {matches[-1].group(1)}" if matches else how
    return "\n".join([head, *lines[-FAILURE_TAIL_LINES:]])


def measure_one(case: Case, workdir: Path, timeout_s: float, snapshot: str | None = None,
                stream_dir: str | None = None) -> tuple[dict | None, str]:
    """Run one case in its own process: (row, "") or (None, why it produced no valid row)."""

    case_file, row_file = workdir / "case.json", workdir / "row.json"
    row_file.unlink(missing_ok=True)
    case_file.write_text(json.dumps(case.to_json()))
    code, output = run_process(worker_command(case, case_file, row_file, snapshot, stream_dir), timeout_s,
                               case.alloc_conf)
    if code != 0 or not row_file.exists():
        return None, _describe_exit(code, timeout_s, output)
    row = json.loads(row_file.read_text())
    _, errors = validate_row(row)
    if errors:
        return None, "the worker wrote an invalid row: " + "; ".join(errors)
    return row, ""


def append_line(out: Path, row: dict) -> None:
    """One JSON line, flushed and fsynced (the harness's rows, and the worker's lines under --cases)."""
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())  # a row on disk survives a crash of the next case or of this process


def case_name(case: Case) -> str:
    """bench.trace.grid.describe's line, and the allocator settings when the case sets any."""
    return describe(case) + (f" alloc_conf={case.alloc_conf}" if case.alloc_conf else "")


def result_line(case: Case, row: dict) -> str:
    """'<case>: peak 12.34 GiB allocated, 13.00 GiB reserved' or '<case>: OOM in backward'."""
    name = case_name(case)
    if row["oom"]:
        return f"{name}: OOM in {row['oom_stage']}"
    if row["peak_alloc_bytes"] is None:
        return f"{name}: ran (nothing counted)"
    return (f"{name}: peak {fmt_bytes(row['peak_alloc_bytes'])} allocated, "
            f"{fmt_bytes(row['peak_reserved_bytes'])} reserved")


def measure_group(cases: list[Case], workdir: Path, timeout_s: float, deadline: float | None = None):
    """Measure single-GPU cases of one allocator setting in one reused worker process (`worker --cases`).

    Yields (case, row or None, why) in order. When the process dies, the first case without a row is reported
    with the process's exit and a new process takes the cases after it; cases the deadline left unstarted are
    yielded as (case, None, "") and not reported as failures."""
    pending = list(cases)
    while pending:
        case_file, rows_file = workdir / "cases.jsonl", workdir / "rows.jsonl"
        rows_file.unlink(missing_ok=True)
        case_file.write_text("".join(json.dumps(c.to_json()) + "\n" for c in pending))
        cmd = [sys.executable, "-m", "bench.measure.worker", "--cases", str(case_file), "--out", str(rows_file)]
        if deadline is not None:
            cmd += ["--deadline", repr(deadline)]
        code, output = run_process(cmd, timeout_s * len(pending), pending[0].alloc_conf)
        rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
        for case, row in zip(pending, rows):
            if set(row) == {REFUSED_KEY}:
                yield case, None, str(row[REFUSED_KEY])
                continue
            errors = validate_row(row)[1]
            yield case, (None if errors else row), ("the worker wrote an invalid row: " + "; ".join(errors)
                                                     if errors else "")
        rest = pending[len(rows):]
        if not rest:
            return
        if code == 0:  # the deadline stopped it
            for case in rest:
                yield case, None, ""
            return
        yield rest[0], None, _describe_exit(code, timeout_s * len(pending), output)
        pending = rest[1:]


def _shares_process(case: Case) -> bool:
    return case.parallel.strategy == "single" and case.parallel.gpus == 1


def _groups(cases: list[Case], reuse_process: bool) -> list[list[Case]]:
    """Runs of consecutive cases that share a worker process (single-GPU, one model and allocator setting);
    every other case is a group of its own."""
    groups: list[tuple[tuple | None, list[Case]]] = []
    for case in cases:
        key = (case.model_name, case.alloc_conf, case.device) if reuse_process and _shares_process(case) else None
        if key is not None and groups and groups[-1][0] == key:
            groups[-1][1].append(case)
        else:
            groups.append((key, [case]))
    return [g for _, g in groups]


def run_cases(cases: list[Case], out: Path, env_fields: dict, timeout_s: float = DEFAULT_TIMEOUT_S,
              snapshot: str | None = None, progress: bool = True, reuse_process: bool = False,
              deadline: float | None = None, stream_dir: str | None = None) -> Summary:
    """Measure every case not already in `out`, appending one row per case as it finishes.

    reuse_process: consecutive single-GPU cases of one model and allocator setting share a worker process
    (`measure_group`); no snapshot or stream then. deadline (seconds since the epoch): no case starts after it.
    stream_dir: each case's allocation stream (.npz, offline.allocator.stream) per rank, for `bench replay`."""
    from tqdm import tqdm

    out.parent.mkdir(parents=True, exist_ok=True)
    snapshot = str(Path(snapshot).resolve()) if snapshot else None
    stream_dir = str(Path(stream_dir).resolve()) if stream_dir else None
    done, summary = existing_run_ids(out), Summary()
    todo = [c for c in cases if identity_columns(c, env_fields)["run_id"] not in done]
    summary.skipped = len(cases) - len(todo)
    bar = tqdm(total=len(todo), desc="measure", unit="case", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    with tempfile.TemporaryDirectory(prefix="willitfit-measure-") as tmp:
        reuse = reuse_process and not snapshot and not stream_dir
        for group in _groups(todo, reuse):
            if deadline is not None and time.time() > deadline:
                summary.unstarted += len(group)
                continue
            bar.set_postfix_str(group[0].label(), refresh=True)
            if reuse and _shares_process(group[0]):
                results = measure_group(group, Path(tmp), timeout_s, deadline)
            else:
                results = [(group[0], *measure_one(group[0], Path(tmp), timeout_s, snapshot, stream_dir))]
            for case, row, why in results:
                bar.update()
                if row is None and not why:
                    summary.unstarted += 1
                    continue
                _record(case, row, why, out, env_fields, done, summary)
    bar.close()
    return summary


def _record(case: Case, row: dict | None, why: str, out: Path, env_fields: dict, done: set, summary: Summary):
    from tqdm import tqdm

    if row is None:
        summary.failed.append((case_name(case), why))
        tqdm.write(f"FAILED {case_name(case)}: {why}", file=sys.stderr)
        return
    if row["run_id"] != identity_columns(case, env_fields)["run_id"]:  # still a true measurement: kept
        tqdm.write(f"warning: {case_name(case)}: the worker's GPU or versions differ from the probe's; "
                   "a rerun will not recognise this row and will measure the case again", file=sys.stderr)
    append_line(out, row)
    tqdm.write(result_line(case, row), file=sys.stderr)
    done.add(row["run_id"])
    summary.measured += 1
    summary.oom += bool(row["oom"])
