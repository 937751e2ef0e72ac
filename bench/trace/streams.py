"""Allocation streams of traced runs: what the caching allocator would be asked, in order, as a
`offline.allocator.Stream` (.npz) with provenance, and their replay summarised for printing.

    row, stream = trace_stream(config, "llama-3.2-1b", Workload(batch=1, seq=512), Parallel())
    stream.save("run.npz")                       # python -m bench trace ... --stream run.npz
    print(format_replay(stream, parse_alloc_conf("expandable_segments:True")))   # python -m bench replay run.npz

The events are StorageCounter.allocation_events() of the traced rank (tracer/counters.py): one
allocation per tensor storage the ops create, one free when it dies, stage = the stage window it falls in.
"""
from __future__ import annotations

import numpy as np

from bench.measure import env
from bench.store.rows import config_hash
from estimator.alloc_conf import AllocatorConfig
from offline.allocator.replay import oom_capacity, replay, segments_at
from offline.allocator.stream import Stream
from estimator.spec import Parallel, Workload, spec_dict
from estimator.units import GiB, fmt_bytes
from bench.trace import cases as trace_mod


def stream_of(trace, config: dict, name: str, workload: Workload, parallel: Parallel, kernels: str = "cuda",
              steps: int = 2) -> Stream:
    """The Stream of a run traced with run_traced(..., stream=True); meta says what was traced, with what."""
    if trace.events is None:
        raise ValueError("trace: has no allocation events; run it with run_traced(..., stream=True)")
    kind, handle, nbytes, stage, names = trace.events
    meta = {"source": "traced", "model": name, "model_type": str(config.get("model_type")),
            "config_hash": config_hash(config), "workload": spec_dict(workload), "parallel": spec_dict(parallel),
            "kernels": kernels, "steps": steps, "peak_alloc_bytes": int(trace.log.peak.peak_bytes),
            "versions": {k: v for k, v in env.software_fields().items() if k.endswith("_version")}}
    return Stream(np.asarray(kind, np.int8), np.asarray(handle, np.int64), np.asarray(nbytes, np.int64),
                  np.asarray(stage, np.int16), tuple(names), meta)


def trace_stream(config: dict, name: str, workload: Workload, parallel: Parallel = Parallel(), *,
                 steps: int = 2, kernels: str = "cuda") -> tuple[dict, Stream]:
    """Trace one case (tracer.session.run_traced) and return its run row and its allocation stream."""

    t = trace_mod.run_traced(config, workload, parallel, steps=steps, name=name, kernels=kernels, stream=True)
    row = trace_mod.build_row(config, name, workload, parallel, t, kernels)
    return row, stream_of(t, config, name, workload, parallel, kernels, steps)


def summary(stream: Stream, config: AllocatorConfig = AllocatorConfig(), capacity_bytes: int | None = None,
            with_capacity: bool = True) -> dict:
    """One replay as a JSON-ready dict: per-stage and overall peaks, the cache at the reserved peak (largest
    free block, fragmentation = reserved - allocated, segments), the OOM under `capacity_bytes` if any, and
    oom_capacity (the smallest capacity, in 2 MiB steps, that replays without OOM)."""
    r = replay(stream, config, capacity_bytes)
    peak_event = int(np.argmax(r.reserved)) if len(r.reserved) else 0
    segs = segments_at(stream, peak_event + 1 if len(r.reserved) else 0, config)
    stages = [_stats(s) for s in r.stages if s.events]
    out = {"events": len(stream), "alloc_conf": config.source, "meta": stream.meta, "stages": stages,
           "overall": _stats(r.overall), "segments_at_peak": len(segs),
           "capacity_bytes": capacity_bytes, "oom": None}
    if r.oom is not None:
        o = r.oom
        out["oom"] = {"event": o.event, "stage": o.stage, "requested_bytes": o.requested_bytes,
                      "segment_bytes": o.segment_bytes, "allocated_bytes": o.allocated_bytes,
                      "reserved_bytes": o.reserved_bytes}
    if with_capacity:
        out["oom_capacity_bytes"] = oom_capacity(stream, config)
    return out


def _stats(s) -> dict:
    return {"name": s.name, "events": s.events, "peak_allocated_bytes": s.peak_allocated_bytes,
            "peak_reserved_bytes": s.peak_reserved_bytes, "largest_free_at_peak_bytes": s.largest_free_at_peak_bytes,
            "fragmentation_at_peak_bytes": s.fragmentation_at_peak_bytes, "device_allocs": s.device_allocs,
            "alloc_retries": s.alloc_retries}


def format_summary(d: dict) -> str:
    """The replay summary as a table (GiB = 2^30 bytes; the overall line also in GB = 10^9 bytes)."""
    m = d["meta"]
    head = [f"stream: {d['events']:,} events ({m.get('source', '?')}: {m.get('model', '?')}"
            + (f", {m['workload'].get('mode')} batch {m['workload'].get('batch')} x seq {m['workload'].get('seq')}"
               if isinstance(m.get("workload"), dict) else "") + ")",
            f"allocator: {d['alloc_conf'] or 'defaults'} (PYTORCH_CUDA_ALLOC_CONF)", ""]
    cols = ("stage", "allocated GiB", "reserved GiB", "largest free GiB", "fragmentation GiB", "cudaMalloc")
    rows = [(s["name"], s["peak_allocated_bytes"], s["peak_reserved_bytes"], s["largest_free_at_peak_bytes"],
             s["fragmentation_at_peak_bytes"], s["device_allocs"]) for s in d["stages"] + [d["overall"]]]
    rows[-1] = ("PEAK (step)",) + rows[-1][1:]
    width = max(len(cols[0]), *(len(r[0]) for r in rows))
    lines = head + ["  ".join([cols[0].ljust(width)] + [c.rjust(max(len(c), 10)) for c in cols[1:]])]
    for r in rows:
        cells = [f"{v / GiB:.3f}" for v in r[1:5]] + [str(r[5])]
        lines.append("  ".join([r[0].ljust(width)] + [c.rjust(max(len(h), 10)) for c, h in zip(cells, cols[1:])]))
    o = d["overall"]
    lines += ["", f"peak allocated {fmt_bytes(o['peak_allocated_bytes'])} ({o['peak_allocated_bytes']:,} B); "
              f"peak reserved {fmt_bytes(o['peak_reserved_bytes'])} = {fmt_bytes(o['peak_reserved_bytes'], 'GB')} "
              f"({o['peak_reserved_bytes']:,} B)",
              f"at the reserved peak: {d['segments_at_peak']} segments, largest free block "
              f"{fmt_bytes(o['largest_free_at_peak_bytes'])}, fragmentation (reserved - allocated) "
              f"{fmt_bytes(o['fragmentation_at_peak_bytes'])}"]
    if "oom_capacity_bytes" in d:
        lines.append(f"oom_capacity: {fmt_bytes(d['oom_capacity_bytes'])} ({d['oom_capacity_bytes']:,} B): the "
                     "smallest capacity (2 MiB steps) that replays without OOM")
    if d["capacity_bytes"] is not None:
        lines.append(f"capacity {fmt_bytes(d['capacity_bytes'])}: " + (
            "fits" if d["oom"] is None else
            f"OOM at event {d['oom']['event']} ({d['oom']['stage']}): tried to allocate "
            f"{fmt_bytes(d['oom']['segment_bytes'])} with {fmt_bytes(d['oom']['reserved_bytes'])} reserved"))
    lines.append("reserved is torch.cuda.memory_reserved of the modelled allocator; the CUDA context and NCCL "
                 "buffers come on top (python -m estimator ... device_bytes)")
    return "\n".join(lines)
