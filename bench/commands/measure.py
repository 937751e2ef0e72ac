"""`python -m bench measure`: measure a grid of cases on this machine's GPU(s), one process per case.

    python -m bench measure --model llama-3.2-1b --batch 1,2,4,8 --seq 2048 --out runs.jsonl
    python -m bench measure --model llama-3.1-8b --strategy ddp,fsdp --gpus 2,4 --out runs.jsonl

Rows are appended to --out as each case finishes; run it again and the cases already there are skipped.
Then `python -m bench ingest runs.jsonl`, or upload the file on the app's Contribute page.
Exit codes: 0 every case has a row (OOM rows included); 1 some case died without a row (listed on
stderr); 2 bad input, or no CUDA GPU. How to run it and what each column means: docs/measuring.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from bench.trace import grid
from bench.measure import harness as measure
from bench.store.rows import MAX_NOTES, MAX_TEXT
from estimator.alloc_conf import parse_alloc_conf
from tracer.lora import default_lora_targets


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "measure", help="measure cases on a real CUDA GPU (one process per case) and write run rows",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    grid.add_arguments(p)
    p.add_argument("--out", required=True, metavar="PATH",
                   help="JSONL file to append one row per case to (run_ids already in it are skipped)")
    p.add_argument("--timeout", type=float, default=measure.DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"seconds one case may run before its processes are killed and it is reported as "
                        f"failed (default {measure.DEFAULT_TIMEOUT_S})")
    p.add_argument("--snapshot", default=None, metavar="DIR",
                   help="also write a CUDA memory snapshot per case and rank into DIR, to open at "
                        "https://pytorch.org/memory_viz (large; nothing in willitfit reads them)")
    p.add_argument("--stream-dir", default=None, metavar="DIR",
                   help="also write each case's allocation stream per rank into DIR (.npz: every allocation and free "
                        "in order, by stage), to replay with `python -m bench replay` or set beside `python -m bench "
                        "trace --stream` of the same case (scripts/stream_diff.py)")
    p.add_argument("--alloc-conf", action="append", default=None, metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF to run every case under, e.g. 'expandable_segments:True'; repeat "
                        "the flag to measure each case under several (an empty string: torch's defaults). Stored "
                        "in each row's alloc_conf. Default: this shell's PYTORCH_CUDA_ALLOC_CONF, else the defaults")
    p.add_argument("--reuse-process", action="store_true",
                   help="measure the single-GPU cases of one model and allocator setting in one worker process, "
                        "tearing each down (gc, cuBLAS workspaces, empty_cache) before the next: no process start, "
                        "imports and CUDA start per case (4.7 s a case, steps included, on an H100: docs/measuring.md). Kernels loaded by earlier cases then count in "
                        "nvml_used_bytes; each row's notes say it was measured this way. Not with --snapshot")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no case once this many seconds have passed (for a GPU rented by the minute); "
                        "the cases left are listed in the summary and a rerun resumes them")
    p.add_argument("--contributor", default=None, help="who ran it (e.g. a GitHub handle), stored in every row")
    p.add_argument("--notes", default=None, help="free text stored in every row's notes (machine, quirks)")
    p.add_argument("--dry-run", action="store_true", help="list the cases that would run, then exit")
    # Test mode for the launch and gather path (gloo on CPU, nothing counted); documented in docs/measuring.md.
    p.add_argument("--device", choices=measure.DEVICES, default="cuda", help=argparse.SUPPRESS)
    p.set_defaults(func=run_measure)


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _check_text(name: str, value: str | None, limit: int) -> str | None:
    if value is not None and (len(value) > limit or not value.isprintable()):
        return f"{name}: at most {limit} printable characters"
    return None


def _cases(args: argparse.Namespace) -> list[measure.Case]:
    """The grid as measure cases; combinations the specs or measure reject are reported and dropped."""
    axes = grid.axes_from_args(args)
    models = grid.parse_list("model", args.model, str, None)
    grid_cases, skipped = grid.expand(models, axes)
    confs = args.alloc_conf if args.alloc_conf is not None else [os.environ.get(measure.ALLOC_CONF_VAR, "")]
    confs = list(dict.fromkeys(c.strip() for c in confs))
    for conf in confs:
        if conf:
            parse_alloc_conf(conf)  # a bad string stops the command with its one line, before any case runs
    cases = []
    for c in grid_cases:
        if args.lora_targets is None and c.workload.method in ("lora", "qlora"):
            # PEFT's default targets for this architecture (as build-db traces them): q_proj,v_proj for most, the
            # fused qkv_proj for Phi-3, whose attention has no q_proj
            c = dataclasses.replace(c, workload=dataclasses.replace(
                c.workload, lora_targets=default_lora_targets(c.config.get("model_type", ""))))
        for conf in confs:
            try:
                cases.append(measure.Case(c.model_name, c.config, c.workload, c.parallel, device=args.device,
                                          contributor=args.contributor, notes=args.notes, alloc_conf=conf))
            except ValueError as e:
                skipped[f"not measured: {e}"] += 1
    if skipped:
        print(grid.summarize_skipped(skipped), file=sys.stderr)
    return cases


def run_measure(args: argparse.Namespace) -> int:
    start = time.time()
    if not args.timeout > 0:
        return _error(f"timeout: must be > 0 seconds, got {args.timeout}")
    if args.stop_after is not None and not args.stop_after > 0:
        return _error(f"stop-after: must be > 0 seconds, got {args.stop_after}")
    if args.reuse_process and (args.snapshot or args.stream_dir):
        flag = "--snapshot" if args.snapshot else "--stream-dir"
        return _error(f"reuse-process: {flag} records one case per process; drop {flag} or --reuse-process")
    problem = _check_text("contributor", args.contributor, MAX_TEXT) or _check_text("notes", args.notes, MAX_NOTES // 2)
    if problem:
        return _error(problem)
    try:
        cases = _cases(args)
    except ValueError as e:
        return _error(str(e))
    if not cases:
        return _error("grid: no measurable case left")
    if args.dry_run:
        print("\n".join(measure.case_name(c) for c in cases))
        return 0
    try:
        info = measure.probe_environment(args.device)
    except RuntimeError as e:
        return _error(str(e))
    wanted = max(c.parallel.gpus for c in cases)
    if args.device == "cuda" and wanted > info["device_count"]:
        return _error(f"gpus: a case needs {wanted} GPUs but {info['device_count']} are visible "
                      "(CUDA_VISIBLE_DEVICES)")
    deadline = None if args.stop_after is None else start + args.stop_after
    summary = measure.run_cases(cases, Path(args.out), info["env"], args.timeout, args.snapshot,
                                reuse_process=args.reuse_process, deadline=deadline, stream_dir=args.stream_dir)
    print(summary.text(), file=sys.stderr)
    return 1 if summary.failed or summary.unstarted else 0
