"""The shipped database's traced grid, and the one command that rebuilds it.

    python -m bench build-db --jobs 2            # trace every missing case into build/traced/, then ingest
    python -m bench build-db --list              # print the grid without tracing
    python -m bench report                       # traced vs analytic, per row and summarised
    python -m bench build-db --models gpt2,opt-1.3b --retrace   # trace again after a tracer change; replace

The grid (issue "Benchmark harness and DuckDB database", item 6):
- every shipped dense preset up to 13B parameters, plus one MoE (qwen1.5-moe-a2.7b: the one MoE preset
  whose trace fits this machine's time budget), each for training full, training LoRA and inference;
- batch {1,2,4,8} x seq {512,1024,2048,4096};
- two recipes for training (`pure` bf16 and `amp` bf16 autocast), two attention kernels for inference
  (`sdpa`, `eager`: the s^2 term is what differs; the recipe does not apply to inference);
- FSDP2 at world sizes {1,2,4,8} for llama-2-7b and llama-3.1-8b (pure bf16, batch {1,4} x seq {512,2048}).
Gemma-2 refuses SDPA in transformers 5, so it runs eager throughout. The MoE trains `pure` only: its experts run
transformers' grouped_mm, which FakeTensor supports only in bf16, while `amp` keeps them fp32 (not traceable). LoRA targets are PEFT's per-architecture
defaults (peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).

Tracing is resumable (run_ids already in the shard files or the database are skipped) and `--jobs N` runs N
shards in parallel subprocesses. Rows are plain JSONL under build/traced/ (git-ignored), then ingested in one
transaction per file, so the database only ever holds whole files.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from estimator.model import from_hf_config
from estimator.presets import load_config
from estimator.spec import Parallel, Workload
from bench.trace import grid
from bench.commands.trace import done_run_ids, trace_all
from bench.trace.cases import case_run_id
from bench.commands import db as cmd_db
from tracer.lora import default_lora_targets

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = REPO / "build" / "traced"
RETRACE_DIR = REPO / "build" / "retrace"
# The grid's presets, fixed so that adding presets does not grow the shipped grid: the dense presets up to 13B
# parameters that the grid was built from, and its MoE.
GRID_PRESETS = ("gpt2", "bert-large-uncased", "qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "opt-1.3b",
                "pythia-1.4b", "llama-3.2-3b", "phi-3-mini", "llama-2-7b", "mistral-7b", "falcon-7b", "qwen2.5-7b",
                "llama-3.1-8b", "gemma-2-9b", "llama-2-13b")
MAX_DENSE_PARAMS = 13_500_000_000   # "up to 13B": llama-2-13b has 13.02e9
MOE_PRESET = "qwen1.5-moe-a2.7b"
BATCHES = (1, 2, 4, 8)
SEQS = (512, 1024, 2048, 4096)
FSDP_MODELS = ("llama-2-7b", "llama-3.1-8b")
FSDP_WORLD = (1, 2, 4, 8)


def grid_models() -> list[str]:
    """The grid's dense presets (GRID_PRESETS: each up to 13B parameters), smallest first, then the MoE."""
    dense = []
    for name in GRID_PRESETS:
        spec = from_hf_config(load_config(name)[1], name)
        if spec.is_moe or spec.params > MAX_DENSE_PARAMS:
            raise ValueError(f"GRID_PRESETS: {name} is not a dense model up to 13B parameters")
        dense.append((spec.params, name))
    return [n for _, n in sorted(dense)] + [MOE_PRESET]


def model_cases(name: str) -> list[tuple[Workload, Parallel]]:
    config = load_config(name)[1]
    mt = config["model_type"]
    spec = from_hf_config(config, name)
    attn = spec.default_attention            # eager where transformers has no SDPA path (the inventory says)
    targets = default_lora_targets(mt)       # PEFT's defaults (tracer.lora)
    out = []
    for b in BATCHES:
        for s in SEQS:
            if spec.learned_positions and s > spec.max_positions:
                continue  # GPT-2 (1024) and BERT (512) have no position embedding past max_positions
            base = Workload(batch=b, seq=s, attention=attn)
            for recipe in ("pure", "amp") if not spec.is_moe else ("pure",):
                out.append((replace(base, recipe=recipe), Parallel()))
                out.append((replace(base, recipe=recipe, method="lora", lora_targets=targets), Parallel()))
            for a in ("sdpa", "eager") if attn == "sdpa" else ("eager",):
                if mt == "bert" or (spec.learned_positions and s + 16 > spec.max_positions):
                    out.append((replace(base, mode="infer", attention=a), Parallel()))  # prefill only
                else:
                    out.append((replace(base, mode="infer", attention=a, gen_tokens=16), Parallel()))
    return out


def fsdp_cases() -> list[tuple[str, Workload, Parallel]]:
    out = []
    for name in FSDP_MODELS:
        for n in FSDP_WORLD:
            for b in (1, 4):
                for s in (512, 2048):
                    par = Parallel(strategy="fsdp", gpus=n) if n > 1 else Parallel()
                    out.append((name, Workload(batch=b, seq=s), par))
    return out


def all_cases() -> list[tuple[str, Workload, Parallel]]:
    """Every case, the core slice first (batch {1,4} x seq {512,2048} for every model, and FSDP), so that an
    interrupted build still covers every model and strategy; the rest of the grid follows."""
    cases = [(name, w, p) for name in grid_models() for w, p in model_cases(name)] + fsdp_cases()
    core = [c for c in cases if c[1].batch in (1, 4) and c[1].seq in (512, 2048)]
    return core + [c for c in cases if not (c[1].batch in (1, 4) and c[1].seq in (512, 2048))]


def _selected(models: str | None) -> list[tuple[str, Workload, Parallel]]:
    cases = all_cases()
    if not models:
        return cases
    want = [m.strip() for m in models.split(",") if m.strip()]
    known = {c[0] for c in cases}
    bad = [m for m in want if m not in known]
    if bad:
        raise ValueError(f"models: {bad[0]!r} is not in the grid; choose from {', '.join(sorted(known))}")
    return [c for c in cases if c[0] in want]


def _trace_shard(shard: int, jobs: int, db_path: str | None, models: str | None = None,
                 retrace: bool = False) -> int:
    """Trace every `jobs`-th case starting at `shard` into build/traced/shard-<shard>.jsonl (resumable). With
    `retrace`, into build/retrace/ and without skipping what the database holds (only what build/retrace has)."""

    out_dir = RETRACE_DIR if retrace else BUILD_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"shard-{shard}.jsonl"
    done = set()
    for f in out_dir.glob("shard-*.jsonl"):
        done |= done_run_ids(str(f), None)
    if not retrace:
        done |= done_run_ids(None, db_path)
    mine = [c for i, c in enumerate(_selected(models)) if i % jobs == shard]
    cases = []
    for name, w, p in mine:
        config = load_config(name)[1]
        if case_run_id(config, w, p) not in done:
            cases.append(grid.Case(name, config, w, p))
    print(f"shard {shard}/{jobs}: {len(cases)} case(s) to trace, {len(mine) - len(cases)} already done",
          file=sys.stderr)
    args = argparse.Namespace(out=str(out), timeout_per_case=900.0, steps=2, check=False, kernels="cuda")
    failures = trace_all(cases, args, single=False)
    return 1 if failures else 0


def run_build(args: argparse.Namespace) -> int:
    try:
        cases = _selected(args.models)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for name, w, p in cases:
            print(name, w.mode, w.method, w.recipe, w.attention, w.batch, w.seq, p.strategy, p.gpus)
        print(f"{len(cases)} cases", file=sys.stderr)
        return 0
    if args.jobs < 1:
        print(f"error: jobs: must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    if args.shard is not None:
        return _trace_shard(args.shard, args.jobs, args.db, args.models, args.retrace)
    if not args.ingest_only:
        cmd = [sys.executable, "-m", "bench", "build-db", "--jobs", str(args.jobs)]
        if args.db:
            cmd += ["--db", args.db]
        if args.models:
            cmd += ["--models", args.models]
        if args.retrace:
            cmd += ["--retrace"]
        procs = [subprocess.Popen(cmd + ["--shard", str(i)]) for i in range(args.jobs)]
        codes = [p.wait() for p in procs]
        if any(codes):
            print("some cases failed (see above); ingesting what was traced", file=sys.stderr)

    out_dir = RETRACE_DIR if args.retrace else BUILD_DIR
    files = sorted(str(f) for f in out_dir.glob("shard-*.jsonl"))
    if not files:
        print(f"error: build: nothing traced under {out_dir.relative_to(REPO)}/", file=sys.stderr)
        return 2
    return cmd_db.run_ingest(argparse.Namespace(files=files, db=args.db, skip_invalid=False,
                                                wait=cmd_db.DEFAULT_WAIT_S, replace=args.retrace))


def register(subparsers) -> None:
    p = subparsers.add_parser("build-db", help="rebuild the shipped database's traced grid (resumable)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--db", default=None, help="DuckDB file (default: $WILLITFIT_DB, else data/benchmarks.duckdb)")
    p.add_argument("--jobs", type=int, default=2, help="parallel tracing processes (default 2)")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help="print the grid's cases and their count, trace nothing")
    p.add_argument("--ingest-only", action="store_true",
                   help="skip tracing; ingest what build/traced/ (or build/retrace/) already holds")
    p.add_argument("--models", default=None, help="only these grid presets, comma-separated")
    p.add_argument("--retrace", action="store_true",
                   help="trace the selected cases again although the database holds them (after a tracer change), "
                        "into build/retrace/, and replace the stored traced rows in one transaction per file")
    p.set_defaults(func=run_build)
