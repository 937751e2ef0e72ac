"""Calibrate: fit the seeds' activation constant k per model family from the stored runs, and save it.

Each point is one stored training run without OOM (bench.accuracy.calibrate.collect_points): x = b*s*h*L*bytes and
y = the run's allocated peak minus every non-activation component the estimator puts in that stage.
k is least squares through the origin (offline.calibration.fit_k). docs/calibration.md has the method.
Saving writes a `calibrations` row (with the run_ids used) and regenerates the calibration JSON that the
"Use calibrated k" toggle of the Will-it-fit page reads.
"""
from __future__ import annotations

import pandas as pd
import streamlit as st

from bench.store import app_data

from bench.accuracy import calibrate

from bench.store import db
from estimator.calibration_file import SEED_K
from estimator.families import FAMILIES
from estimator.units import GB, GiB, fmt_bytes
from pages import _charts as ch
from pages import _state as state, _data as reads
from bench.accuracy.report import accuracy_summary

PAGE = "calib"
ANY = "any"


@st.cache_data(show_spinner="Collecting calibration points", max_entries=32)
def _points(path: str, fp: tuple, family: str, sources: tuple) -> pd.DataFrame:
    return app_data.calibration_points(path, family, sources)


@st.cache_data(show_spinner=False, max_entries=8)
def _latest(path: str, fp: tuple) -> pd.DataFrame:
    cals = db.latest_calibrations(db_path=path)
    return pd.DataFrame([{"family": c.architecture, "attention": c.attention or ANY,
                          "checkpointing": c.checkpointing or ANY, "k": c.k, "95% CI low": c.k_ci_low,
                          "95% CI high": c.k_ci_high, "R^2 (uncentered)": c.r2, "runs": c.n_points,
                          "saved (UTC)": c.created_at} for c in cals])


@st.cache_data(show_spinner="Scoring every stored run against every method", max_entries=4)
def _accuracy(path: str, fp: tuple) -> pd.DataFrame:

    return accuracy_summary(path)


def accuracy_section() -> None:
    """The summary table of docs/accuracy.md (`python -m bench accuracy`), computed from this database."""
    st.subheader("Accuracy: every method against every stored run")
    st.caption("Relative error (prediction − truth) / truth of our estimate, our estimate with a leave-one-family-out "
               "calibrated k, and the peer formulas (the original blog posts, accelerate, DeepSpeed, Korthikanti), as in "
               "docs/accuracy.md. Traced truths are allocator-exact peaks; measured ones come from GPUs.")
    if not st.toggle("Compute the accuracy table", key=f"{PAGE}:accuracy",
                     help="Scores every traced and measured row with every method: a few seconds on the shipped "
                          "database, then cached until the database changes."):
        return
    summary = _accuracy(str(reads.db_path()), reads.fingerprint())
    if summary.empty:
        st.info("No traced or measured run to score yet.")
        return
    tiers = sorted(summary["tier"].unique())
    tier = st.selectbox("Truth", tiers, index=tiers.index("traced") if "traced" in tiers else 0,
                        key=f"{PAGE}:tier", help="Which stored number each method is compared with.")
    sub = summary[summary["tier"] == tier]
    ch.show(ch.accuracy_chart(sub), alt_text="median and p90 |relative error| per method and mode")
    table = sub.assign(**{c: sub[c] * 100 for c in ("median", "p90", "worst")}).rename(
        columns={"median": "median |err| (%)", "p90": "p90 |err| (%)", "worst": "worst |err| (%)"})
    st.dataframe(table, hide_index=True)
    st.download_button("Download the table (CSV)", table.to_csv(index=False).encode(), "accuracy.csv", "text/csv",
                       key=f"{PAGE}:accuracy_csv")


def pick_group(points: pd.DataFrame) -> pd.DataFrame | None:
    """Attention/checkpointing of the fit: each combination gets its own k (eager adds an s^2 term)."""
    groups = calibrate.groups(points)
    labels = {g: f"attention {g[1]}, checkpointing {g[2]} ({len(_select(points, g))} runs)" for g in groups}
    g = st.selectbox("Runs to fit", groups, format_func=labels.get, key=f"{PAGE}:group",
                     help="One k per attention implementation and checkpointing mode: they save different tensors.")
    return _select(points, g) if g else None


def _select(points: pd.DataFrame, g) -> pd.DataFrame:
    fam, attn, ckpt = g
    return points[(points.family == fam) & (points.attention == attn) & (points.checkpointing == ckpt)]


def fit_section(pts: pd.DataFrame, family: str):
    fit = calibrate.fit_family(pts)
    implied = pts["implied_k"].median()
    c = st.columns(4)
    c[0].metric("Fitted k", f"{fit.k:.3f}", help=f"95% CI {fit.k_ci_low:.3f} .. {fit.k_ci_high:.3f} "
                                                 f"(t = {fit.t_value:.3f}, {fit.n_points - 1} degrees of freedom)")
    c[1].metric("R² (through the origin)", f"{fit.r2:.4f}",
                help="Uncentered R² = Σŷ² / Σy²: the definition for a fit without intercept (not comparable "
                     "with an ordinary R²).")
    c[2].metric("Residual std", fmt_bytes(fit.residual_std_bytes, "GiB", 3),
                help=f"{fmt_bytes(fit.residual_std_bytes, 'GB', 3)}; s = sqrt(SSE / (n - 1)).")
    c[3].metric("Runs used", f"{fit.n_points}")
    st.dataframe(pd.DataFrame([
        {"k": "fitted on these runs", "value": fit.k},
        {"k": "the flat constant of the original blog posts", "value": SEED_K},
        {"k": "the traced profiles, median over these runs (the k their activations imply)", "value": implied},
    ]), hide_index=True, column_config={"value": st.column_config.NumberColumn(format="%.3f")})
    return fit


def group_of(pts: pd.DataFrame) -> tuple[str | None, str | None]:
    """(attention, checkpointing) the runs share, None where they mix (the saved calibrations' key)."""
    return tuple(v[0] if len(v := pts[c].unique()) == 1 else None for c in ("attention", "checkpointing"))


def saved_vs_fitted(fit, family: str, group) -> None:
    """A saved k for this family and group that differs from the fit on the runs stored now, and why."""
    saved = [c for c in db.latest_calibrations(db_path=reads.db_path())
             if c.architecture == family and (c.attention, c.checkpointing) == tuple(group)]
    if not saved:
        return
    c = saved[0]
    if c.k_ci_low <= fit.k <= c.k_ci_high and c.n_points == fit.n_points:
        st.caption(f"The saved k for this group ({c.k:.3f}, {c.n_points} runs, saved {c.created_at}) agrees with "
                   "this fit.")
        return
    why = ("it was fitted on other runs" if c.n_points != fit.n_points else
           "the same number of runs, but their predicted activations changed since (willitfit's profiles were "
           "derived again, or the runs were traced again)")
    st.warning(f"The saved k for this group is {c.k:.3f} (95% CI {c.k_ci_low:.3f}..{c.k_ci_high:.3f}, {c.n_points} "
               f"runs, saved {c.created_at} UTC); this fit on the runs stored now gives {fit.k:.3f}: {why}. The "
               "Will-it-fit page uses the saved one until you save again.")


def fit_charts(pts: pd.DataFrame, fit) -> None:
    fitted = pts["x"].map(fit.predict)
    df = pd.DataFrame({  # only what the charts draw: a chart's data travels to the browser
        "source": pts["source"], "model_name": pts["model_name"], "batch": pts["batch"], "seq": pts["seq"],
        "run_id": pts["run_id"], "x_gib": pts["x"] / GiB, "y_gib": pts["y"] / GiB, "fitted_gib": fitted / GiB,
        "resid_gib": (pts["y"] - fitted) / GiB, "resid_gb": (pts["y"] - fitted) / GB})
    lines = pd.DataFrame([{"line": name, "k": k, "x_gib": x, "y_gib": k * x}
                          for name, k in ((f"fitted k = {fit.k:.2f}", fit.k), (f"blog-post k = {SEED_K:g}", SEED_K),
                                          (f"detailed (median k = {pts['implied_k'].median():.2f})",
                                           pts["implied_k"].median()))
                          for x in (0.0, float(df["x_gib"].max()))])
    left, right = st.columns(2)
    ch.show(ch.calibration_chart(df, lines), left, "Activation bytes of each run against b*s*h*L*bytes, with k lines")
    ch.show(ch.residual_chart(df), right, "Residuals of the fit against the fitted activation bytes")


def save_section(fit, pts: pd.DataFrame) -> None:
    ctx = calibrate.fit_context(pts)
    if ctx is not None:
        st.caption(f"Measured runs with an NVML total also give the CUDA context constant: "
                   f"{fmt_bytes(ctx.context_bytes, 'GiB', 3)} (95% CI {fmt_bytes(ctx.context_ci_low, 'GiB', 3)} .. "
                   f"{fmt_bytes(ctx.context_ci_high, 'GiB', 3)}); it is saved with the fit.")
    if st.button("Save calibration", type="primary", key=f"{PAGE}:save",
                 help="Store k, its interval, fit quality and the run_ids used in the calibrations table, and "
                      "regenerate the calibration JSON (the Will-it-fit toggle reads it)."):
        cid = calibrate.save_calibration(fit, pts, reads.db_path(), residual=ctx)
        st.success(f"Saved calibration {cid[:12]} (k = {fit.k:.3f}, {fit.n_points} runs). Turn on "
                   "“Use calibrated k” on the Will it fit? page to use it.")


def main() -> None:
    st.title("Calibrate")
    st.caption("Fit k in activations = k · b·s·h·L·bytes per model family, from stored training runs without OOM.")
    if reads.empty_db_notice():
        return
    families = sorted(set(FAMILIES.values()))
    family = st.sidebar.selectbox("Model family", families, index=families.index("llama"), key=f"{PAGE}:family",
                                  help="Architectures that share activation constants (estimator.families.FAMILIES).")
    sources = st.sidebar.multiselect("Sources", ["measured", "traced"], default=["measured", "traced"],
                                     key=f"{PAGE}:sources", help="Which stored runs to fit.")
    if not sources:
        st.info("Pick at least one source in the sidebar.")
        return
    points = _points(str(reads.db_path()), reads.fingerprint(), family, tuple(sources))
    n_runs = points.attrs["n_runs"]
    if n_runs > app_data.CALIBRATION_SAMPLE:
        st.caption(f"{n_runs:,} {family} training runs match; this page fits a fixed pseudo-random sample of "
                   f"{app_data.CALIBRATION_SAMPLE:,} of them to stay interactive. `python -m bench calibrate "
                   f"--family {family} --save` fits them all.")
    skipped = points.attrs.get("skipped", {})
    if skipped:
        st.caption("Rows left out: " + ", ".join(f"{n} ({why})" for why, n in skipped.items()) + ".")
    if points.empty:
        st.info(f"No usable {family} training run (mode=train, no OOM) from {', '.join(sources)} in the database.")
        return
    pts = pick_group(points)
    if pts is None or len(pts) < 2:
        st.info("A fit with an interval needs at least 2 runs in this group; trace or measure more.")
        return
    fit = fit_section(pts, family)
    saved_vs_fitted(fit, family, group_of(pts))
    fit_charts(pts, fit)
    save_section(fit, pts)
    st.subheader("Saved calibrations")
    latest = _latest(str(reads.db_path()), reads.fingerprint())
    if latest.empty:
        st.caption("None yet.")
    else:
        st.dataframe(latest, hide_index=True)
    accuracy_section()


state.run_page(main)
