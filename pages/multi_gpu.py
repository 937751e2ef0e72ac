"""Multi-GPU: per-GPU memory against the GPU count for each parallelism strategy, and two strategies side by side.

Every bar is `estimator.estimate` at that strategy and world size; the fewest GPUs per strategy is
`estimator.search.min_gpus`; traced FSDP2 runs from the database are drawn on top where they exist.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd
import streamlit as st

from estimator import cp as estimator_cp, search
from estimator.device import capacity_bytes
from estimator.breakdown import COMPONENTS
from estimator.estimate import Options, estimate
from estimator.gpus import get_gpu
from estimator.layouts import layouts
from estimator.presets import load_config
from estimator.spec import PP_SCHEDULES, PP_TRACED_ONLY, STRATEGIES, Parallel
from estimator.units import GB, GiB, fmt_bytes
from estimator.seq2seq import seq2seq_of
from estimator.vision import check_images, sized
from estimator.parallel import TRACED_SHARDING, check_model, pp_untraced, steppable  # TRACED_SHARDING: bench trace
from pages import _charts as charts
from pages import _derive as derive
from pages import _state as state, _data as reads, _inputs as ui

NO_TRACE = Options(derive=False)  # every profile is made sure of (with a progress bar) before the page prices


def priced(gpu) -> Options:
    """How the page prices: from profiles on disk, on the chosen GPU (its CUDA context and kernel images, as the
    Will it fit? page does)."""
    return replace(NO_TRACE, gpu=gpu.name)
PAGE = "multi"
MULTI = tuple(s for s in STRATEGIES if s != "single")
DEFAULT_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "pp")
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)
RULED_SCHEDULES = tuple(s for s in PP_SCHEDULES if s not in PP_TRACED_ONLY)   # every layout of N GPUs is priced
MAX_SEARCH_GPUS = 1024


def fields() -> dict[str, state.Field]:
    f = {x.name: x for x in ui.workload_fields()}
    f["model"] = ui.model_field()
    f["gpu"] = ui.hardware_fields()[0]
    f["compare_a"] = state.Field("compare_a", "choice", "zero3", MULTI, label="Strategy A",
                              help="First strategy of the side-by-side comparison.")
    f["compare_b"] = state.Field("compare_b", "choice", "tp", MULTI, label="Strategy B",
                              help="Second strategy of the side-by-side comparison.")
    f["layout_n"] = state.Field("layout_n", "int", 8, lo=1, hi=MAX_SEARCH_GPUS, label="GPUs to lay out",
                                help="World size whose FSDP x TP x PP layouts are ranked (torchtitan's mesh).")
    f["pp_schedule"] = state.Field("pp_schedule", "choice", "1f1b", RULED_SCHEDULES, label="Pipeline schedule",
                                   help="How the layouts with PP > 1 run their micro-batches (torch.distributed."
                                        "pipelining, torchtitan's pipeline_parallel_schedule): 1f1b keeps at most pp "
                                        "of them on the first stage, gpipe every one on every stage, "
                                        "interleaved-1f1b gives each rank two stages (r and r + pp). The zero-bubble "
                                        "schedules (interleaved-zb, zbv, dualpipev) are priced from traced ranks "
                                        "only: `python -m estimator --pp-schedule zbv` names the command that "
                                        "derives them.")
    f["microbatches"] = state.Field("microbatches", "int", 0, lo=0, hi=4096, label="Pipeline micro-batches",
                                    help="Micro-batches per step through the pipeline, each of the batch size above "
                                         "(torchtitan: local batch / microbatch size). 0: the gradient "
                                         "accumulation steps. 1F1B needs at least pp of them.")
    f["cp"] = state.Field("cp", "int", 1, lo=1, hi=64, label="Context-parallel degree",
                          help="torchtitan's context_parallel_degree: each sequence split over this many ranks (ring "
                               "attention), FSDP over the rest x cp. 1: off. It must divide the GPUs to lay out, and "
                               "the sequence length must be a multiple of 2 x cp.")
    f["compare_n"] = state.Field("compare_n", "int", 8, lo=1, hi=MAX_SEARCH_GPUS, label="GPUs for the comparison",
                              help="World size at which the two strategies are compared.")
    return f


def sweep_rows(model, w, strategies, counts, gpu) -> pd.DataFrame:
    """Long table (strategy, gpus, component, bytes, gib, gb) of the peak breakdown at each valid world size."""
    rows = []
    for s in strategies:
        try:
            valid = set(search.valid_world_sizes(model, s, max(counts)))
        except ValueError as e:  # e.g. expert parallelism on a dense model
            st.caption(f"{s}: {e}")
            continue
        for n in counts:
            if n not in valid:
                continue
            peak = estimate(model, w, Parallel(strategy=s, gpus=n), priced(gpu)).components
            rows += [{"strategy": s, "gpus": n, "component": c, "bytes": b, "gib": b / GiB, "gb": b / GB}
                     for c, b in peak.as_dict().items() if b]
    return pd.DataFrame(rows, columns=["strategy", "gpus", "component", "bytes", "gib", "gb"])


def traced_points(config, name, w) -> pd.DataFrame:
    """Traced FSDP2 runs of this model and workload: per-rank peak allocated against the world size."""
    if reads.empty_db_notice():
        return pd.DataFrame()
    match = {"source": "traced", "strategy": list(TRACED_SHARDING), "mode": w.mode, "method": w.method,
             "precision": w.precision, "recipe": w.recipe, "batch": w.batch, "seq": w.seq}
    pts = reads.points(config, name, w.batch, w.seq, match)
    pts = pts[pts["peak_alloc_bytes"].notna()] if len(pts) else pts
    if pts.empty:
        return pts
    return pts.assign(gpus=pts["world_size"], gib=pts["peak_alloc_bytes"] / GiB, gb=pts["peak_alloc_bytes"] / GB)


def min_gpus_table(model, w, strategies, gpu) -> None:
    st.subheader(f"Fewest {gpu.display_name} GPUs that fit")
    rows = []
    for s in strategies:
        try:
            n = search.min_gpus(model, w, s, capacity_bytes(gpu), max_gpus=MAX_SEARCH_GPUS, options=priced(gpu))
        except ValueError as e:  # e.g. expert parallelism on a dense model
            rows.append({"strategy": s, "fewest GPUs": None, "peak per GPU (GiB)": None, "note": str(e)})
            continue
        peak = estimate(model, w, Parallel(strategy=s, gpus=n), priced(gpu)).total_bytes if n else None
        rows.append({"strategy": s, "fewest GPUs": n, "peak per GPU (GiB)": peak / GiB if peak else None,
                     "note": "" if n else search.why_no_fit(model, w, s, capacity_bytes(gpu), MAX_SEARCH_GPUS,
                                                            priced(gpu))})
    st.dataframe(pd.DataFrame(rows), hide_index=True, column_config={
        "fewest GPUs": st.column_config.NumberColumn(format="%d"),
        "peak per GPU (GiB)": st.column_config.NumberColumn(format="%.2f")})


def layouts_section(model, w, gpu, f) -> int:
    """Every FSDP x TP x PP layout of N GPUs (estimator.layouts), the worst rank of each, one drawn stage by stage.
    Returns N."""
    st.subheader("Layouts: FSDP x TP x PP on N GPUs")
    c1, c2, c3 = st.columns(3)
    n = state.widget(PAGE, f["layout_n"], c1)
    schedule = state.widget(PAGE, f["pp_schedule"], c2)
    micro = state.widget(PAGE, f["microbatches"], c3)
    rows = layouts(model, w, n, capacity_bytes(gpu), priced(gpu), pp_schedule=schedule, microbatches=micro)
    if not rows:
        st.info(f"No FSDP x TP x PP layout of {n} GPUs suits {model.name} (TP must divide its heads, PP its layers).")
        return n
    st.dataframe(pd.DataFrame([{"layout": lay.label, "worst rank (GiB)": lay.device_bytes / GiB,
                                "worst rank (GB)": lay.device_bytes / GB, "fits": lay.fits,
                                "priced by": lay.priced, "why": lay.why(capacity_bytes(gpu))} for lay in rows]),
                 hide_index=True, column_config={"worst rank (GiB)": st.column_config.NumberColumn(format="%.2f"),
                                                 "worst rank (GB)": st.column_config.NumberColumn(format="%.2f")})
    chosen = st.selectbox("Draw the worst rank of", [lay.label for lay in rows], key=f"{PAGE}:layout",
                          help="Its step stage by stage: what each component holds at each stage's peak.")
    lay = next(x for x in rows if x.label == chosen)
    est = estimate(model, w, lay.parallel, priced(gpu))
    charts.show(charts.stages_chart(est.stages, capacity_bytes(gpu),
                                    f"{gpu.display_name}: {fmt_bytes(capacity_bytes(gpu), 'GiB')}"))
    st.caption(f"{lay.label}: {lay.why(capacity_bytes(gpu))}. Priced by the {lay.priced}: a layout whose ranks' "
               "profiles are on disk (`python -m bench derive ... --pp P --tp T`) is priced from them exactly, the "
               "others by the analytic rule over the traced FSDP rank (docs/parallel.md). FSDP x CP layouts join the "
               "table once their two CP ranks' profiles are on disk (the next section derives one degree).")
    if lay.pp > 1 and lay.priced == "analytic rule":   # its ranks can be traced: on request, in the background
        why = pp_untraced(w, lay.parallel)
        if why:
            st.caption(f"Its pipeline ranks are not traced here: {why}.")
        else:
            derive.pipeline_ranks_in_background(PAGE, model, w, lay.parallel)
    return n


def fsdp_units_section(model, w, gpu, n: int) -> None:
    """Plain FSDP over the N GPUs of the layouts with HF Accelerate's units (each decoder layer, then the root, which
    holds the embedding, final norm and head for the whole step) beside torchtitan's (the embedding, each block, the
    final norm with the head, then the root): `--fsdp-wrap` (docs/parallel.md). torchtitan's class derives on request,
    in the background."""
    st.subheader("FSDP units: HF Accelerate's or torchtitan's")
    titan = Parallel(strategy="fsdp", gpus=max(n, 2), fsdp_wrap="torchtitan")
    try:
        check_model(model.inventory, titan, model.name)
    except ValueError as e:
        st.caption(str(e))
        return
    if n < 2:
        st.caption("Lay out 2 GPUs or more to compare FSDP's units.")
        return
    accelerate = estimate(model, w, Parallel(strategy="fsdp", gpus=n), priced(gpu))
    if not derive.profile_on_request(PAGE, model, w, titan, "Derive torchtitan's FSDP units (in the background)",
                                     "One FSDP2 rank traced with torchtitan's units on fake tensors, as any profile "
                                     "(tens of seconds to minutes); then priced here beside HF Accelerate's."):
        st.caption(f"HF Accelerate's units over {n} GPUs: {fmt_bytes(accelerate.total_bytes, 'GiB')} per GPU "
                   f"({fmt_bytes(accelerate.total_bytes, 'GB')}).")
        return
    rows = []
    for label, est in (("HF Accelerate (each layer, then the root)", accelerate),
                       ("torchtitan", estimate(model, w, titan, priced(gpu)))):
        rows.append({"FSDP units": label, "peak per GPU (GiB)": est.total_bytes / GiB,
                     "peak per GPU (GB)": est.total_bytes / GB,
                     "weights at the peak (GiB)": est.components.weights / GiB, "peak stage": est.peak_stage})
    st.dataframe(pd.DataFrame(rows), hide_index=True, column_config={
        c: st.column_config.NumberColumn(format="%.2f") for c in ("peak per GPU (GiB)", "peak per GPU (GB)",
                                                                  "weights at the peak (GiB)")})
    st.caption("torchtitan gathers the embedding only while it runs and the head from its use to the end of backward "
               "(a head tied to the embedding: one unit, kept gathered); HF Accelerate's root unit holds both for the "
               "whole step. Each rank traced with its units (docs/parallel.md, \"FSDP2's units\").")


def context_parallel_section(model, w, gpu, f, n: int) -> None:
    """FSDP x CP on the N GPUs of the layouts (estimator.cp): the worse of the two derived CP ranks beside FSDP alone,
    its step drawn stage by stage; a CP profile not on disk is derived in the background (both ranks)."""
    st.subheader(f"Long sequences: FSDP x context parallelism on {n} GPUs")
    cp = state.widget(PAGE, f["cp"], st)
    if cp == 1:
        st.caption("Pick a context-parallel degree above 1 to split each sequence over that many GPUs (torchtitan's "
                   "ring attention; docs/parallel.md, \"Context parallelism\").")
        return
    try:
        if n % cp:
            raise ValueError(f"cp: {cp} must divide the {n} GPUs to lay out")
        par = Parallel(strategy="fsdp", gpus=n, cp=cp)
        estimator_cp.check(w, par)
        if derive.profile_or_background(PAGE, model, w, par) is None:
            return   # both CP ranks derive in the background; the page reruns when they are on disk
        est = estimate(model, w, par, priced(gpu))
    except ValueError as e:
        st.warning(" ".join(str(e).split()))
        return
    alone = estimate(model, w, Parallel(strategy="fsdp", gpus=n), priced(gpu)) if n > 1 else None
    c = st.columns(3)
    spare = capacity_bytes(gpu) - est.total_bytes
    c[0].metric(f"Worst CP rank ({est.pipeline_stage})", fmt_bytes(est.total_bytes, "GiB"),
                delta=f"{fmt_bytes(abs(spare), 'GiB')} {'to spare' if spare >= 0 else 'over'}",
                delta_color="normal" if spare >= 0 else "inverse", help=fmt_bytes(est.total_bytes, "GB"))
    c[1].metric("Activations on it", fmt_bytes(est.components.activations, "GiB"),
                help=fmt_bytes(est.components.activations, "GB"))
    if alone is not None:
        c[2].metric(f"FSDP over {n}, no CP", fmt_bytes(alone.total_bytes, "GiB"), help=fmt_bytes(alone.total_bytes, "GB"))
    charts.show(charts.stages_chart(est.stages, capacity_bytes(gpu),
                                    f"{gpu.display_name}: {fmt_bytes(capacity_bytes(gpu), 'GiB')}"))
    st.caption(f"FSDP over dp_shard {par.dp_size} x cp {cp}: each rank holds {w.seq // cp} of every sequence's "
               f"{w.seq} tokens and 1/{n} of the model states. Ranks 0 and {cp - 1} are traced as themselves (a "
               "middle rank holds no more than the worse of them) and the worse is shown; exact against full-depth "
               "traces of every rank (scripts/parallel_check.py).")


def compare(model, w, gpu, f) -> None:
    st.subheader("Side by side")
    c = st.columns(3)
    a = state.widget(PAGE, f["compare_a"], c[0])
    b = state.widget(PAGE, f["compare_b"], c[1])
    n = state.widget(PAGE, f["compare_n"], c[2])
    cap = f"{gpu.display_name}: {fmt_bytes(capacity_bytes(gpu), 'GiB')}"
    cols = st.columns(2)
    for col, s in zip(cols, (a, b)):
        with col:
            st.markdown(f"**{s}** on {n} GPU(s)")
            try:
                valid = n in search.valid_world_sizes(model, s, n)
            except ValueError:
                valid = False
            if not valid:
                st.warning(f"{s} cannot use {n} GPUs with {model.name} (see estimator.search.valid_world_sizes); "
                           "pick another GPU count.")
                continue
            est = estimate(model, w, Parallel(strategy=s, gpus=n), priced(gpu))
            spare = capacity_bytes(gpu) - est.total_bytes
            st.metric("Peak per GPU", fmt_bytes(est.total_bytes, "GiB"),
                      delta=f"{fmt_bytes(abs(spare), 'GiB')} {'to spare' if spare >= 0 else 'over'}",
                      delta_color="normal" if spare >= 0 else "inverse", help=fmt_bytes(est.total_bytes, "GB"))
            left, right = st.columns([1, 1])
            charts.show(charts.peak_chart(est.components, f"peak ({est.peak_stage})", capacity_bytes(gpu), cap), left)
            right.dataframe(pd.DataFrame({"GiB": [est.components.as_dict()[k] / GiB for k in COMPONENTS]},
                                         index=list(COMPONENTS)).style.format("{:,.2f}"))


def main() -> None:
    f = fields()
    state.init_state(PAGE, list(f.values()))
    st.title("Multi-GPU")
    st.caption("Memory per GPU as the world size grows, for each way of splitting the run. "
               "Sizes in GiB (2^30 bytes); the dashed line is the chosen GPU's memory.")
    name = state.widget(PAGE, f["model"], st.sidebar)
    gpu = get_gpu(state.widget(PAGE, f["gpu"], st.sidebar, format_func=ui.gpu_label))
    strategies = st.sidebar.multiselect("Strategies", MULTI, default=list(DEFAULT_STRATEGIES), key=f"{PAGE}:strategies",
                                        help="ddp replicates; zero1/2/3 shard states / +grads / +weights; fsdp = "
                                             "ZeRO-3; tp splits matrices; pp splits layers; ep splits experts.")
    counts = st.sidebar.multiselect("GPU counts", GPU_COUNTS, default=list(GPU_COUNTS[:5]), key=f"{PAGE}:counts",
                                    help="World sizes to draw; a strategy skips sizes it cannot use.")
    _, config = load_config(name)
    model = ui.load_model(config, name)
    ui.prepare_lora_targets(PAGE, ui.lora_target_options(model), model.model_type)
    f["lora_targets"] = replace(f["lora_targets"], choices=tuple(ui.lora_target_options(model)))
    ui.default_images(PAGE, model)
    values, shown = ui.workload_inputs(PAGE, f, st.sidebar, **ui.kinds(model))
    if seq2seq_of(model) is not None:
        st.info(f"{name} is an encoder-decoder model: the Will-it-fit page prices it on one GPU and under DDP, "
                "ZeRO-1/2 and FSDP (every layer of both stacks sharded); TP and PP layouts of its two layer stacks, "
                "which this page compares, are not priced yet.")
        return
    try:
        w = sized(model, ui.workload_from_dict(values, **ui.kinds(model)))   # a grid VLM's image size: its class
        runs = steppable(w, Parallel(strategy="fsdp", gpus=2))   # fused SGD: estimator.parallel.check_optimizer
        if runs is not w:
            st.info("Fused SGD cannot step FSDP2's or TP's parameters (torch 2.13 has no DTensor sharding strategy "
                    "for it: the run fails): every strategy on this page is priced with its foreach step.")
            w = runs
        if not strategies or not counts:
            st.info("Pick at least one strategy and one GPU count in the sidebar.")
            return
        model.inventory.trainable_params(w)  # a LoRA target the model lacks: one line, before any trace
        check_images(model, w)                # a VLM's images must fit in the sequence: one line, before any trace
        # the library decides which traced profile prices each strategy (estimator.estimate.traced_class): make sure
        # of each once, with a progress bar where one must be derived
        for s in dict.fromkeys((*strategies, "fsdp")):  # fsdp: the layouts section composes over it
            if derive.profile_or_background(PAGE, model, w, Parallel(strategy=s, gpus=2)) is None:
                return  # deriving in the background; the page reruns when it is done
        df = sweep_rows(model, w, strategies, sorted(counts), gpu)
        traced = state.or_error(lambda: traced_points(config, name, w), pd.DataFrame())
        cap = f"{gpu.display_name}: {fmt_bytes(capacity_bytes(gpu), 'GiB')}"
        charts.show(charts.strategy_chart(df, capacity_bytes(gpu), cap, traced if len(traced) else None))
        if len(traced):
            st.caption(f"Black diamonds: {len(traced)} traced FSDP2 run(s), per-rank peak allocated "
                       "(tensors only: no CUDA context or NCCL buffers).")
        min_gpus_table(model, w, strategies, gpu)
        n = layouts_section(model, w, gpu, f)
        fsdp_units_section(model, w, gpu, n)
        context_parallel_section(model, w, gpu, f, n)
        compare(model, w, gpu, f)
    finally:
        state.write_url(PAGE, list(f.values()), {"model", "gpu", "compare_a", "compare_b", "compare_n", "layout_n",
                                                 "pp_schedule", "microbatches", "cp", *shown})


state.run_page(main)
