"""Measure one case on a real GPU, in a process of its own.

    python -m bench.measure.worker --case case.json --out row.json [--snapshot DIR] [--stream-dir DIR]
    python -m bench.measure.worker --cases cases.jsonl --out rows.jsonl [--deadline EPOCH_S]
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.measure.worker --case ... --out ...

`bench.measure.harness` launches this once per case, so an OOM or a broken CUDA context dies with its process
and cannot change the next case's numbers. With `--cases` (the harness's `--reuse-process`) one process measures
several single-GPU cases in turn and tears each down before the next (`teardown`): what stays from earlier cases is
the CUDA context and the kernels they loaded, which count in nvml_used_bytes; each row's notes say so. With torchrun (strategy ddp or fsdp) every rank measures its
own GPU, the ranks gather their results to rank 0, and rank 0 writes the one row.

What is counted, per rank (all integer bytes):
- cuda_context_bytes = NVML used after CUDA start - NVML used before it - torch.cuda.memory_reserved().
  "CUDA start" is torch.cuda.init() plus a one-element tensor, which forces the primary context; the
  caching allocator serves that tensor from one fresh 2 MiB small-pool segment (kSmallBuffer for requests
  up to kSmallSize = 1 MiB, c10/cuda/CUDACachingAllocator.cpp), and memory_reserved() (exactly that
  segment) is subtracted so only the context (driver state, kernel images loaded so far)
  remains. Kernels loaded later (cuBLAS, NCCL buffers) are not in it; they show in nvml_used_bytes.
- <stage>_peak_alloc_bytes / _reserved_bytes: the load stage starts once the model is built (its random
  initialisation's transients are not loading's), and at every stage boundary the device is synchronised,
  max_memory_allocated()/max_memory_reserved() are read and the peaks are reset, so each value is the
  highest total in use *during* that stage (memory already live at its start included). A stage that
  repeats (every step, every decoded token) keeps its maximum.
- nvml_used_bytes: the largest NVML reading taken at stage ends. Nothing here calls empty_cache and the
  caching allocator frees cached blocks only to retry an allocation that would otherwise fail, so the
  reading after the stage with the reserved peak is (but for such a retry) the reading at that peak.
- step_time_s: wall time of one steady-state pass (one optimizer step, or one prefill + decode), timed
  between synchronisations after a burn-in pass; it includes the per-stage synchronisations above.

`--device cpu` is a test mode for the launch and gather path only (gloo backend, nothing counted).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.measure import env
from tracer import runner
from bench.measure import harness
from bench.measure.harness import Case, build_row
from bench.store.rows import MAX_NOTES
from offline.allocator.stream import stream_from_snapshot
from estimator.spec import spec_dict

REFUSAL = "measure needs a CUDA GPU; use `python -m bench trace` on CPU"
SNAPSHOT_MAX_ENTRIES = 100_000  # allocation events kept for memory_viz; enough for a few steps of a large model


class CudaBackend:
    """Counts with the CUDA caching allocator's statistics and NVML, on one device."""

    counts = True

    def __init__(self, index: int):
        self.index = index
        self.device = torch.device("cuda", index)
        self.nvml = env.nvml_handle(index)

    def start(self) -> None:
        """Start CUDA on this device and set cuda_context_bytes (None without NVML); see module doc."""
        before = env.nvml_used_bytes(self.nvml)
        torch.cuda.set_device(self.index)
        torch.cuda.init()
        probe = torch.empty(1, device=self.device)
        torch.cuda.synchronize(self.device)
        after = env.nvml_used_bytes(self.nvml)
        segment_bytes = torch.cuda.memory_reserved(self.device)
        del probe
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.context_bytes = None if before is None or after is None else max(0, after - before - segment_bytes)

    def boundary(self) -> tuple[int, int]:
        """(peak allocated, peak reserved) since the last boundary, then reset the peaks."""
        torch.cuda.synchronize(self.device)
        peaks = torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peaks

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def used_bytes(self) -> int | None:
        return env.nvml_used_bytes(self.nvml)

    def clock(self) -> float:
        torch.cuda.synchronize(self.device)
        return time.perf_counter()


class CpuBackend:
    """Test mode: runs the same code path on CPU and counts nothing (every memory field stays None)."""

    counts = False
    device = torch.device("cpu")
    context_bytes = None

    def start(self) -> None:
        pass

    def boundary(self) -> tuple[None, None]:
        return None, None

    def reserved_bytes(self) -> int:
        return 0

    def used_bytes(self) -> None:
        return None

    def clock(self) -> float:
        return time.perf_counter()


class NoCudaError(RuntimeError):
    """measure was asked for a GPU and there is none."""


def make_backend(device: str, local_rank: int):
    """The counting backend for `device`; raises NoCudaError for 'cuda' on a machine without a CUDA GPU."""
    if device == "cpu":
        return CpuBackend()
    if not torch.cuda.is_available():
        raise NoCudaError(REFUSAL)
    return CudaBackend(local_rank)


def _next_stage(last: str, workload, micro_done: int) -> str:
    """The stage that runs after `last`, in tracer.runner.run_stages's order (names the stage an OOM hit)."""
    if workload.mode == "infer":
        return "prefill" if last == "load" else "decode"
    if last == "forward":
        return "backward"
    if last == "backward" and micro_done % workload.grad_accum == 0:
        return "optimizer"
    return "forward"


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


class StageRecorder:
    """The on_stage callback: closes the stage that just ended and keeps per-stage maxima."""

    def __init__(self, backend, workload):
        self.backend, self.workload = backend, workload
        self.peaks: dict[str, tuple] = {}  # stage -> (peak alloc bytes, peak reserved bytes)
        self.last = "load"                 # the stage before the first marker is the load
        self.micro_done = 0                # backward passes finished (locates an OOM between micro-batches)
        self.nvml_used_bytes = None
        self.max_reserved = -1
        self.stage_ends: list[tuple[int, str]] = []   # (time in us, stage): labels the --stream-dir stream

    def _keep(self, stage: str, alloc, reserved) -> None:
        old_alloc, old_reserved = self.peaks.get(stage, (None, None))
        self.peaks[stage] = (_max(old_alloc, alloc), _max(old_reserved, reserved))

    def __call__(self, stage: str) -> None:
        alloc, reserved = self.backend.boundary()
        self.stage_ends.append((time.time_ns() // 1000, stage))
        self._keep(stage, alloc, reserved)
        if self.backend.counts and self.backend.reserved_bytes() > self.max_reserved:
            # reserved only grows, so NVML needs re-reading only when it did (keeps decode loops cheap)
            self.max_reserved = self.backend.reserved_bytes()
            used = self.backend.used_bytes()
            if used is not None:
                self.nvml_used_bytes = max(used, self.nvml_used_bytes or 0)
        self.micro_done += stage == "backward"
        self.last = stage

    def close_oom(self) -> str:
        """Record the peak the failing stage reached before the failed allocation; return that stage."""
        stage = "load" if not self.peaks else _next_stage(self.last, self.workload, self.micro_done)
        alloc, reserved = self.backend.boundary()
        self._keep(stage, alloc, reserved)
        return stage


def _shard_fsdp(model, mesh) -> None:
    """FSDP2: fully_shard every decoder layer, then the root (the same units bench.trace.cases shards)."""
    from torch.distributed.fsdp import fully_shard
    from transformers.modeling_layers import GradientCheckpointingLayer  # HF's base class of decoder layers

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"model_type: {model.config.model_type!r} has no decoder layers FSDP can wrap")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_parallel(case: Case, backend):
    """The model on this rank: plain, DDP-wrapped, or FSDP2-sharded. Returns (model, params, trainable)."""
    wl, strategy = case.workload, case.parallel.strategy
    if strategy == "fsdp":
        # Built on meta and sharded before storage exists, so a rank never holds the whole model.
        # Values stay uninitialised (as runner's meta_then_empty), which changes no tensor's size.
        from torch.distributed.device_mesh import init_device_mesh

        model = runner.build_model(case.config, wl, device="meta")
        params, trainable = _count_params(model)
        _shard_fsdp(model, init_device_mesh(backend.device.type, (case.parallel.gpus,)))
        model.to_empty(device=backend.device)
        return model, params, trainable
    model = runner.build_model(case.config, wl, device=str(backend.device))
    params, trainable = _count_params(model)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [backend.device.index] if backend.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    return model, params, trainable


def _count_params(model) -> tuple[int, int]:
    params = list(model.parameters())  # unique Parameters: tied embeddings count once
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _local_param_bytes(model) -> int:
    """Parameter bytes this rank stores: its shards under FSDP (DTensor.to_local), everything otherwise."""
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local)


def measure_case(case: Case, backend, rank: int = 0, snapshot_dir: str | None = None,
                 stream_dir: str | None = None) -> dict:
    """Run the case on this rank (backend already started) and return its per-rank result.

    A CUDA OOM becomes oom=True with the stage it hit; any other exception propagates (no row)."""
    result = {"rank": rank, "cuda_context_bytes": backend.context_bytes, "oom": False, "oom_stage": None,
              "oom_message": None, "step_time_s": None, "params": None, "trainable_params": None,
              "local_param_bytes": None}
    rec = StageRecorder(backend, case.workload)
    if (snapshot_dir or stream_dir) and backend.counts:
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)
    try:
        backend.boundary()  # the load stage starts here
        _run(case, backend, rec, result)
    except torch.OutOfMemoryError as e:
        result.update(oom=True, oom_stage=rec.close_oom(), oom_message=str(e)[:MAX_NOTES])
    finally:
        if stream_dir and backend.counts:
            _save_stream(stream_dir, case, rank, rec.stage_ends)
        if snapshot_dir and backend.counts:
            _dump_snapshot(snapshot_dir, case, rank)
        elif stream_dir and backend.counts:
            torch.cuda.memory._record_memory_history(enabled=None)
    result["stages"] = rec.peaks
    result["nvml_used_bytes"] = rec.nvml_used_bytes
    return result


def _run(case: Case, backend, rec: StageRecorder, result: dict) -> None:
    wl = case.workload
    model, result["params"], result["trainable_params"] = build_parallel(case, backend)
    # Random initialisation is not loading: HF allocates an untied output head and only then ties it to the
    # embeddings (a vocab x hidden transient that from_pretrained never holds), so the load stage starts here,
    # with the model built (rows before tool_version 0.2.0 include that transient)
    backend.boundary()
    result["local_param_bytes"] = _local_param_bytes(model)
    optimizer = runner.make_optimizer(model, wl)
    inputs = runner.make_inputs(case.config, wl, str(backend.device), model)
    rec("load")
    # keep-output: the burn-in's model output stays alive into the timed step's forward, as in one Python loop
    live = {} if wl.mode == "train" else None
    runner.run_stages(model, optimizer, wl, inputs, rec, steps=1, live=live)  # burn-in: optimizer states appear
    start = backend.clock()
    runner.run_stages(model, optimizer, wl, inputs, rec, steps=1, live=live)  # the steady-state pass, timed
    if backend.counts:  # the CPU test mode records no figures at all
        result["step_time_s"] = backend.clock() - start


def _dump_snapshot(snapshot_dir: str, case: Case, rank: int) -> None:
    """Allocator history for https://pytorch.org/memory_viz (torch writes it as a pickle; nothing here reads it)."""
    Path(snapshot_dir).mkdir(parents=True, exist_ok=True)
    name = f"{case.label()}-rank{rank}.pickle"
    torch.cuda.memory._dump_snapshot(str(Path(snapshot_dir) / name))
    torch.cuda.memory._record_memory_history(enabled=None)


def _save_stream(stream_dir: str, case: Case, rank: int, stage_ends: list[tuple[int, str]]) -> None:
    """The recorded allocator history as an allocation stream (.npz, offline.allocator.Stream) with the run's
    stage names, for python -m bench replay: the measured counterpart of trace --stream."""


    meta = {"model": case.label(), "rank": rank, "workload": spec_dict(case.workload),
            "parallel": spec_dict(case.parallel),
            "versions": {k: v for k, v in env.software_fields().items() if k.endswith("_version")}}
    stream = stream_from_snapshot(torch.cuda.memory._snapshot(), device=torch.cuda.current_device(), meta=meta,
                                  stage_ends=stage_ends)
    Path(stream_dir).mkdir(parents=True, exist_ok=True)
    stream.save(Path(stream_dir) / f"{case.label()}-rank{rank}.npz")


def _gather(result: dict, world_size: int) -> list[dict] | None:
    """All ranks' results on rank 0 (None on the others)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [result]
    out = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(result, out, dst=0)
    return out


WARM_NOTE = "reused process: case {i} of this worker; kernels loaded by earlier cases count in nvml_used_bytes"


def teardown(backend) -> int:
    """Return the device to a fresh process's state between cases; the bytes still allocated afterwards.

    The case's objects are unreachable once measure_case returns; gc.collect() frees their cycles (HF modules
    hold some), cuBLAS's per-handle workspaces (allocated by the caching allocator at the first matmul, and kept)
    are released so the next case allocates them again as a fresh process does, then every cached segment goes
    back to CUDA and the peaks are reset."""
    gc.collect()
    if not backend.counts:
        return 0
    torch.cuda.synchronize(backend.device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(backend.device)
    return torch.cuda.memory_allocated(backend.device)


def _measure_many(cases_file: str, out: str, deadline: float | None) -> int:
    """Measure each case of a JSONL file in this one process, appending its row to `out` as it finishes.

    Single-GPU cases only. A case the runner refuses (ValueError, NotImplementedError) gets a {"refused": why}
    line instead of a row and the next case runs; any other exception ends the process with no line for its case,
    and the harness starts a new process for the cases after it. No case starts after `deadline` (seconds since the epoch)."""
    cases = [Case.from_json(json.loads(line)) for line in Path(cases_file).read_text().splitlines() if line.strip()]
    if any(c.parallel.strategy != "single" or c.parallel.gpus != 1 for c in cases):
        raise ValueError("strategy: a reused process measures single-GPU cases only")
    backend = make_backend(cases[0].device, 0)
    backend.start()
    env_fields = env.environment_fields(0 if backend.counts else None)
    versions = ", ".join(f"{k} {v}" for k, v in env.extra_versions().items() if v)
    for i, case in enumerate(cases, 1):
        if deadline is not None and time.time() > deadline:
            print(f"deadline: {len(cases) - i + 1} case(s) not started", file=sys.stderr)
            break
        leftover = teardown(backend)
        try:
            result = measure_case(case, backend)
        except (ValueError, NotImplementedError) as e:
            # the runner's refusals of a case (LoRA targets the model lacks, an optimizer torch lacks) come before
            # or instead of any GPU work: report this case and go on with the next in this process
            harness.append_line(Path(out), {harness.REFUSED_KEY: f"{type(e).__name__}: {e}"[:MAX_NOTES]})
            print(f"refused {i}/{len(cases)} {case.label()}: {e}", file=sys.stderr, flush=True)
            continue
        notes = [versions] if versions else []
        notes.append(WARM_NOTE.format(i=i))
        if leftover:
            notes.append(f"{leftover} bytes of earlier cases were still allocated when it started")
        harness.append_line(Path(out), build_row(case, env_fields, [result], tuple(notes)))
        print(f"done {i}/{len(cases)} {case.label()}", file=sys.stderr, flush=True)
    return 0


def _probe(device: str, out: str) -> int:
    """Write {"env": environment columns, "device_count": n} for the orchestrator's resume check."""
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise NoCudaError(REFUSAL)
    info = {"env": env.environment_fields(0 if cuda else None),
            "device_count": torch.cuda.device_count() if cuda else None}
    Path(out).write_text(json.dumps(info))
    return 0


def _measure(case: Case, out: str, snapshot_dir: str | None, stream_dir: str | None = None) -> int:
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size != case.parallel.gpus:
        raise ValueError(f"gpus: the case asks for {case.parallel.gpus} processes, launched with {world_size}")
    backend = make_backend(case.device, local_rank)
    backend.start()  # before NCCL allocates its buffers, so they are not counted as context
    distributed = case.parallel.strategy != "single"
    if distributed:
        import torch.distributed as dist
        kw = {"device_id": backend.device} if backend.counts else {}
        dist.init_process_group(backend="nccl" if backend.counts else "gloo", **kw)
    result = measure_case(case, backend, rank, snapshot_dir, stream_dir)
    gc.collect()  # the model is gone; return its memory so the gather (NCCL) has room after an OOM
    if backend.counts:
        torch.cuda.empty_cache()
    results = _gather(result, world_size)
    if rank == 0:
        versions = ", ".join(f"{k} {v}" for k, v in env.extra_versions().items() if v)
        row = build_row(case, env.environment_fields(local_rank if backend.counts else None), results,
                        (versions,) if versions else ())
        Path(out).write_text(json.dumps(row) + "\n")
    if distributed:
        # every rank waits until rank 0 has written the row: a rank that tears its process group down while a
        # peer still holds the gather's connections can abort that peer (seen once in a while with gloo on CPU)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.measure.worker", description=__doc__.splitlines()[0])
    p.add_argument("--case", help="JSON file of one case, as bench.measure.harness writes it")
    p.add_argument("--cases", help="JSONL file of single-GPU cases to measure in turn in this process; rows are "
                   "appended to --out")
    p.add_argument("--deadline", type=float, default=None, help="with --cases: start no case after this time "
                   "(seconds since the epoch)")
    p.add_argument("--out", required=True, help="file rank 0 writes the row to (JSON); with --probe, the environment")
    p.add_argument("--snapshot", default=None, help="directory for one CUDA memory snapshot per rank (memory_viz)")
    p.add_argument("--stream-dir", default=None, help="directory for one allocation stream (.npz) per rank, from "
                   "the recorded allocator history: python -m bench replay reads it")
    p.add_argument("--probe", choices=("cuda", "cpu"), help="only report the environment and device count")
    args = p.parse_args(argv)
    if sum(a is not None for a in (args.case, args.cases, args.probe)) != 1:
        p.error("give exactly one of --case, --cases and --probe")
    try:
        if args.probe:
            return _probe(args.probe, args.out)
        if args.cases:
            return _measure_many(args.cases, args.out, args.deadline)
        return _measure(Case.from_json(json.loads(Path(args.case).read_text())), args.out, args.snapshot,
                        args.stream_dir)
    except NoCudaError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
