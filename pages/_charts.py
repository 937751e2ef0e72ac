"""Altair charts shared by the pages. Every axis says its unit; every mark has a tooltip.

Charts take tidy DataFrames whose byte columns are integer bytes; the conversion to GiB (2**30) and GB (10**9)
for display happens here and only here. Not a page (underscore).
"""
from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from estimator.breakdown import COMPONENTS, Breakdown
from estimator.units import GB, GiB

COMPONENT_COLORS = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6",
                    "#bab0ac", "#9d755d")
STAGE_ORDER = ("load", "forward", "backward", "optimizer", "prefill", "decode")
SOURCE_SHAPES = {"measured": "circle", "traced": "diamond", "published": "square"}
SOURCE_COLORS = ("#2ca02c", "#9467bd", "#8c564b")
CAPACITY_COLOR = "#d62728"
SERIES_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c"]
# Legends show whole labels ("estimate: device (nvidia-smi)", "optimizer_states"): Vega-Lite cuts at 160 px
LEGEND = alt.Legend(labelLimit=0, titleLimit=0)


def show(chart: alt.TopLevelMixin, container=st, alt_text: str | None = None) -> None:
    """Draw an Altair chart. The spec is built without Altair's JSON-schema validation, which costs ~0.1 s per
    chart per rerun; tests/test_app_data.py validates every chart builder's spec once instead."""
    container.vega_lite_chart(spec=chart.to_dict(validate=False), alt=alt_text)


def component_scale() -> alt.Scale:
    return alt.Scale(domain=list(COMPONENTS), range=list(COMPONENT_COLORS))


def breakdown_rows(label_name: str, items) -> pd.DataFrame:
    """Long table (label, component, bytes, gib, gb) of (label, Breakdown) pairs, zero components dropped."""
    rows = []
    for label, bd in items:
        for comp, n in bd.as_dict().items():
            if n:
                rows.append({label_name: label, "component": comp, "bytes": n, "gib": n / GiB, "gb": n / GB})
    return pd.DataFrame(rows, columns=[label_name, "component", "bytes", "gib", "gb"])


def _tooltips(label_name: str, title: str):
    return [alt.Tooltip(f"{label_name}:N", title=title), alt.Tooltip("component:N", title="component"),
            alt.Tooltip("gib:Q", title="GiB", format=",.2f"), alt.Tooltip("gb:Q", title="GB", format=",.2f")]


def capacity_rule(capacity_bytes: int, label: str, axis: str = "y") -> alt.Chart:
    """The GPU's memory as a dashed line with its value: everything beyond it is an OOM."""
    df = pd.DataFrame({"gib": [capacity_bytes / GiB], "gb": [capacity_bytes / GB], "label": [label]})
    enc = {"x": alt.X("gib:Q")} if axis == "x" else {"y": alt.Y("gib:Q")}
    tooltip = [alt.Tooltip("label:N", title="limit"), alt.Tooltip("gib:Q", title="GiB", format=",.2f"),
               alt.Tooltip("gb:Q", title="GB", format=",.2f")]
    return alt.Chart(df).mark_rule(color=CAPACITY_COLOR, strokeDash=[6, 4], size=2).encode(**enc, tooltip=tooltip)


def stages_chart(stages: tuple[tuple[str, Breakdown], ...], capacity_bytes: int, capacity_label: str) -> alt.Chart:
    """The per-stage waterfall: one stacked bar per stage of the step, and the GPU's memory."""
    df = breakdown_rows("stage", stages)
    order = [s for s in STAGE_ORDER if s in {name for name, _ in stages}]
    bars = alt.Chart(df).mark_bar().encode(
        x=alt.X("stage:N", sort=order, title="Stage of the step", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("sum(gib):Q", title="Memory per GPU (GiB, 2^30 bytes)"),
        color=alt.Color("component:N", scale=component_scale(), sort=list(COMPONENTS), title="Component", legend=LEGEND),
        order=alt.Order("component_rank:Q"),
        tooltip=_tooltips("stage", "stage"),
    ).transform_calculate(component_rank=_rank_expr())
    return (bars + capacity_rule(capacity_bytes, capacity_label)).properties(height=320)


def peak_chart(peak: Breakdown, peak_label: str, capacity_bytes: int, capacity_label: str) -> alt.Chart:
    """One stacked bar of the components at the peak, against the GPU's memory (dashed)."""
    df = breakdown_rows("moment", [(peak_label, peak)])
    bars = alt.Chart(df).mark_bar(width=70).encode(
        x=alt.X("moment:N", title=None, axis=alt.Axis(labelAngle=0)),
        y=alt.Y("sum(gib):Q", title="Memory per GPU (GiB, 2^30 bytes)"),
        color=alt.Color("component:N", scale=component_scale(), sort=list(COMPONENTS), title="Component", legend=LEGEND),
        order=alt.Order("component_rank:Q"),
        tooltip=_tooltips("moment", "moment"),
    ).transform_calculate(component_rank=_rank_expr())
    return (bars + capacity_rule(capacity_bytes, capacity_label)).properties(height=300, width=140)


def _rank_expr() -> str:
    """Vega expression giving each component its index in COMPONENTS, so stacks keep one order everywhere."""
    return "indexof(" + str(list(COMPONENTS)).replace("'", '"') + ", datum.component)"


def strategy_chart(df: pd.DataFrame, capacity_bytes: int, capacity_label: str,
                   traced: pd.DataFrame | None = None) -> alt.Chart:
    """Per-GPU memory vs GPU count, stacked by component, one panel per strategy (df: strategy, gpus,
    component, bytes, gib, gb); traced per-rank peaks (strategy, gpus, gib, gb, run_id) as black diamonds.

    Both tables go into one top-level dataset (told apart by `kind`) so that the facet splits both by strategy."""
    data = df.assign(kind="estimate")
    if traced is not None and len(traced):
        data = pd.concat([data, traced[["strategy", "gpus", "gib", "gb", "run_id", "source"]].assign(kind="traced")],
                         ignore_index=True)
    bars = alt.Chart().mark_bar().encode(
        x=alt.X("gpus:O", title="GPUs (world size)", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("sum(gib):Q", title="Memory per GPU (GiB, 2^30 bytes)"),
        color=alt.Color("component:N", scale=component_scale(), sort=list(COMPONENTS), title="Component", legend=LEGEND),
        order=alt.Order("component_rank:Q"),
        tooltip=[alt.Tooltip("strategy:N"), alt.Tooltip("gpus:O", title="GPUs"), *_tooltips("gpus", "GPUs")[1:]],
    ).transform_filter(alt.datum.kind == "estimate").transform_calculate(component_rank=_rank_expr())
    points = alt.Chart().mark_point(shape="diamond", filled=True, size=90, color="black").encode(
        x=alt.X("gpus:O"), y=alt.Y("gib:Q"),
        tooltip=[alt.Tooltip("source:N"), alt.Tooltip("gpus:O", title="GPUs"),
                 alt.Tooltip("gib:Q", title="traced peak per rank (GiB)", format=",.2f"),
                 alt.Tooltip("gb:Q", title="GB", format=",.2f"), alt.Tooltip("run_id:N")],
    ).transform_filter(alt.datum.kind == "traced")
    rule = alt.Chart().mark_rule(color=CAPACITY_COLOR, strokeDash=[6, 4], size=2).encode(
        y=alt.datum(capacity_bytes / GiB), tooltip=alt.value(capacity_label))
    columns = min(4, max(1, df["strategy"].nunique()))
    return alt.layer(bars, points, rule, data=data).properties(width=165, height=260).facet(
        facet=alt.Facet("strategy:N", title="Strategy", sort=list(df["strategy"].unique())), columns=columns
    ).resolve_axis(x="independent")


def curve_chart(curve: pd.DataFrame, pts: pd.DataFrame, x: str, x_title: str, capacity_bytes: int,
                capacity_label: str) -> alt.Chart:
    """Analytic lines (curve: x, series, gib, gb) with measured/traced points (pts: x, source, gib, gb, oom,
    run_id, gpu_name, oom_stage) and the GPU's memory. OOM runs are drawn as red crosses on the capacity line.

    Lines use the color and strokeDash channels, stored runs fill and shape: separate channels, so each
    gets one legend without resolving scales."""
    lines = alt.Chart(curve).mark_line(point=alt.OverlayMarkDef(size=18)).encode(
        x=alt.X(f"{x}:Q", title=x_title, scale=alt.Scale(type="log", base=2)),
        y=alt.Y("gib:Q", title="Peak memory per GPU (GiB, 2^30 bytes)"),
        color=alt.Color("series:N", title="Analytic", scale=alt.Scale(range=SERIES_COLORS), legend=LEGEND),
        strokeDash=alt.StrokeDash("series:N", title="Analytic", scale=alt.Scale(range=[[1, 0], [6, 3], [2, 2]]),
                                  legend=LEGEND),
        # device bytes sit a CUDA context above reserved: drawn wider (and first), both stay visible
        size=alt.Size("series:N", scale=alt.Scale(range=[5, 2, 2]), legend=None),
        order=alt.Order("series:N"),
        tooltip=[alt.Tooltip("series:N"), alt.Tooltip(f"{x}:Q", title=x_title),
                 alt.Tooltip("gib:Q", title="GiB", format=",.2f"), alt.Tooltip("gb:Q", title="GB", format=",.2f")])
    layers = [lines, capacity_rule(capacity_bytes, capacity_label)]
    if len(pts):
        ok = pts[~pts["oom"]]
        oom = pts[pts["oom"]].assign(gib=capacity_bytes / GiB, gb=capacity_bytes / GB)
        tip = [alt.Tooltip("source:N"), alt.Tooltip("gpu_name:N", title="GPU"),
               *([alt.Tooltip("metric:N", title="metric"), alt.Tooltip("where:N", title="published by")]
                 if "metric" in pts else []),
               alt.Tooltip(f"{x}:Q", title=x_title), alt.Tooltip("gib:Q", title="peak (GiB)", format=",.2f"),
               alt.Tooltip("gb:Q", title="GB", format=",.2f"), alt.Tooltip("run_id:N")]
        layers.append(alt.Chart(ok).mark_point(filled=True, size=90, opacity=0.9, strokeWidth=0).encode(
            x=f"{x}:Q", y="gib:Q",
            shape=alt.Shape("source:N", title="Stored run", scale=alt.Scale(
                domain=list(SOURCE_SHAPES), range=list(SOURCE_SHAPES.values()))),
            fill=alt.Fill("source:N", title="Stored run", scale=alt.Scale(
                domain=list(SOURCE_SHAPES), range=list(SOURCE_COLORS))),
            tooltip=tip))
        if len(oom):
            layers.append(alt.Chart(oom).mark_point(shape="cross", filled=True, size=140, color=CAPACITY_COLOR).encode(
                x=f"{x}:Q", y="gib:Q", tooltip=[alt.Tooltip("source:N"), alt.Tooltip("gpu_name:N", title="GPU"),
                                               alt.Tooltip(f"{x}:Q", title=x_title),
                                               alt.Tooltip("oom_stage:N", title="OOM in stage"),
                                               alt.Tooltip("run_id:N")]))
    return alt.layer(*layers).properties(height=340)


def calibration_chart(points: pd.DataFrame, lines: pd.DataFrame) -> alt.Chart:
    """Each run's activation bytes (points: x_gib, y_gib, source, model_name, batch, seq, run_id) against the
    seeds' regressor b*s*h*L*bytes, with one dashed line per k (lines: line, k, x_gib, y_gib)."""
    tip = [alt.Tooltip("source:N"), alt.Tooltip("model_name:N", title="model"), alt.Tooltip("batch:Q"),
           alt.Tooltip("seq:Q"), alt.Tooltip("x_gib:Q", title="b*s*h*L*bytes (GiB)", format=",.3f"),
           alt.Tooltip("y_gib:Q", title="activation bytes (GiB)", format=",.3f"), alt.Tooltip("run_id:N")]
    scatter = alt.Chart(points).mark_point(filled=True, size=60).encode(
        x=alt.X("x_gib:Q", title="b·s·h·L·bytes (GiB, 2^30 bytes)"),
        y=alt.Y("y_gib:Q", title="Activation bytes of the run (GiB)"),
        shape=alt.Shape("source:N", title="Stored run"), tooltip=tip)
    fitline = alt.Chart(lines).mark_line(strokeDash=[4, 3]).encode(
        x="x_gib:Q", y="y_gib:Q", color=alt.Color("line:N", title="k", scale=alt.Scale(range=SERIES_COLORS)),
        tooltip=[alt.Tooltip("line:N"), alt.Tooltip("k:Q", format=".3f")])
    return (scatter + fitline).properties(title="Activation bytes vs the blog posts' regressor (b*s*h*L*bytes)", height=320)


def residual_chart(points: pd.DataFrame) -> alt.Chart:
    """Residuals (points: fitted_gib, resid_gib, resid_gb, source, run_id) against the fitted value, and zero."""
    resid = alt.Chart(points).mark_point(filled=True, size=60).encode(
        x=alt.X("fitted_gib:Q", title="Fitted activation bytes k·x (GiB, 2^30 bytes)"),
        y=alt.Y("resid_gib:Q", title="Residual y − k·x (GiB)"),
        shape=alt.Shape("source:N", title="Stored run"),
        tooltip=[alt.Tooltip("source:N"), alt.Tooltip("model_name:N", title="model"), alt.Tooltip("batch:Q"),
                 alt.Tooltip("seq:Q"), alt.Tooltip("resid_gib:Q", title="residual (GiB)", format=",.3f"),
                 alt.Tooltip("resid_gb:Q", title="residual (GB)", format=",.3f"), alt.Tooltip("run_id:N")])
    zero = alt.Chart(pd.DataFrame({"y": [0.0]})).mark_rule(color="gray").encode(y="y:Q")
    return (resid + zero).properties(title="Residuals", height=320)


def accuracy_chart(summary: pd.DataFrame) -> alt.Chart:
    """Median and p90 |relative error| per method (bars: median; ticks: p90), one row per mode; log scale."""
    df = summary.assign(median_pct=summary["median"] * 100, p90_pct=summary["p90"] * 100,
                        worst_pct=summary["worst"] * 100)
    tips = [alt.Tooltip("method:N", title="method"), alt.Tooltip("mode:N", title="mode"),
            alt.Tooltip("n:Q", title="runs"), alt.Tooltip("median_pct:Q", title="median |error| (%)", format=".3g"),
            alt.Tooltip("p90_pct:Q", title="p90 |error| (%)", format=".3g"),
            alt.Tooltip("worst_pct:Q", title="worst |error| (%)", format=".3g")]
    x = alt.X("median_pct:Q", title="median |relative error| (%, log scale)",
              scale=alt.Scale(type="log", domainMin=0.001, clamp=True))
    bars = alt.Chart(df).mark_bar().encode(x=x, y=alt.Y("method:N", title=None, sort="x"),
                                            color=alt.Color("method:N", legend=None), tooltip=tips)
    ticks = alt.Chart(df).mark_tick(color="black", thickness=2).encode(
        x=alt.X("p90_pct:Q", scale=alt.Scale(type="log", domainMin=0.001, clamp=True)),
        y=alt.Y("method:N", sort="x"), tooltip=tips)
    return alt.layer(bars, ticks, data=df).facet(row=alt.Row("mode:N", title="mode")).resolve_scale(y="independent")
