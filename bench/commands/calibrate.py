"""`python -m bench calibrate`: fit the activation constant k per family from the stored runs.

    python -m bench calibrate                              # every family, measured + traced runs
    python -m bench calibrate --family llama --source traced
    python -m bench calibrate --save                       # store the fits, regenerate data/calibration.json

One fit per (family, attention, checkpointing) present. Exit codes: 0 done; 1 no usable run, or a fit --save
refused (k <= 0); 2 bad input or a database another process kept locked for longer than --wait.
"""
from __future__ import annotations

import sys

from bench.store.db import DEFAULT_WAIT_S, DatabaseBusy
from estimator.spec import ATTENTION, CHECKPOINTING
from estimator.calibration_file import SEED_K
from estimator.units import fmt_bytes
from bench.accuracy import calibrate

SOURCE_CHOICES = ("traced", "measured", "all")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit the activation constant k (y = k * b*s*h*L*bytes) per family from stored runs",
        description="Least squares through the origin of each run's activation bytes (its allocated peak minus "
                    "every other estimated component) on b*s*h*L*bytes, with a 95% confidence interval. "
                    "Method: docs/calibration.md.")
    p.add_argument("--db", default=None, metavar="PATH",
                   help="DuckDB database file (default: $WILLITFIT_DB, else data/benchmarks.duckdb)")
    p.add_argument("--family", default=None, metavar="F",
                   help="only this model family (estimator.families.FAMILIES values: llama, gemma, moe, gpt2, ...)")
    p.add_argument("--source", default="all", choices=SOURCE_CHOICES,
                   help="which runs to fit: traced, measured, or all of both (default all)")
    p.add_argument("--attention", default=None, choices=ATTENTION, help="only runs with this attention")
    p.add_argument("--checkpointing", default=None, choices=CHECKPOINTING, help="only runs with this checkpointing")
    p.add_argument("--save", action="store_true",
                   help="store every fit in the calibrations table and regenerate the calibration JSON")
    p.add_argument("--json-out", default=None, metavar="PATH",
                   help="where --save writes the calibration JSON (default: $WILLITFIT_CALIBRATION, "
                        "else data/calibration.json)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help=f"how long to wait for another process's lock on the database (default {DEFAULT_WAIT_S:g})")
    p.set_defaults(func=run_calibrate)


def _row(fam, attn, ckpt, fit, points) -> str:
    return (f"{fam:<9} {attn:<6} {ckpt:<9} {fit.n_points:>5} {fit.k:>8.3f}"
            f" [{fit.k_ci_low:>8.3f}, {fit.k_ci_high:>8.3f}]"
            f" {fit.r2:>7.4f} {fmt_bytes(fit.residual_std_bytes, 'GiB', 3):>11} {SEED_K:>6g}"
            f" {points['implied_k'].median():>10.3f}")


def run_calibrate(args) -> int:
    if args.json_out and not args.save:
        print("json-out: only used with --save (it is where the saved calibrations are written)", file=sys.stderr)
        return 2
    if not args.wait >= 0:
        print(f"wait: {args.wait} must be >= 0 seconds", file=sys.stderr)
        return 2
    sources = ("traced", "measured") if args.source == "all" else (args.source,)
    try:
        points = calibrate.collect_points(args.db, args.family, sources, args.attention, args.checkpointing,
                                          wait_s=args.wait)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    except DatabaseBusy as e:
        print(str(e), file=sys.stderr)
        return 2
    skipped = points.attrs.get("skipped", {})
    if skipped:
        print("skipped rows: " + ", ".join(f"{n} ({why})" for why, n in skipped.items()))
    if points.empty:
        print("no usable training runs (mode=train, no OOM) match; nothing to fit", file=sys.stderr)
        return 1
    print(f"{'family':<9} {'attn':<6} {'ckpt':<9} {'n':>5} {'k':>8} {'95% CI':^20} {'R^2 (0)':>7}"
          f" {'resid std':>11} {'seed k':>6} {'detailed k':>10}")
    unsaved = 0
    for fam, attn, ckpt in calibrate.groups(points):
        g = points[(points.family == fam) & (points.attention == attn) & (points.checkpointing == ckpt)]
        if len(g) < 2:
            print(f"{fam:<9} {attn:<6} {ckpt:<9} {len(g):>5}  too few points for a fit with an interval")
            continue
        fit = calibrate.fit_family(g)
        print(_row(fam, attn, ckpt, fit, g))
        if args.save:
            try:
                cid = calibrate.save_calibration(fit, g, args.db, args.json_out, calibrate.fit_context(g), args.wait)
            except DatabaseBusy as e:
                print(str(e), file=sys.stderr)
                return 2
            except ValueError as e:
                print(f"  not saved: {e}", file=sys.stderr)
                unsaved += 1
                continue
            print(f"  saved calibration {cid[:12]}")
    print("R^2 (0): uncentered, sum(yhat^2)/sum(y^2), as for any fit through the origin; "
          "resid std in GiB (2**30 bytes); detailed k: median implied k of the per-tensor model")
    return 1 if unsaved else 0
