"""Curves: the analytic peak against batch size and against sequence length, with stored runs on top.

The lines are `estimator.estimate` at each x; measured and traced runs of the same model and workload are drawn
as points (OOM runs as red crosses on the GPU's line, the cliff), and the residuals table sets each run beside
the estimate for its own settings.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd
import streamlit as st

from bench.store import app_data
from estimator import search
from estimator.device import capacity_bytes
from estimator.estimate import Options, estimate
from estimator.gpus import get_gpu
from estimator.presets import load_config
from estimator.spec import MAX_BATCH, MAX_SEQ, Parallel
from estimator.units import GB, GiB, fmt_bytes
from estimator.seq2seq import check as seq2seq_check, seq_limit
from estimator.vision import check_images, media_tokens, sized
from pages import _charts as charts
from pages import _derive as derive
from pages import _state as state, _data as reads, _inputs as ui

NO_TRACE = Options(derive=False)  # the page makes sure of its profile first (with a progress bar)
PAGE = "curves"
# Workload columns a stored run must share with the chosen workload to sit on these curves (batch and seq vary).
TRAIN_MATCH = ("mode", "method", "recipe", "precision", "optimizer", "checkpointing", "attention", "grad_accum")
LORA_MATCH = ("lora_rank", "weight_format")
INFER_MATCH = ("mode", "precision", "weight_format", "attention", "gen_tokens", "kv_dtype")


def match_filters(w, par) -> dict:
    """{runs column: value} a stored run must have to be a point on these curves."""
    names = INFER_MATCH if w.mode == "infer" else TRAIN_MATCH + (LORA_MATCH if w.method != "full" else ())
    return {**{c: getattr(w, c) for c in names}, "strategy": par.strategy, "world_size": par.gpus}


def axis(lo: int, hi: int) -> list[int]:
    """Powers of two from lo to hi, with the half-way points 1.5 * 2^k, so the cliff is not missed."""
    out, x = [], lo
    while x <= hi:
        out.append(x)
        if x * 3 // 2 <= hi and x * 3 // 2 > x:
            out.append(x * 3 // 2)
        x *= 2
    return sorted(set(out))


SERIES = (("estimate: device (nvidia-smi)", "device_bytes"), ("estimate: torch reserved", "reserved_bytes"),
          ("estimate: torch allocated", "allocated_bytes"))


def analytic(model, w, par, xs: list[int], x: str, options: Options = NO_TRACE) -> pd.DataFrame:
    """Estimate at each x: device bytes (the verdict's number, vs the GPU), torch's reserved peak, and its
    allocated peak (vs stored runs)."""
    rows = []
    for v in xs:
        est = estimate(model, replace(w, **{x: v}), par, options)
        rows += [{x: v, "series": label, "gib": getattr(est, attr) / GiB, "gb": getattr(est, attr) / GB}
                 for label, attr in SERIES]
    return pd.DataFrame(rows)


def stored(pts: pd.DataFrame, x: str) -> pd.DataFrame:
    """The columns the chart draws (a chart's data travels to the browser: keep it narrow)."""
    value = pts["value_bytes"] if "value_bytes" in pts else pts["peak_alloc_bytes"]
    return pd.DataFrame({x: pts[x], "source": pts["source"], "gpu_name": pts["gpu_name"], "run_id": pts["run_id"],
                         "gib": value / GiB, "gb": value / GB,
                         "metric": pts["metric"] if "metric" in pts else "allocated",
                         "where": pts["source_repo"] if "source_repo" in pts else "",
                         "oom": pts["oom"].astype(bool), "oom_stage": pts["oom_stage"]})


def residuals(model, pts: pd.DataFrame) -> None:
    st.subheader("Residuals")
    if pts.empty:
        st.caption("No stored run matches this model and workload (any batch, any sequence length).")
        return
    df = app_data.with_estimates(pts, model)
    table = pd.DataFrame({
        "source": df["source"], "GPU": df["gpu_name"], "batch": df["batch"], "seq": df["seq"],
        "stored peak alloc (GiB)": df["peak_alloc_bytes"] / GiB,
        "estimate (GiB)": df["est_allocated_bytes"].astype("Float64") / GiB,
        "stored - estimate (GiB)": (df["peak_alloc_bytes"] - df["est_allocated_bytes"]).astype("Float64") / GiB,
        "relative error": df["rel_error"], "OOM": df["oom"], "run_id": df["run_id"]})
    by_source = df.dropna(subset=["rel_error"]).groupby("source")["rel_error"]
    cols = st.columns(max(1, len(by_source)))
    for c, (source, errs) in zip(cols, by_source):
        c.metric(f"{source}: median |relative error|", f"{errs.abs().median():.1%}",
                 help=f"{len(errs)} runs; relative error = (stored - estimate) / estimate, allocated bytes.")
    fmt = st.column_config.NumberColumn(format="%.3f")
    st.dataframe(table, hide_index=True, column_config={
        "stored peak alloc (GiB)": fmt, "estimate (GiB)": fmt, "stored - estimate (GiB)": fmt,
        "relative error": st.column_config.NumberColumn(format="percent")})


def main() -> None:
    f = {x.name: x for x in ui.workload_fields() + ui.hardware_fields()}
    f["model"] = ui.model_field()
    f["alloc"] = ui.alloc_conf_field()
    state.init_state(PAGE, list(f.values()))
    st.title("Curves")
    st.caption("The analytic peak as batch or sequence length grows, stored runs on top, and where the GPU's "
               "memory runs out. Sizes in GiB (2^30 bytes).")
    shown = {"model", "gpu", "strategy", "gpus", "alloc"}
    name = state.widget(PAGE, f["model"], st.sidebar)
    gpu_name = state.widget(PAGE, f["gpu"], st.sidebar, format_func=ui.gpu_label)
    strategy = state.widget(PAGE, f["strategy"], st.sidebar)
    gpus = state.widget(PAGE, f["gpus"], st.sidebar, disabled=strategy == "single")
    alloc = ui.alloc_conf_input(PAGE, f["alloc"], st.sidebar)
    if alloc is None:
        state.write_url(PAGE, list(f.values()), shown)
        return
    _, config = load_config(name)
    model = ui.load_model(config, name)
    ui.prepare_lora_targets(PAGE, ui.lora_target_options(model), model.model_type)
    f["lora_targets"] = replace(f["lora_targets"], choices=tuple(ui.lora_target_options(model)))
    kinds = {**ui.kinds(model), "vision": False}   # this page lists text models only
    ui.default_images(PAGE, model)
    values, w_shown = ui.workload_inputs(PAGE, f, st.sidebar, **kinds)
    state.write_url(PAGE, list(f.values()), shown | set(w_shown))
    w = ui.workload_from_dict(values, **kinds)
    try:
        w = sized(model, w)     # a grid VLM's image size (0: its default) is part of its profile's class
        check_images(model, w)  # a vision-language model's image tokens must fit in the sequence
    except ValueError as e:
        st.error(ui.images_error(e))
        return
    par = Parallel(strategy=strategy, gpus=1 if strategy == "single" else gpus)
    try:
        seq2seq_check(model, w, par)   # an encoder-decoder model's lengths, knobs and layout: one line, before a trace
    except ValueError as e:
        st.error(f"{e}. Change it in the sidebar.")
        return
    gpu = get_gpu(gpu_name)
    usable = capacity_bytes(gpu)
    cap = f"{gpu.display_name}: {fmt_bytes(usable, 'GiB')} usable"
    options = replace(NO_TRACE, alloc_conf=alloc, gpu=gpu.name)

    # stored runs are text-only steps (a run row has no images or audio column): none sits on a curve with them
    pts = state.or_error(lambda: pd.DataFrame() if w.images or w.audios or reads.empty_db_notice()
                      else reads.points(config, name, w.batch, w.seq, match_filters(w, par)), pd.DataFrame())
    model.inventory.trainable_params(w)  # a LoRA target the model lacks: one line, before any trace
    prov = derive.profile_or_background(PAGE, model, w, par)
    if prov is None:  # deriving in the background; the page reruns when it is done
        return
    st.caption(ui.provenance_caption(prov))
    b_max = search.max_batch(model, w, par, usable, options)
    # no sequence past positions the model does not have: learned ones, or a speech decoder's (Whisper: 448)
    hard = model.max_positions if model.learned_positions else seq_limit(model)
    s_max = search.max_seq(model, w, par, usable, options, limit=hard or min(MAX_SEQ, 4 * model.max_positions))
    # x runs a little past the cliff (or past the stored runs), so the line's crossing stays readable
    top_b = max([16, 4 * b_max, *(pts["batch"].tolist() if len(pts) else [])])
    top_s = max([4 * w.seq, 4 * s_max, *(pts["seq"].tolist() if len(pts) else [])])
    top_s = min(top_s, hard) if hard else top_s
    c1, c2 = st.columns(2)
    c1.metric(f"Largest micro-batch at seq {w.seq:,}", f"{b_max:,}")
    c2.metric(f"Longest sequence at batch {w.batch}", f"{s_max:,} tokens")

    st.subheader(f"Peak vs micro-batch size (seq {w.seq:,})")
    on_b = stored(pts[pts["seq"] == w.seq], "batch") if len(pts) else pts
    charts.show(charts.curve_chart(analytic(model, w, par, axis(1, min(top_b, MAX_BATCH)), "batch", options),
                                       on_b, "batch", "Micro-batch size (sequences per GPU)", usable, cap))
    st.subheader(f"Peak vs sequence length (batch {w.batch})")
    on_s = stored(pts[pts["batch"] == w.batch], "seq") if len(pts) else pts
    first = max(128, media_tokens(model, w) + 1)   # a VLM's sequence holds its images' (audio's) tokens and text
    charts.show(charts.curve_chart(analytic(model, w, par, axis(first, min(max(top_s, 2 * first), MAX_SEQ)), "seq",
                                            options),
                                       on_s, "seq", "Sequence length (tokens)", usable, cap))
    residuals(model, pts)


state.run_page(main)
