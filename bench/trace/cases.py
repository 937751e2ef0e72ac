"""Traced tier rows: trace a case on fake CPU tensors (`tracer.session`) and write it as a run row.

    row = trace_case(config, "llama-2-7b", Workload(batch=4, seq=512), Parallel())
"""
from __future__ import annotations

import functools
from datetime import datetime, timezone

from bench.measure import env
from bench.store.rows import COLUMN_NAMES, canonical_json, compute_run_id, config_hash, workload_row
from estimator.spec import Parallel, Workload
from tracer.session import (FSDP_STRATEGIES, TRACED_STRATEGIES, Trace, check_checkable,  # noqa: F401
                                     check_traceable, run_traced)


FAKE_GPU_NAME = "fake-cpu"
NOTES = ("traced on fake CPU tensors: exact bytes of every tensor storage the ops allocate; no caching-allocator "
         "rounding, no fragmentation, no CUDA context, no kernel workspaces (cuBLAS, attention scratch)")


def trace_case(config: dict, name: str, workload: Workload, parallel: Parallel = Parallel(), *,
               steps: int = 2, check: bool = False, kernels: str = "cuda") -> dict:
    """Trace one case and return its run row (every column of bench.store.rows.COLUMNS); see `run_traced`. A
    pipeline's ranks hold different stages (tracer.pp): each is traced, the row is the worst rank's, and its
    per_rank_json lists every rank's peak."""
    if parallel.pp_size == 1:
        trace = run_traced(config, workload, parallel, steps=steps, check=check, name=name, kernels=kernels)
        return build_row(config, name, workload, parallel, trace, kernels)
    traces = [run_traced(config, workload, parallel, steps=steps, check=check, name=name, kernels=kernels, rank=r)
              for r in range(parallel.pp_size)]
    trace = max(traces, key=lambda t: t.log.peak.peak_bytes)
    trace.per_rank = {**(trace.per_rank or {}), "rank_peaks": [t.log.peak.peak_bytes for t in traces]}
    return build_row(config, name, workload, parallel, trace, kernels)


@functools.lru_cache(maxsize=1)
def _software() -> dict:
    """Library versions (read once per process; a traced row has no driver and no CUDA runtime)."""
    return {**env.software_fields(), "cuda_version": None, "driver_version": None}


def _identity_row(config: dict, workload: Workload, parallel: Parallel, kernels: str = "cuda") -> dict:
    """Every column None except those that say what was traced where (enough for compute_run_id); `kernels`
    joins the run_id when it is not the default "cuda" (bench.store.rows.LATER_IDENTITY_DEFAULTS)."""
    row = dict.fromkeys(COLUMN_NAMES)
    row.update(_software())
    row.update(workload_row(workload))
    row.update(source="traced", gpu_name=FAKE_GPU_NAME, gpu_total_bytes=None, gpu_count=parallel.gpus,
               config_hash=config_hash(config), strategy=parallel.strategy, world_size=parallel.gpus,
               kernels=kernels)
    return row


def unstorable(parallel: Parallel, workload: Workload | None = None) -> str | None:
    """Why a run row cannot tell this case from another, or None: a row names the strategy and the world size, no
    mesh degrees (bench.store.rows.COLUMNS), so an FSDP x TP / PP / CP rank, sequence parallelism or a pipeline's own
    schedule would be stored, and found again, as the plain strategy on as many GPUs; and it has no column for a
    vision-language model's images, an audio-language model's clips or an encoder-decoder model's target length
    (bench.store.rows.NOT_COLUMNS), so such a step would be stored as text-only, or as a decoder as long as its
    encoder."""
    if workload is not None and workload.images:
        return (f"out: a run row has no images column, so a step with {workload.images} image(s) per sample would be "
                "stored as a text-only one; trace it without --out / --ingest (the table is printed)")
    if workload is not None and workload.audio_seconds:
        return (f"out: a run row has no audio_seconds column, so a step on {workload.audio_seconds} s of audio would "
                "be stored as one on the model's default window; trace it without --out / --ingest (the table is "
                "printed)")
    if workload is not None and workload.audios:
        return (f"out: a run row has no audios column, so a step with {workload.audios} audio clip(s) per sample would "
                "be stored as a text-only one; trace it without --out / --ingest (the table is printed)")
    if workload is not None and workload.target_seq:
        return (f"out: a run row has no target_seq column, so a step whose decoder reads {workload.target_seq} tokens "
                "would be stored as one whose decoder reads seq; trace it without --out / --ingest (the table is "
                "printed)")
    p = parallel
    mesh = [f"{k} {v}" for k, v, own in (("tp", p.tp_size, "tp"), ("pp", p.pp_size, "pp"), ("ep", p.ep_size, "ep"),
                                         ("cp", p.cp, None)) if v > 1 and p.strategy != own]
    mesh += ["sequence parallelism"] if p.sequence_parallel else []
    mesh += [f"pipeline schedule {p.pp_schedule}, {p.microbatches} micro-batches"] \
        if p.pp_size > 1 and (p.pp_schedule != "1f1b" or p.microbatches) else []
    if not mesh:
        return None
    return (f"out: a run row names the strategy and world size only, so {p.strategy} on {p.gpus} GPUs with "
            f"{', '.join(mesh)} would be stored as plain {p.strategy}; trace it without --out / --ingest (the table "
            "is printed)")


def case_run_id(config: dict, workload: Workload, parallel: Parallel, kernels: str = "cuda") -> str:
    """The run_id `trace_case` gives this case on this machine, computed without tracing (for resuming)."""
    return compute_run_id(_identity_row(config, workload, parallel, kernels))


def build_row(config: dict, name: str, workload: Workload, parallel: Parallel, trace: Trace,
              kernels: str = "cuda") -> dict:
    """A run row with every column; traced rows have no reserved bytes, no GPU and no step time."""
    row = _identity_row(config, workload, parallel, kernels)
    log = trace.log
    row.update(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), model_name=name,
        model_type=str(config.get("model_type")), params=trace.params, trainable_params=trace.trainable_params,
        config_json=canonical_json(config), peak_alloc_bytes=log.peak.peak_bytes, oom=False,
        breakdown_json=canonical_json(log.breakdown_json()),
        notes="; ".join([NOTES, *trace.notes, f"traced in {trace.seconds:.1f} s"]),
    )
    for stage in log.stages:
        row[f"{stage.stage}_peak_alloc_bytes"] = stage.peak_bytes
    if parallel.gpus > 1:
        ranks = dict(trace.per_rank or {"world_size": parallel.gpus, "traced_rank": 0})
        ranks["ranks"] = [{"rank": 0, "peak_alloc_bytes": log.peak.peak_bytes,
                           **{f"{s.stage}_peak_alloc_bytes": s.peak_bytes for s in log.stages},
                           "breakdown": log.peak.breakdown}]
        row["per_rank_json"] = canonical_json(ranks)
    row["run_id"] = compute_run_id(row)
    return row
