"""The command line the full-size checks share (scripts/hybrid_check.py, scripts/vision_check.py, scripts/vlm_check.py,
scripts/seq2seq_check.py):
pick cases by name, run each with an empty profile cache, print one line per case, exit 1 if any differs or is refused;
`compared` is the estimate-against-trace line of the vision and VLM checks.

    sys.exit(main(__doc__, CASES, run_case, "willitfit-hybrid-", width=34))
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable


def main(doc: str, cases: tuple, run_case: Callable[[tuple], tuple[bool, str]], cache_prefix: str, width: int,
         argv=None) -> int:
    """`run_case(case)` returns (equal, the line to print); a case is a tuple whose first item is its name."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--case", action="append", help="a case name (repeatable; default: every case)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)
    if args.list:
        for c in cases:
            print(c[0])
        return 0
    names = {c[0] for c in cases}
    bad = [n for n in args.case or [] if n not in names]
    if bad:
        ap.error(f"--case: {bad[0]!r} is not a case; choose from {', '.join(sorted(names))}")
    chosen = [c for c in cases if not args.case or c[0] in args.case]
    os.environ["WILLITFIT_CACHE"] = tempfile.mkdtemp(prefix=cache_prefix)   # every profile derived from scratch
    ok = True
    for case in chosen:
        try:
            good, line = run_case(case)
        except ValueError as e:
            good, line = False, f"{case[0]:{width}s} REFUSED  {e}"
        ok &= good
        print(line, flush=True)
    return 0 if ok else 1


def compared(name: str, est, row: dict, derive_s: float, what: str) -> tuple[bool, str]:
    """(equal, line): every stage of an estimate against a full-depth trace row (bench.trace.cases.trace_case);
    `what` says the case's size or parameters."""
    got = {n: st.tensor_bytes for n, st in est.stages}
    want = {n: row[f"{n}_peak_alloc_bytes"] for n in got}
    peak = max(want.values())
    diff = max(abs(got[n] - want[n]) for n in got)
    line = (f"{name:30s} {'equal' if diff == 0 else 'DIFFERS'}  {what}  peak {peak:>16,} B  largest stage difference "
            f"{diff:,} B  ({est.profile.get('traces')} traces, {derive_s:.1f} s)")
    return diff == 0, line


def config(ref: str) -> dict:
    """A preset's config.json (data/models/), else a model type's default config (`AutoConfig.for_model(type)`)."""
    from estimator.presets import load_config, preset_names

    if ref in preset_names():
        return load_config(ref)[1]
    from transformers import AutoConfig

    cfg = {**AutoConfig.for_model(ref).to_diff_dict(), "model_type": ref}
    cfg.pop("transformers_version", None)
    return cfg


def checked(name: str, ref: str, w) -> tuple[bool, str]:
    """`compared` for the estimate of workload `w` on `ref` (a preset or a model type) and its full-depth trace."""
    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    cfg = config(ref)
    t = time.perf_counter()
    model = from_hf_config(cfg, ref)
    est = estimate(model, w)
    derive_s = time.perf_counter() - t
    row = trace_case(cfg, ref, est.workload, steps=2)
    return compared(name, est, row, derive_s, f"{model.params:>14,} params")
