"""`python -m bench report` and `python -m bench accuracy`: every estimator against the stored truth.

    python -m bench report                          # traced vs ours per stage: summary by family x mode, worst 10
    python -m bench report --family llama --worst 20
    python -m bench accuracy                        # write docs/accuracy.md (all methods, all tiers)
    python -m bench accuracy --db /tmp/x.duckdb --out /tmp/accuracy.md --json /tmp/accuracy.json

The numbers come from bench/accuracy/report.py, which also holds the document's hand-written text. Exit codes: 0 done;
1 the database holds no usable run; 2 bad input, a missing database, or one another process kept locked.
"""
from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.store.db import DEFAULT_WAIT_S, REPO_DIR, DatabaseBusy, default_db_path
from estimator.units import GiB
from bench.accuracy import report as accuracy
from bench.store import app_data
from bench.accuracy import published as ap
from bench.accuracy import measured as measured_tier

STAGE_ORDER = ("load", "forward", "backward", "optimizer", "prefill", "decode")
WORST_IN_DOC = 20


def register(subparsers) -> None:
    """Add `report` and `accuracy` (bench/__main__.py routes both here)."""
    db_help = "DuckDB database file (default: $WILLITFIT_DB, else data/benchmarks.duckdb)"
    wait_help = f"seconds to wait for another process's lock on the database (default {DEFAULT_WAIT_S:g})"
    p = subparsers.add_parser("report", help="stored runs vs the analytic estimate, per stage (quick check)",
                              description="Ours (uncalibrated) against every traced (or measured) run, stage by "
                                          "stage: a summary by family x mode and the worst runs.")
    p.add_argument("--db", default=None, metavar="PATH", help=db_help)
    p.add_argument("--family", default=None, metavar="F",
                   help="only this estimator family (llama, gemma, moe, deepseek, gpt2, gpt_neox, falcon, opt, bert)")
    p.add_argument("--worst", type=int, default=10, metavar="N", help="how many worst runs to list (default 10)")
    p.add_argument("--source", default="traced", choices=("traced", "measured"),
                   help="which runs to compare with (default traced)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS", help=wait_help)
    p.set_defaults(func=run_report)
    a = subparsers.add_parser("accuracy", help="write the accuracy document: every method vs every tier",
                              description="Relative error of ours, ours calibrated leave-one-architecture-out, "
                                          "and the peer estimators against every stored run; writes markdown.")
    a.add_argument("--db", default=None, metavar="PATH", help=db_help)
    a.add_argument("--out", default=None, metavar="PATH",
                   help="markdown file to write (default: docs/accuracy.md in the repository)")
    a.add_argument("--json", default=None, metavar="PATH",
                   help="also write the summary, targets, coverage and held-out fits as JSON here")
    a.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS", help=wait_help)
    a.set_defaults(func=run_accuracy)


def _fail(msg: str, code: int = 2) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return code


def _db_path(arg: str | None) -> Path:
    return Path(arg) if arg else default_db_path()


def _check_common(args) -> str | None:
    if not args.wait >= 0:
        return f"wait: {args.wait} must be >= 0 seconds"
    if not _db_path(args.db).is_file():
        return f"db: no database at {_db_path(args.db)}; build one with `python -m bench build-db` or ingest runs"
    return None


# ------------------------------------------------------------------------------------------ report


def _pct(x) -> str:
    return "" if x is None or x != x else f"{100 * x:+.2f}%"


def run_report(args) -> int:

    problem = _check_common(args)
    if problem is None and args.worst < 0:
        problem = f"worst: {args.worst} must be >= 0"
    if problem:
        return _fail(problem)
    try:
        runs = accuracy.load_runs(_db_path(args.db), args.family, (args.source,), args.wait)
    except ValueError as e:
        return _fail(str(e))
    except DatabaseBusy as e:
        return _fail(str(e))
    cases, skipped = accuracy.cases_of(runs)
    if not cases:
        return _fail(f"no usable {args.source} runs (without OOM) in {_db_path(args.db)}"
                     + (f" for family {args.family}" if args.family else ""), 1)
    print(format_report(cases, skipped, args.source, args.worst))
    return 0


def format_report(cases, skipped: dict, source: str, worst: int) -> str:
    import pandas as pd


    stages = accuracy.stage_errors(cases)
    rows = []
    for c in cases:
        truth = int(c.row["peak_alloc_bytes"])
        pred = accuracy.comparable_allocated_bytes(c.est, source)
        rows.append({"run_id": c.row["run_id"], "family": c.model.family, "mode": accuracy.mode_of(c.workload),
                     "model": c.row["model_name"], "recipe": c.workload.recipe, "attn": c.workload.attention,
                     "b": c.workload.batch, "s": c.workload.seq, "gpus": c.parallel.gpus, "truth": truth,
                     "err": (pred - truth) / truth, "cause": accuracy.known_causes(c)})
    df = pd.DataFrame(rows)
    by_stage = stages.pivot_table(index="run_id", columns="stage", values="rel_err", aggfunc="first")
    cols = [s for s in STAGE_ORDER if s in by_stage.columns]
    out = [f"{source} peak_alloc_bytes vs ours (uncalibrated), relative error = (ours - {source}) / {source}; "
           f"{len(df)} runs" + (f", skipped {skipped}" if skipped else ""), "",
           f"{'family':<9} {'mode':<10} {'n':>4} {'median|e|':>9} {'p90|e|':>8} {'worst|e|':>8}  "
           + " ".join(f"{s:>9}" for s in cols) + "   (per stage: median signed error)"]
    for (fam, mode), g in df.groupby(["family", "mode"], sort=True):
        st = accuracy.error_stats(g["err"].abs())
        med = by_stage.loc[g["run_id"]].median()
        out.append(f"{fam:<9} {mode:<10} {st['n']:>4} {100 * st['median']:>8.2f}% {100 * st['p90']:>7.2f}% "
                   f"{100 * st['worst']:>7.2f}%  " + " ".join(f"{_pct(med.get(s)):>9}" for s in cols))
    if worst:
        out += ["", f"worst {min(worst, len(df))} runs by |peak error|:",
                f"{'model':<20} {'mode':<10} {'recipe':<5} {'attn':<5} {'b':>2} {'s':>5} {'gpus':>4} "
                f"{'truth GiB':>9} {'peak':>8}  " + " ".join(f"{s:>9}" for s in cols) + "  cause"]
        order = df.assign(a=df["err"].abs()).sort_values(["a", "run_id"], ascending=[False, True], kind="stable")
        for r in order.head(worst).itertuples():
            st = by_stage.loc[r.run_id]
            out.append(f"{r.model[:20]:<20} {r.mode:<10} {r.recipe:<5} {r.attn:<5} {r.b:>2} {r.s:>5} {r.gpus:>4} "
                       f"{r.truth / GiB:>9.3f} {_pct(r.err):>8}  " + " ".join(f"{_pct(st.get(s)):>9}" for s in cols)
                       + f"  {r.cause}")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ accuracy


def _db_label(path: Path) -> str:
    """The database path as the doc shows it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(REPO_DIR))
    except ValueError:
        return str(path)


def run_accuracy(args) -> int:

    problem = _check_common(args)
    if problem:
        return _fail(problem)
    path = _db_path(args.db)
    try:
        runs = accuracy.load_runs(path, wait_s=args.wait)
        counts = app_data.counts(path)
    except DatabaseBusy as e:
        return _fail(str(e))
    ev = accuracy.evaluate(runs)
    if ev.errors.empty:
        return _fail(f"no usable traced or measured runs (without OOM) in {path}; nothing to report", 1)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    text = render_markdown(ev, runs, counts, _db_label(path), date)
    try:
        extra = measured_tier.section(path, args.wait) + published_section(path, args.wait)
        text = text.rstrip() + "\n\n" + "\n".join(extra) + "\n"
    except DatabaseBusy as e:
        return _fail(str(e))
    out = Path(args.out) if args.out else REPO_DIR / "docs" / "accuracy.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(text.encode()):,} bytes; {ev.errors['run_id'].nunique()} runs, "
          f"{len(ev.errors)} errors)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary_json(ev, _db_label(path), date), indent=1, allow_nan=False)
                                   + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _clean(records: list[dict]) -> list[dict]:
    """JSON-safe records: NaN/inf become null, numpy scalars plain numbers."""
    out = []
    for r in records:
        out.append({k: (None if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf")))
                        else (v.item() if hasattr(v, "item") else v)) for k, v in r.items()})
    return out


def summary_json(ev, db_label: str, date: str) -> dict:
    """What the app's Calibrate page draws: the summary table, targets, interval coverage and held-out fits."""

    fits = [{"family": f.family, "attention": f.attention, "checkpointing": f.checkpointing,
             "k": f.fit.k if f.fit else None, "k_ci_low": f.fit.k_ci_low if f.fit else None,
             "k_ci_high": f.fit.k_ci_high if f.fit else None, "n_points": len(f.run_ids), "pooled": f.pooled}
            for f in ev.fits.values()]
    return {"version": 1, "generated": date, "db": db_label, "n_runs": ev.n_runs,
            "summary": _clean(accuracy.summarize(ev.errors).to_dict("records")),
            "targets": _clean(accuracy.targets(ev.errors).to_dict("records")),
            "coverage": _clean(accuracy.coverage(ev.errors).to_dict("records")), "fits": _clean(fits)}


def _md(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _p(x) -> str:
    """A fraction as a percentage, 2 decimals; '<0.01%' rather than a '0.00%' that reads as exact."""
    if x is None or x != x:
        return ""
    return "inf" if x == float("inf") else ("<0.01%" if 0 < abs(x) < 5e-5 else f"{100 * x:.2f}%")


def _header(ev, runs, counts, db_label: str, date: str) -> list[str]:
    import duckdb
    import numpy as np
    import pandas as pd


    by_source = ", ".join(f"{r.source} {r.n_runs} ({r.n_oom} OOM)" for r in counts.sort_values("source").itertuples())
    used = ev.errors["run_id"].nunique()
    versions = {c: sorted(str(v) for v in runs[c].dropna().unique()) for c in
                ("tool_version", "torch_version", "transformers_version") if c in runs}
    rows_v = "; ".join(f"{c.replace('_version', '')} {', '.join(v) or 'n/a'}" for c, v in versions.items())
    skipped = ", ".join(f"{n} ({why})" for why, n in sorted(ev.skipped.items())) or "none"
    return [accuracy.DOC_TITLE, "", accuracy.DOC_GENERATED.format(date=date), "",
            f"Database: `{db_label}`: {int(counts['n_runs'].sum())} runs by source: {by_source}. Used: {used} runs "
            f"without OOM with a peak ({ev.n_runs} read; skipped: {skipped}).",
            f"Versions in the runs: {rows_v}. This report: Python {platform.python_version()}, NumPy "
            f"{np.__version__}, pandas {pd.__version__}, DuckDB {duckdb.__version__}.", "", accuracy.DOC_INTRO, ""]


def _value(kind: str, x) -> str:
    if x is None or x != x:
        return ""
    if kind != "ratio":
        return _p(x)
    return f"{x:.2f}x" if x < 1000 else "> 1000x"  # ours' median is ~0 there: the ratio itself means nothing


def _targets_section(ev) -> list[str]:

    t = accuracy.targets(ev.errors)
    rows = [[r.target, r.tier, r.mode, r.n, _value(r.kind, r.value),
             ("<= " if r.kind == "error" else ">= ") + _value(r.kind, r.threshold),
             f"**{r.met}**" if r.met == "no" else r.met] for r in t.itertuples()]
    return ["## Targets", "", "Met or not on these runs, as they come out (nothing is tuned to them).", "",
            _md(["target", "tier", "mode", "n", "value", "target", "met"], rows), ""]


def _misses_section(ev) -> list[str]:
    """One line per missed target, with the numbers that explain it (from these runs, never hand-typed)."""

    t = accuracy.targets(ev.errors)
    e = ev.errors
    out = ["## Why targets are missed", ""]
    ours = e[(e["method"] == accuracy.OURS) & (e["tier"] == "traced")]
    if ((t["kind"] == "error") & (t["tier"] == "traced") & (t["met"] == "no")).any():
        fam = accuracy.summarize(ours, ("family",)).sort_values(["median", "family"], ascending=[False, True])
        out.append("- ours vs traced, by family (median |error|, n): " + ", ".join(
            f"{r.family} {_p(r.median)} ({r.n})" for r in fam.itertuples()) + ".")
        for label, rows in (("Worst run", ours), ("Worst run without a known cause", ours[ours["cause"] == ""])):
            if len(rows):
                w = rows.loc[rows["rel_err"].abs().idxmax()]
                out.append(f"  {label}: {w.model_name} {w['mode']} {w.recipe} {w.attention} b={w.batch} s={w.seq} "
                           f"on {w.world_size} GPU(s), {_pct(w.rel_err)} ({w.cause or 'cause unknown'}).")
    if ((t["kind"] == "coverage") & (t["met"] == "no")).any():
        out.append("- interval coverage (and ours-calibrated's errors): the held-out k is the other families' k, and "
                   "k differs by family (vocabulary term, MLP width, attention kernel) and, within a family, between "
                   "full fine-tuning and LoRA (frozen Linears save no inputs), while bench.accuracy.calibrate fits one k per "
                   "(family, attention, checkpointing). Each family's own median k (= y / x of its runs) by mode, "
                   "against the held-out k: " + _own_k(ev) + ".")
    summ = accuracy.summarize(e)
    for r in t[(t["kind"] == "ratio") & (t["met"] == "no") & t["target"].str.endswith("(all rows)")].itertuples():
        s = summ[(summ["tier"] == r.tier) & (summ["mode"] == r.mode)]
        best = s[s["method"].isin(list(accuracy.PEERS))].sort_values(["median", "method"]).iloc[0]
        mine = s[s["method"] == accuracy.OURS].iloc[0]
        out.append(f"- {r.tier} {r.mode}: ours' median |error| {_p(mine['median'])} against the best peer "
                   f"({best.method}) {_p(best['median'])}, {_value('ratio', r.value)} where the target is "
                   f"{accuracy.TARGET_PEER_RATIO:g}x.")
    return out + ([""] if len(out) > 2 else ["Every target with data is met.", ""])


def _own_k(ev) -> str:
    """'llama full 28.4 / LoRA 21.0 vs 66.8 (24 of 72 points with a cause)', per held-out fit."""

    e = ev.errors[ev.errors["method"] == accuracy.OURS]
    flagged = set(e[e["cause"] != ""]["run_id"])
    modes = e.drop_duplicates("run_id").set_index("run_id")["mode"]
    pts = ev.points.assign(k_own=ev.points["y"] / ev.points["x"], mode=ev.points["run_id"].map(modes))
    parts = []
    for (fam, attn, ckpt), lf in ev.fits.items():
        if lf.fit is None:
            continue
        mine = pts[(pts["family"] == fam) & (pts["attention"] == attn) & (pts["checkpointing"] == ckpt)]
        own = " / ".join(f"{m.removeprefix('train-')} {g['k_own'].median():.1f}" for m, g in mine.groupby("mode"))
        bad = len(flagged.intersection(lf.run_ids))
        parts.append(f"{fam} ({attn}) {own} vs {lf.fit.k:.1f}"
                     + (f" ({bad} of {len(lf.run_ids)} points with a cause)" if bad else ""))
    return "; ".join(parts)


def _summary_section(ev) -> list[str]:

    s = accuracy.summarize(ev.errors)
    out = ["## Summary by tier, method and mode", ""]
    for tier in accuracy.TIERS:
        out += [f"### {tier}", ""]
        st = s[s["tier"] == tier]
        if st.empty:
            out += ["no measured rows yet" if tier != "traced" else "no traced rows yet", ""]
            continue
        rows = [[r.method, r.mode, r.n, _p(r.median), _p(r.p90), _p(r.worst)] for r in st.itertuples()]
        out += [_md(["method", "mode", "n", "median", "p90", "worst"], rows), ""]
    return out


def _calibration_section(ev) -> list[str]:

    e = ev.errors
    flagged = set(e[(e["method"] == accuracy.OURS) & (e["cause"] != "")]["run_id"])
    fits = [[f.family, f.attention, f.checkpointing, len(f.run_ids), len(flagged.intersection(f.run_ids)),
             "yes" if f.pooled else "no", f"{f.fit.k:.3f}" if f.fit else "no fit",
             f"[{f.fit.k_ci_low:.3f}, {f.fit.k_ci_high:.3f}]" if f.fit else ""] for f in ev.fits.values()]
    cov = accuracy.coverage(ev.errors)
    crow = [[r.tier, r.mode, r.n, r.inside, _p(r.coverage)] for r in cov.itertuples()]
    return ["## Leave-one-architecture-out calibration", "",
            "k used for each held-out family (fitted on the other families' runs only; 'with a cause': how many "
            "of those points come from runs flagged under Known causes, whose truth inflates k):", "",
            _md(["held-out family", "attention", "checkpointing", "points used", "with a cause", "pooled", "k",
                 "95% CI"], fits), "",
            "95% prediction-interval coverage of the held-out runs:", "",
            _md(["tier", "mode", "n", "inside", "coverage"], crow) if crow else "no held-out interval", ""]


def _family_section(ev) -> list[str]:

    e = ev.errors[ev.errors["method"].isin([accuracy.OURS, accuracy.OURS_CAL])]
    s = accuracy.summarize(e, ("tier", "family", "mode", "method"))
    rows = [[r.tier, r.family, r.mode, r.method, r.n, _p(r.median), _p(r.p90), _p(r.worst)] for r in s.itertuples()]
    return ["## Ours per family", "", _md(["tier", "family", "mode", "method", "n", "median", "p90", "worst"], rows), ""]


def _causes_section(ev) -> list[str]:

    out = [accuracy.DOC_CAUSES_INTRO, ""]
    causes = [(key, text, accuracy.OURS) for key, _, text in accuracy.KNOWN_CAUSES]
    for key, text, method in (*causes, (*accuracy.POOLED_CAUSE, accuracy.OURS_CAL)):
        e = ev.errors[ev.errors["method"] == method]
        hit = e["cause"].str.contains(key, regex=False)
        where = ", ".join(sorted(e[hit]["model_name"].unique())) or "none"
        out.append(f"- `{key}`: {text} Runs flagged: {e[hit]['run_id'].nunique()} ({where}); median |error| "
                   f"of {method} {_p(e[hit]['rel_err'].abs().median()) or 'n/a'} on them, "
                   f"{_p(e[~hit]['rel_err'].abs().median()) or 'n/a'} on the others.")
    return out + [""]


def _worst_section(ev, method: str, n: int) -> list[str]:

    e = ev.errors[ev.errors["method"] == method]
    e = e.assign(a=e["rel_err"].abs()).sort_values(["a", "run_id", "tier"], ascending=[False, True, True], kind="stable")
    k_own = dict(zip(ev.points["run_id"], ev.points["y"] / ev.points["x"]))

    def why(r) -> str:
        # a calibrated miss is the borrowed k against the run's own k (y / x): say both
        lf = ev.fits.get((r.family, r.attention, r.checkpointing))
        if method != accuracy.OURS_CAL or lf is None or lf.fit is None or r.run_id not in k_own:
            return r.cause or "unexplained"
        return ", ".join(c for c in (r.cause, f"k {lf.fit.k:.1f} borrowed, own {k_own[r.run_id]:.1f}") if c)

    rows = [[r.tier, r.model_name, r.mode, r.recipe, r.attention, r.batch, r.seq, r.world_size,
             f"{r.truth_bytes / GiB:.3f}", f"{r.pred_bytes / GiB:.3f}", _pct(r.rel_err), why(r)]
            for r in e.head(n).itertuples()]
    return [f"## Worst {len(rows)} runs: {method}", "",
            _md(["tier", "model", "mode", "recipe", "attn", "b", "s", "gpus", "truth GiB", "pred GiB", "error",
                 "cause"], rows), ""]


def _appendix(ev) -> list[str]:

    e = ev.errors
    piv = e.pivot_table(index=["tier", "run_id"], columns="method", values="rel_err", aggfunc="first")
    methods = [m for m in accuracy.METHODS if m in piv.columns]
    first = e[e["method"] == accuracy.OURS].drop_duplicates(["tier", "run_id"])
    rows = []
    for r in first.itertuples():
        errs = piv.loc[(r.tier, r.run_id)]
        rows.append([r.tier, r.model_name, r.mode, r.recipe, r.attention, r.batch, r.seq, r.world_size,
                     f"{r.truth_bytes / GiB:.3f}", *(_pct(errs.get(m)).replace("%", "") for m in methods),
                     r.run_id[:10]])
    return [accuracy.DOC_APPENDIX, "",
            _md(["tier", "model", "mode", "recipe", "attn", "b", "s", "gpus", "truth GiB", *methods, "run_id"], rows), ""]


def published_section(path, wait_s: float) -> list[str]:
    """## Published tier: every method against the numbers framework authors published (bench/accuracy_published)."""

    runs = ap.load_published(path, wait_s=wait_s)
    out = ["## Published tier: GPU numbers from torchtune, litgpt, PEFT, GaLore and unsloth", "",
           ap.__doc__.split("\n\n", 1)[1].strip(), ""]
    if runs.empty:
        return out + ["The database holds no published run (`python -m bench import-published`)."]
    err, missing = ap.errors(runs)
    status = runs["mapping_status"].value_counts().to_dict()
    out += [f"{len(runs)} published runs: " + ", ".join(f"{v} {k}" for k, v in sorted(status.items())) +
            f". Ours prices {err[err['method'] == ap.OURS]['published_id'].nunique()} of them; "
            f"{len(missing)} it does not, with the reason below. Error = (predicted - published) / published.", ""]
    summ = ap.summary(err)
    out += [_md(["metric", "reliability", "method", "n", "median signed", "median |e|", "worst", "worst run"],
                [[r.metric, r.reliability, r.method, r.n, _p(r.median_signed), _p(r.median_abs), _p(r.worst),
                  r.worst_id] for r in summ.itertuples()]), ""]
    loso = ap.leave_one_source_out(err)
    out += ["Ours by source (nothing is fitted on these rows, so leaving a source out changes no prediction; the "
            "table shows how the error differs by who measured):", "",
            _md(["source", "n", "median signed", "median |e|"],
                [[r.source, r.n, _p(r.median_signed), _p(r.median_abs)] for r in loso.itertuples()]), ""]
    why = missing["why"].value_counts()
    out += ["Runs ours cannot price, by reason:", "", _md(["reason", "runs"], [[k, v] for k, v in why.items()]), ""]
    ours = err[err["method"] == ap.OURS].sort_values("published_id")
    out += ["Every run ours prices:", "",
            _md(["run", "model", "metric", "reliability", "mode", "published GiB", "ours GiB", "error"],
                [[r.published_id, r.model, r.metric, r.reliability, r.mode, f"{r.truth / GiB:.2f}",
                  f"{r.pred / GiB:.2f}", _p(r.error)] for r in ours.itertuples()])]
    return out


def render_markdown(ev, runs, counts, db_label: str, date: str) -> str:
    """The whole document: deterministic for a given database apart from the generated-on date."""

    parts = (_header(ev, runs, counts, db_label, date) + _targets_section(ev) + _misses_section(ev)
             + [accuracy.DOC_COMPARED, "", accuracy.DOC_PEERS, ""] + _summary_section(ev)
             + _calibration_section(ev) + _family_section(ev) + _causes_section(ev)
             + _worst_section(ev, accuracy.OURS, WORST_IN_DOC) + _worst_section(ev, accuracy.OURS_CAL, WORST_IN_DOC)
             + _appendix(ev))
    return "\n".join(parts).rstrip() + "\n"
