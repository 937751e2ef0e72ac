"""Time a rank-free LoRA profile's derivation against a per-rank one, and check it at three ranks against full-depth
traces of the real model (CPU, fake tensors; minutes).

    python scripts/bench_lora_rank.py --model qwen2.5-7b
    python scripts/bench_lora_rank.py --model qwen2.5-7b --ranks 1,64,1024 --batch 2 --seq 512

Both derivations run in this process after a warm-up derivation of a tiny config (imports and first-call costs
are not timed), each timed in CPU seconds (time.process_time: every thread of the process) and wall seconds. Then
for each rank, estimate() from the rank-free profile (no derivation: Options(derive=False)) and a trace of the whole
model at that rank (bench.trace.cases.trace_case) are compared stage by stage (tensor bytes, to the byte). Nothing
is written to data/ or docs/: the figures are printed (docs/performance.md quotes them by hand).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WILLITFIT_CACHE", tempfile.mkdtemp(prefix="willitfit-rank-"))

from bench.trace.cases import trace_case  # noqa: E402
from estimator import store  # noqa: E402
from estimator.estimate import Options, estimate, traced_class  # noqa: E402
from estimator.model import from_hf_config  # noqa: E402
from estimator.presets import load_config  # noqa: E402
from estimator.spec import Parallel, Workload  # noqa: E402
from tracer.derive import derive_profile  # noqa: E402
from tracer.lora import default_lora_targets  # noqa: E402


def _timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b", help="a preset (python -m estimator --list-models)")
    ap.add_argument("--ranks", default="1,64,1024", help="comma-separated LoRA ranks checked against full traces")
    ap.add_argument("--batch", type=int, default=2, help="micro-batch of the checks")
    ap.add_argument("--seq", type=int, default=512, help="sequence length of the checks")
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    name, config = load_config(args.model)
    model = from_hf_config(config, name)
    w = Workload(method="lora", lora_targets=default_lora_targets(config["model_type"]),
                 attention=model.default_attention)
    tw, tp, _ = traced_class(w, Parallel())
    tiny = json.loads((ROOT / "tests" / "data" / "tiny" / "t-llama.json").read_text())
    derive_profile(tiny, Workload(method="lora"), Parallel(), rank_variable=False)       # warm-up, not timed
    per_rank, cpu1, wall1 = _timed(lambda: derive_profile(config, tw, Parallel(), rank_variable=False))
    free, cpu2, wall2 = _timed(lambda: derive_profile(config, tw, Parallel(), config_hash=store.config_hash(config)))
    print(f"{name}: per-rank profile (rank {tw.lora_rank}): {per_rank.provenance['traces']} traces, {cpu1:.1f} CPU s, "
          f"{wall1:.1f} s wall")
    print(f"{name}: rank-free profile: {free.provenance['traces']} traces, {cpu2:.1f} CPU s, {wall2:.1f} s wall "
          f"(fit at ranks {free.provenance['lora_ranks']['fit']}, verified at {free.provenance['lora_ranks']['verified']})")
    d = store.cache_dir() / store.config_hash(config)[:16]
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{store.profile_key(tw, Parallel())}.json").write_text(free.to_json())
    store.clear_memo()
    for r in ranks:
        wr = replace(w, lora_rank=r, batch=args.batch, seq=args.seq)
        (est, e_cpu, _) = _timed(lambda: estimate(model, wr, Parallel(), Options(derive=False)))
        got = {s: b.tensor_bytes for s, b in est.stages}
        row, t_cpu, t_wall = _timed(lambda: trace_case(config, name, wr))
        traced = {s: row[f"{s}_peak_alloc_bytes"] for s in got}
        same = "equal to the byte" if got == traced else "DIFFERENT"
        print(f"{name}: rank {r}, batch {args.batch}, seq {args.seq}: estimate {got} ({e_cpu * 1e3:.1f} ms CPU, cold); "
              f"full-depth trace {traced} ({t_cpu:.1f} CPU s): {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
