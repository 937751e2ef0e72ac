"""`python -m bench trace`: trace one case or a grid on fake CPU tensors and write run rows.

    python -m bench trace --model llama-2-7b --mode train --recipe pure --precision bf16 --batch 4 --seq 512
    python -m bench trace --model llama-3.2-1b,qwen2.5-0.5b --batch 1,2,4 --seq 512,1024 --out runs.jsonl --ingest

One case prints a per-stage x per-category table (GiB = 2^30 bytes). A grid shows a progress bar. With
--out every row is appended as one JSON line and flushed as soon as it exists, and cases whose run_id
is already in that file (or in the database, when it exists) are skipped, so an interrupted sweep resumes.

Cases run one after another in this process: a fresh interpreter per case would cost seconds of imports
each, and nothing leaks between cases (fake tensors die with the case; the FSDP path creates and
destroys its own fake process group; tests/test_trace.py checks a case traced after an FSDP case gives
the same bytes as in a fresh run). --timeout-per-case interrupts a case with SIGALRM.

This module also registers `build-db` and `report` (bench/__main__.py routes them here); see register().
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from collections import Counter
from pathlib import Path

from bench.trace import grid
from estimator.units import GiB
from bench.trace import cases as trace
from bench.trace.streams import trace_stream
from bench.commands import db as cmd_db
from bench.store import db

TABLE_STAGES = ("load", "forward", "backward", "optimizer", "prefill", "decode")


class CaseTimeout(Exception):
    """A case ran past --timeout-per-case."""


def register(subparsers) -> None:
    """Add this module's commands: trace here; build-db and report are added next to it."""
    _register_trace(subparsers)


def _register_trace(subparsers) -> None:
    p = subparsers.add_parser(
        "trace", help="trace cases on fake CPU tensors (no GPU, no weights) and write run rows",
        description="\n\n".join(__doc__.split("\n\n")[:3]), formatter_class=argparse.RawDescriptionHelpFormatter)
    grid.add_arguments(p)
    p.add_argument("--out", default=None, help="JSONL file to append one row per case to (resumes: run_ids "
                   "already in it are skipped)")
    p.add_argument("--ingest", action="store_true", help="after tracing, ingest --out into the database")
    p.add_argument("--db", default=None, help="DuckDB file for --ingest and for skipping traced cases "
                   "(default: $WILLITFIT_DB, else data/benchmarks.duckdb)")
    p.add_argument("--force", action="store_true", help="trace every case again, even those already in --out or the "
                   "database (with --ingest the new traced rows replace the stored ones)")
    p.add_argument("--steps", type=int, default=2, help="training steps per case (default 2: Adam's states "
                   "appear in step 1, step 2 is the steady state)")
    p.add_argument("--timeout-per-case", type=float, default=0.0,
                   help="seconds before a case is abandoned and counted as failed (default 0: no limit)")
    p.add_argument("--check", action="store_true", help="also run torch's MemTracker (single GPU, full "
                   "fine-tuning) or FSDPMemTracker (FSDP) on the same run and require the same peak")
    p.add_argument("--kernels", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): trace what a CUDA GPU keeps (its SDPA backend and aten ops, 1-byte dropout "
                        "masks, its autocast lists, fp32 LayerNorm statistics); cpu: the CPU's own kernels, exactly "
                        "as a plain training loop on fake CPU tensors runs the model (scripts/plain_loop.py)")
    p.add_argument("--stream", default=None, metavar="FILE",
                   help="one case only: also write its allocation stream (.npz, offline.allocator.Stream: "
                        "every allocation and free in order, stage names, provenance) for python -m bench replay")
    p.set_defaults(func=run_trace)


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def run_trace(args: argparse.Namespace) -> int:

    if args.steps < 1:
        return _error(f"steps: must be at least 1, got {args.steps}")
    if args.timeout_per_case < 0:
        return _error(f"timeout_per_case: must be >= 0 seconds, got {args.timeout_per_case}")
    if args.ingest and not args.out:
        return _error("ingest: needs --out (the file to ingest)")
    try:
        axes = grid.axes_from_args(args)
        models = grid.parse_list("model", args.model, str, None)
        cases, skipped = grid.expand(models, axes)
    except ValueError as e:
        return _error(str(e))
    runnable = []
    for case in cases:
        try:
            trace.check_traceable(case.workload, case.parallel)
            if args.check:
                trace.check_checkable(case.workload, case.parallel)
            runnable.append(case)
        except ValueError as e:
            skipped[f"not traced: {e}"] += 1
    if skipped:
        print(grid.summarize_skipped(skipped), file=sys.stderr)
    mesh = next((why for c in runnable if (why := trace.unstorable(c.parallel, c.workload))), None)
    if mesh and (args.out or args.ingest):
        return _error(mesh)
    done = set() if args.force else done_run_ids(args.out, args.db)
    ids = {id(c): trace.case_run_id(c.config, c.workload, c.parallel, args.kernels) for c in runnable}
    # a layout rows cannot tell apart is never "already traced": the stored row would be another layout's
    todo = [c for c in runnable if ids[id(c)] not in done or trace.unstorable(c.parallel, c.workload)]
    if len(todo) < len(runnable):
        print(f"resuming: {len(runnable) - len(todo)} case(s) already traced, skipped (--force traces them again)",
              file=sys.stderr)
    if not runnable:
        return _error("grid: no traceable case left")
    single = len(runnable) == 1
    if not todo:
        print(f"nothing to trace: {'the case is' if single else f'all {len(runnable)} cases are'} already in --out "
              "or the database; their stored rows are below (pass --force to trace again)", file=sys.stderr)
        for case, row in zip(runnable, stored_rows([ids[id(c)] for c in runnable], args.out, args.db)):
            print(format_table(row, grid.describe(case)) if single and row and row.get("breakdown_json") else
                  f"{grid.describe(case)}: peak {_gib(row)} (stored)")
    if args.stream and not single:
        return _error(f"stream: --stream FILE takes one case; the grid has {len(runnable)}")
    if args.stream and not todo:
        todo = runnable  # the row exists, but the stream was asked for: trace it again
    failures = trace_all(todo, args, single)
    if args.ingest:
        code = _ingest(args.out, args.db, replace=args.force)
        if code:
            return code
    if single and failures["ValueError"]:
        return 2  # the one case was bad input (the message names the field)
    return 1 if failures else 0


def trace_all(cases: list, args: argparse.Namespace, single: bool) -> Counter:
    from tqdm import tqdm


    failures: Counter = Counter()
    out = open(args.out, "a", encoding="utf-8") if args.out else None
    try:
        for case in tqdm(cases, disable=len(cases) <= 1, file=sys.stderr, unit="case"):
            try:
                with _time_limit(args.timeout_per_case):
                    if getattr(args, "stream", None):
                        row = _trace_with_stream(case, args)
                    else:
                        row = trace.trace_case(case.config, case.model_name, case.workload, case.parallel,
                                               steps=args.steps, check=args.check, kernels=args.kernels)
            except Exception as e:  # noqa: BLE001 - one failing case is reported, the sweep goes on
                failures[type(e).__name__] += 1
                tqdm.write(f"failed: {grid.describe(case)}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                           file=sys.stderr)
                continue
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
            if single:
                print(format_table(row, grid.describe(case)))
            else:
                tqdm.write(f"{grid.describe(case)}: peak {row['peak_alloc_bytes'] / GiB:.3f} GiB "
                           f"({row['peak_alloc_bytes']:,} B)")
    finally:
        if out is not None:
            out.close()
    if failures:
        print(f"{sum(failures.values())} case(s) failed", file=sys.stderr)
    return failures


def _trace_with_stream(case, args: argparse.Namespace) -> dict:
    """Trace one case keeping its allocation events; write the stream to --stream; return the row."""

    if args.check:
        raise ValueError("check: --check and --stream are separate runs; drop one")
    row, stream = trace_stream(case.config, case.model_name, case.workload, case.parallel, steps=args.steps,
                               kernels=args.kernels)
    stream.save(args.stream)
    print(f"stream: {len(stream):,} events, stages {', '.join(stream.stage_names)} -> {args.stream} "
          f"(python -m bench replay {args.stream})", file=sys.stderr)
    return row


class _time_limit:
    """Raise CaseTimeout in the main thread after `seconds` (0 = no limit), via SIGALRM."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def _fire(self, signum, frame):
        raise CaseTimeout(f"timeout: the case ran longer than {self.seconds:g} s")

    def __enter__(self):
        if self.seconds > 0:
            self._old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.seconds > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)
        return False


def done_run_ids(out: str | None, db_path: str | None) -> set[str]:
    """run_ids already traced: every row in --out, and every traced row of the database if it exists."""
    ids: set[str] = set()
    if out and Path(out).is_file():
        with open(out, encoding="utf-8") as f:
            for line in f:
                try:
                    ids.add(json.loads(line)["run_id"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by an interrupted run is traced again
    path = Path(db_path) if db_path else db.default_db_path()
    if path.is_file():
        try:
            ids |= set(db.query_df("traced_run_ids", ["traced"], db_path=path)["run_id"])
        except db.DatabaseBusy as e:  # another process holds the write lock: resume from --out only
            print(f"warning: not skipping cases stored in {path}: {e}", file=sys.stderr)
    return ids


def stored_rows(run_ids: list[str], out: str | None, db_path: str | None) -> list[dict | None]:
    """The stored row of each run_id (from --out, else the database), None where neither holds it."""
    found: dict[str, dict] = {}
    if out and Path(out).is_file():
        with open(out, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                    found[row["run_id"]] = row
                except (ValueError, KeyError, TypeError):
                    continue
    path = Path(db_path) if db_path else db.default_db_path()
    for run_id in (r for r in run_ids if r not in found):
        if path.is_file():
            try:
                df = db.query_df("run_detail", [run_id], db_path=path)
            except db.DatabaseBusy:
                continue
            if not df.empty:
                found[run_id] = {k: (None if v != v else v) for k, v in df.iloc[0].to_dict().items()}
    return [found.get(r) for r in run_ids]


def _gib(row: dict | None) -> str:
    peak = (row or {}).get("peak_alloc_bytes")
    return "unknown" if peak is None else f"{peak / GiB:.3f} GiB ({int(peak):,} B)"


def _ingest(out: str, db_path: str | None, replace: bool = False) -> int:
    """`python -m bench ingest OUT` (bench.commands.db), with its messages and exit codes."""

    return cmd_db.run_ingest(argparse.Namespace(files=[out], db=db_path, skip_invalid=False,
                                                wait=cmd_db.DEFAULT_WAIT_S, replace=replace))


def format_table(row: dict, title: str) -> str:
    """Per-stage x per-category bytes of a traced row, in GiB (2^30 bytes)."""
    breakdown = json.loads(row["breakdown_json"])
    stages = [s for s in TABLE_STAGES if s in breakdown["stages"]]
    cats = [c for c in breakdown["peak"]
            if any(breakdown["stages"][s][c] for s in stages) or c in ("weights", "activations")]
    order = ("weights", "gradients", "optimizer_states", "activations", "kv_cache", "comm_buffers", "other")
    cats.sort(key=order.index)
    header = ["GiB (2^30 B)", *cats, "total"]
    lines = [[s, *(breakdown["stages"][s][c] for c in cats), row[f"{s}_peak_alloc_bytes"]] for s in stages]
    lines.append(["peak", *(breakdown["peak"][c] for c in cats), row["peak_alloc_bytes"]])
    widths = [max(len(header[0]), *(len(r[0]) for r in lines))] + [max(len(h), 9) for h in header[1:]]
    text = [title, "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for r in lines:
        cells = [r[0].ljust(widths[0])] + [f"{v / GiB:.3f}".rjust(w) for v, w in zip(r[1:], widths[1:])]
        text.append("  ".join(cells))
    text.append(f"params {row['params']:,}  trainable {row['trainable_params']:,}  run_id {row['run_id'][:16]}")
    text.append(f"stage = peak between the previous stage's end and this one's; categories at that moment. "
                f"{row['notes']}")
    return "\n".join(text)
