"""Will it fit? The home page: one model, one workload, one GPU type -> the verdict, and why.

Every input lives in the URL (st.query_params), so a copied link reproduces the view. The numbers all come
from `estimator.estimate`, `estimator.search` and `bench.store.app_data`; this page only draws them.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd
import streamlit as st

from bench.store import app_data
from estimator.hub import OfflineError, fetch_config, validate_model_id, validate_revision
from estimator import search
from estimator.calibration_file import entry_for
from estimator.device import capacity_bytes, capacity_source
from estimator.breakdown import COMPONENTS
from estimator.estimate import Options, estimate
from estimator.gpus import get_gpu
from estimator.model import check_context, check_sizes, defaults_note
from estimator.presets import MAX_CONFIG_BYTES, load_config, parse_config_text
from estimator.spec import Parallel
from estimator.units import GB, GiB, fmt_bytes
from estimator.seq2seq import check as seq2seq_check, words as seq2seq_words
from estimator.vision import check_images, image_words, is_vision, size_words, sized
from estimator.audio import audio_words
from pages import _charts as charts
from pages import _derive as derive
from pages import _state as state, _data as reads, _inputs as ui
from bench.accuracy.published import COMPARED_WITH
from bench.published.importer import estimate_row

PAGE = "fit"
SOURCES = {"preset": "Preset", "upload": "Upload config.json", "paste": "Paste config.json",
           "hub": "Hugging Face model id"}


def fields() -> dict[str, state.Field]:
    out = {f.name: f for f in ui.workload_fields() + ui.hardware_fields()}
    out["source"] = state.Field("source", "choice", "preset", tuple(SOURCES), label="Model from",
                             help="A shipped preset, your own config.json (uploaded or pasted), or a model id "
                                  "whose config.json is fetched from the Hugging Face hub (needs network).")
    out["model"] = ui.model_field()
    out["hf"] = state.Field("hf", "text", "", label="Hugging Face model id",
                         help="e.g. Qwen/Qwen2.5-0.5B. Only config.json is downloaded: no weights, no code. "
                              "Gated models (meta-llama/*) need HF_TOKEN set where the app runs.")
    out["rev"] = state.Field("rev", "text", "", label="Revision",
                          help="Branch, tag or commit of the hub model (empty: main).")
    out["alloc"] = ui.alloc_conf_field()
    out["calibrated"] = state.Field("calibrated", "bool", False, label="Use calibrated k",
                                 help="Activations as k * b*s*h*L*bytes with k fitted on stored runs of this "
                                      "model family (Calibrate page), instead of the detailed per-tensor model.")
    return out


# ---------------------------------------------------------------- the model

def _hub_config(model_id: str, revision: str) -> dict:
    """config.json of a hub model at a revision, fetched once per session; a failure is remembered too (so a dead
    network costs one round of huggingface_hub's retries, not one per rerun) until the user presses Retry."""
    fetched = st.session_state.setdefault("_hub_configs", {})
    key = (model_id, revision)
    if key not in fetched:
        with st.spinner(f"Fetching {model_id}/config.json ({revision}) from the Hugging Face hub"):
            try:
                fetched[key] = fetch_config(model_id, revision)
            except (OfflineError, ValueError) as e:
                fetched[key] = e
    result = fetched[key]
    if isinstance(result, Exception):
        if st.sidebar.button("Retry the download", key=f"{PAGE}:hub_retry"):
            del fetched[key]
            st.rerun()
        raise result
    return result


def choose_model(f: dict[str, state.Field], shown: set[str]) -> tuple[str, dict, str | None, list[str]] | None:
    """Sidebar model inputs -> (display name, config dict, preset name or None, size fields left to defaults), or
    None with a message."""
    source = state.widget(PAGE, f["source"], st.sidebar, format_func=SOURCES.get)
    shown.add("source")
    if source == "preset":
        name = state.widget(PAGE, f["model"], st.sidebar)
        shown.add("model")
        return (*load_config(name), name, [])
    if source == "upload":
        up = st.sidebar.file_uploader("config.json", type=["json"], key=f"{PAGE}:upload",
                                      help=f"A Hugging Face config.json, at most {MAX_CONFIG_BYTES // 1024} KiB. "
                                           "An uploaded file cannot be put in a link.")
        if up is None:
            st.info("Upload a config.json in the sidebar, or pick a preset.")
            return None
        if up.size > MAX_CONFIG_BYTES:
            st.error(f"{up.name} is {up.size:,} bytes; a config.json is at most {MAX_CONFIG_BYTES:,} bytes.")
            return None
        try:
            text = up.getvalue().decode("utf-8")
        except UnicodeDecodeError:
            st.error(f"{up.name} is not UTF-8 text; a config.json is JSON text.")
            return None
        return _parsed(text, up.name.removesuffix(".json"))
    if source == "paste":
        text = st.sidebar.text_area("config.json text", key=f"{PAGE}:paste", max_chars=MAX_CONFIG_BYTES, height=150,
                                    help="Paste the JSON of a config.json. Pasted text cannot be put in a link.")
        if not text.strip():
            st.info("Paste a config.json in the sidebar, or pick a preset.")
            return None
        return _parsed(text, "pasted config")
    model_id = state.widget(PAGE, f["hf"], st.sidebar).strip()
    revision = state.widget(PAGE, f["rev"], st.sidebar)
    shown.update(("hf", "rev"))
    if not model_id:
        st.info("Type a Hugging Face model id in the sidebar (e.g. Qwen/Qwen2.5-0.5B).")
        return None
    try:
        model_id, revision = validate_model_id(model_id), validate_revision(revision)
        name = model_id if revision == "main" else f"{model_id}@{revision}"
        return name, _hub_config(model_id, revision), None, []
    except (OfflineError, ValueError) as e:  # both messages say what to do instead
        st.error(str(e))
    return None


def _parsed(text: str, name: str):
    """A user's config.json text: parsed, and refused when it leaves the model's sizes to defaults (unless the
    'Accept defaults' box is ticked: then the defaults are listed under the verdict)."""
    allow = st.sidebar.checkbox("Accept defaults for missing sizes", key=f"{PAGE}:allow_defaults",
                                help="A config.json without layers, heads, widths or vocabulary is refused; tick "
                                     "this to use transformers' defaults for them (listed with the result).")
    try:
        config = parse_config_text(text)
        return name, config, None, check_sizes(config, allow)
    except ValueError as e:
        st.error(f"{e}. Fix the file and try again.")
        return None


# ---------------------------------------------------------------- results

def verdict(est, gpu) -> None:
    cap = capacity_bytes(gpu)
    spare = cap - est.device_bytes
    where = f"peak in the **{est.peak_stage}** stage" + (
        (f" of {est.pipeline_stage}" if est.pipeline_stage.startswith("cp ") else
         f" of the {est.pipeline_stage} pipeline stage") if est.pipeline_stage != "only" else "")
    each = "each" if est.parallel.gpus > 1 else "one"
    v = est.verdict(cap)
    if v == "fits":
        st.success(f"**Fits** on {each} {gpu.display_name}: {ui.both_units(est.device_bytes)} per GPU, "
                   f"**{ui.both_units(spare)} to spare** ({where}).", icon=":material/check_circle:")
    elif v == "tight":
        st.warning(f"**Tight** on {each} {gpu.display_name}: {ui.both_units(est.device_bytes)} per GPU with the "
                   f"allocator's estimated cache, **over by {ui.both_units(-spare)}** ({where}); without that cache it "
                   f"fits. PyTorch frees its cached blocks and retries before it runs out of memory, so fragmentation "
                   "decides: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` makes it likelier to run. On an H100 "
                   "every measured case called tight ran (docs/accuracy.md, \"Measured tier\").",
                   icon=":material/warning:")
    else:
        st.error(f"**Out of memory** on {each} {gpu.display_name}: needs {ui.both_units(est.device_bytes)} per GPU, "
                 f"**OOM by {ui.both_units(-spare)}** ({where}).", icon=":material/error:")
    c1, c2, c3, c4, c5 = st.columns(5)
    c1.metric("torch peak allocated", fmt_bytes(est.allocated_bytes, "GiB"), help=f"{fmt_bytes(est.allocated_bytes, 'GB')}; "
              "what torch.cuda.max_memory_allocated() would report: the tensors.")
    c2.metric("torch peak reserved", fmt_bytes(est.reserved_bytes, "GiB"), help=f"{fmt_bytes(est.reserved_bytes, 'GB')}; "
              f"torch.cuda.max_memory_reserved(): allocated + the allocator's cache. {est.reserved_source}.")
    c3.metric("Peak per GPU", fmt_bytes(est.device_bytes, "GiB"), help=f"{fmt_bytes(est.device_bytes, 'GB')}; what "
              "nvidia-smi shows: reserved + CUDA context + NCCL buffers. The verdict's number.")
    c4.metric("GPU usable", fmt_bytes(cap, "GiB"),
              help=f"{fmt_bytes(cap, 'GB')}; {capacity_source(gpu)}. nvidia-smi memory.total {gpu.memory_reported}; "
                   f"sold as {gpu.marketing_memory}.")
    c5.metric("Headroom" if spare >= 0 else "Over by", fmt_bytes(abs(spare), "GiB"),
              help=fmt_bytes(abs(spare), "GB"))


def breakdown_section(est, gpu) -> None:
    usable = capacity_bytes(gpu)
    cap = f"{gpu.display_name}: {fmt_bytes(usable, 'GiB')} usable"
    st.subheader("Memory at the peak")
    left, right = st.columns([1, 2])
    charts.show(charts.peak_chart(est.components, f"peak ({est.peak_stage})", usable, cap), left)
    parts = est.components.as_dict()
    right.dataframe(pd.DataFrame({"GiB": [parts[c] / GiB for c in COMPONENTS], "GB": [parts[c] / GB for c in COMPONENTS],
                                  "share": [parts[c] / est.total_bytes for c in COMPONENTS]}, index=list(COMPONENTS)),
                    column_config={"GiB": st.column_config.NumberColumn(format="%.2f"),
                                   "GB": st.column_config.NumberColumn(format="%.2f"),
                                   "share": st.column_config.NumberColumn(format="percent")})
    st.subheader("Stage by stage")
    st.caption("The step as a waterfall: what is on the GPU at the peak of each stage. allocator_cache is what "
               "torch reserves beyond the tensors (reserved - allocated), overhead the CUDA context, cuBLAS "
               "workspaces (one per thread that runs matmuls: two in training, none before the first step) and "
               "NCCL buffers.")
    charts.show(charts.stages_chart(est.stages, usable, cap))
    table = pd.DataFrame([{**{c: bd.as_dict()[c] / GiB for c in COMPONENTS},
                           "allocated": sb.allocated_bytes / GiB, "reserved": sb.reserved_bytes / GiB,
                           "device": sb.device_bytes / GiB}
                          for (_, bd), sb in zip(est.stages, est.stage_bytes())], index=[n for n, _ in est.stages])
    table = table.loc[:, (table != 0).any(axis=0)]
    st.dataframe(table.style.format("{:,.2f}"), column_config={"_index": "stage (GiB)"})


def limits_section(model, w, par, gpu, options) -> None:
    st.subheader(f"Limits on the {gpu.display_name}")
    b = search.max_batch(model, w, par, capacity_bytes(gpu), options)
    if is_vision(model):  # its tokens follow the image size: no sequence length to search
        st.metric("Largest micro-batch that fits", f"{b:,}", help=f"At {w.image_size} x {w.image_size} pixels "
                  f"({w.seq:,} tokens per image); 0 = not even batch 1.")
        return
    s = search.max_seq(model, w, par, capacity_bytes(gpu), options)
    c1, c2 = st.columns(2)
    c1.metric("Largest micro-batch that fits", f"{b:,}", help=f"At sequence length {w.seq:,}; 0 = not even batch 1.")
    c2.metric("Longest sequence that fits", f"{s:,} tokens", help=f"At micro-batch {w.batch}; 0 = not even 1 token.")
    if s > model.max_positions:
        st.caption(f"The model itself is configured for {model.max_positions:,} positions "
                   "(max_position_embeddings); memory is not the limit beyond that.")


def advice_section(model, w, par, gpu, options) -> None:
    st.subheader("What to change")
    items = search.advice(model, w, par, capacity_bytes(gpu), options)
    if not items:
        st.caption("None of the usual levers lowers the peak for this configuration.")
        return
    priced = [a for a in items if a.priced]
    st.dataframe(pd.DataFrame([{"change": a.title, "saves (GiB)": a.saving_bytes / GiB,
                                "new peak (GiB)": a.new_total_bytes / GiB, "fits": a.fits, "trade-off": a.note}
                               for a in priced]),
                 hide_index=True, column_config={
                     "saves (GiB)": st.column_config.NumberColumn(format="%.2f"),
                     "new peak (GiB)": st.column_config.NumberColumn(format="%.2f")})
    unpriced = [a for a in items if not a.priced]
    if not unpriced:
        return
    pricing, failed = derive.advice_in_background(PAGE, model, search.unpriced(w, par, unpriced))
    waiting = [a.title for a in unpriced if a.title not in failed]
    if waiting:
        st.caption("Not priced yet (each needs its own memory profile, " + (
            "derived in the background now; the table fills in when it is done" if pricing else
            "derived on first use: set it in the sidebar to see its number") + "): " + "; ".join(waiting) + ".")
    for title, why in failed.items():
        st.caption(f"Cannot be priced: {title}: {why}")


def closest_published(config, preset, w, par) -> None:
    """One line beside the verdict: the published GPU measurement nearest this workload, and the estimate for
    that run's own settings (bench/published/importer.py)."""

    if not reads.db_path().is_file():
        return
    df = reads.closest_runs(config, preset, w, par, sources=("published",))
    if df.empty:
        st.caption("Closest published run: none for this model (the published tier holds numbers from torchtune, "
                   "litgpt, PEFT, GaLore and unsloth; Benchmarks page).")
        return
    r = df.iloc[0].to_dict()
    est = estimate_row(r)
    col = COMPARED_WITH.get(r["metric"])
    ours = est.get(col) if est and col else None
    value = int(r["published_value_bytes"])
    where = f"[{r['source_repo'].removeprefix('github.com/')}]({r['source_url']})"
    text = (f"Closest published run: {r['published_id']}, {where}, {r['gpu_name']}: {r['mode']} {r['method']} "
            f"batch {int(r['batch'])}, seq {int(r['seq']):,}, {r['strategy']} x{int(r['world_size'])} "
            f"({_settings_compared(r)}) measured **{value / GiB:.2f} GiB** "
            f"({value / GB:.2f} GB, {r['metric']}; reliability **{r['reliability']}**)")
    if ours:
        text += f"; willitfit for that run: {ours / GiB:.2f} GiB ({(ours - value) / value:+.1%})"
    st.caption(text + ".")


def _settings_compared(r: dict) -> str:
    """'1 setting differs from yours, 2 more unknown (... the source does not state optimizer, recipe)'."""
    n, inferred = int(r["n_differences"]), int(r["n_inferred_same"])
    text = f"{n} setting{'s differ' if n != 1 else ' differs'} from yours"
    if inferred:
        text += (f", {inferred} more unknown (same as yours only as willitfit inferred them; the source does "
                 f"not state {r['inferred_same']})")
    return text


def closest_section(model, config, preset, w, par, options) -> None:
    st.subheader("Closest runs in the database")
    if reads.empty_db_notice():
        return
    df = reads.closest_runs(config, preset, w, par)
    if df.empty:
        st.info("No measured or traced run of this model in the database yet. Trace one with "
                "`python -m bench trace`, or measure one (Contribute page).")
        return
    df = app_data.with_estimates(df, model, options)
    show = pd.DataFrame({
        "source": df["source"], "GPU": df["gpu_name"], "batch": df["batch"], "seq": df["seq"],
        "strategy": df["strategy"], "GPUs": df["world_size"], "differs in": df["n_differences"],
        "stored peak alloc (GiB)": df["peak_alloc_bytes"] / GiB,
        "estimate for that run (GiB)": df["est_allocated_bytes"].astype("Float64") / GiB,
        "error vs estimate": df["rel_error"], "OOM": df["oom"], "run_id": df["run_id"]})
    st.caption("Nearest first: fewest differing settings, then fewest doublings of batch, seq and GPU count. "
               "Each run is set beside the estimate for its own settings (allocated bytes, as torch counts them).")
    st.dataframe(show, hide_index=True, column_config={
        "stored peak alloc (GiB)": st.column_config.NumberColumn(format="%.3f"),
        "estimate for that run (GiB)": st.column_config.NumberColumn(format="%.3f"),
        "error vs estimate": st.column_config.NumberColumn(format="percent")})


def calibrated_options(model, w, f, shown) -> Options:
    """Options with the calibrated k when the toggle is on and a fit exists for this family."""
    try:
        entry = entry_for(model.family, w.attention, w.checkpointing)
    except ValueError as e:
        st.sidebar.toggle(f["calibrated"].label, value=False, disabled=True, key=f"{PAGE}:calibrated_off",
                          help=f"{e}")
        return Options()
    on = state.widget(PAGE, f["calibrated"], st.sidebar)
    shown.add("calibrated")
    if on:
        st.caption(f"Activations use calibrated k = {entry.k:.2f} for the {model.family} family "
                   f"(95% CI {entry.k_ci_low:.2f}..{entry.k_ci_high:.2f}, {entry.n_points} runs).")
        return Options(activation_k=entry.k)
    return Options()


def main() -> None:
    f = fields()
    state.init_state(PAGE, list(f.values()))
    st.title("Will it fit?")
    shown: set[str] = set()
    try:
        body(f, shown)
    finally:  # even when the inputs stop short of a result, the link reproduces them
        state.write_url(PAGE, list(f.values()), shown)


def body(f: dict[str, state.Field], shown: set[str]) -> None:
    st.sidebar.header("Model")
    chosen = choose_model(f, shown)
    st.sidebar.header("GPU")
    gpu_name = state.widget(PAGE, f["gpu"], st.sidebar, format_func=ui.gpu_label)
    strategy = state.widget(PAGE, f["strategy"], st.sidebar)
    gpus = state.widget(PAGE, f["gpus"], st.sidebar, disabled=strategy == "single")
    shown |= {"gpu", "strategy", "gpus"}
    st.sidebar.header("Workload")
    if chosen is None:
        return
    name, config, preset, defaulted = chosen
    try:
        model = ui.load_model(config, name)
    except (ValueError, KeyError, TypeError) as e:
        st.error(f"This config.json cannot be used: {e}. Change the config (or pick a preset).")
        return
    ui.prepare_lora_targets(PAGE, ui.lora_target_options(model), model.model_type)
    f["lora_targets"] = replace(f["lora_targets"], choices=tuple(ui.lora_target_options(model)))
    ui.default_images(PAGE, model)
    values, w_shown = ui.workload_inputs(PAGE, f, st.sidebar, **ui.kinds(model))
    shown |= set(w_shown)
    if values.get("method") in ("lora", "qlora") and not ui.lora_target_options(model):
        st.error(f"lora_targets: {name} has no Linear module in its layers to adapt (a conv net). Choose full "
                 "fine-tuning in the sidebar.")
        return
    w = ui.workload_from_dict(values, **ui.kinds(model))
    try:
        w = sized(model, w)  # a vision encoder: its image size -> tokens per image (seq)
    except ValueError as e:
        st.error(f"{e}. Change the image size in the sidebar.")
        return
    try:
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
    options = calibrated_options(model, w, f, shown)
    alloc = ui.alloc_conf_input(PAGE, f["alloc"], st.sidebar)
    shown.add("alloc")
    if alloc is None:
        return
    options = replace(options, alloc_conf=alloc, gpu=gpu.name)
    allow_beyond = st.sidebar.checkbox("Allow a seq beyond the model's context", key=f"{PAGE}:beyond_context",
                                       help="For a RoPE model whose context you extend (RoPE scaling); past "
                                            "learned position embeddings (GPT-2, OPT) no run is possible.")
    try:
        beyond = check_context(model, w.seq, w.gen_tokens, allow_beyond)
    except ValueError as e:
        st.error(f"{e}. Lower the sequence length (and generated tokens); in the app the flag is the sidebar's "
                 "'Allow a seq beyond the model's context'.")
        return
    if beyond:
        st.warning(f"Note: {beyond}.")
    if defaulted:  # from the inventory alone: shown while a profile derives too
        st.warning(f"Note: {defaults_note(model, defaulted)}.")
    model.inventory.trainable_params(w)  # a LoRA target the model lacks: one line, before any trace
    prov = derive.profile_or_background(PAGE, model, w, par)
    if prov is None:  # deriving in the background: the model states are shown, the page reruns when it is done
        return
    options = replace(options, **ui.NO_TRACE)
    est = estimate(model, w, par, options)
    st.caption(f"**{name}** ({model.model_type}, built as {model.inventory.built_as}): {est.params:,} parameters, "
               f"{est.trainable_params:,} trainable. {w.mode} · batch {w.batch} · "
               + (f"{w.image_size} x {w.image_size} px images ({size_words(model, w.seq)}) · " if is_vision(model) else
                  f"seq {w.seq:,} · ") + (f"{image_words(model, w)} · " if w.images else "")
               + (f"{audio_words(model, w)} · " if w.audios else "")
               + (f"{seq2seq_words(model, w)} · " if seq2seq_words(model, w) else "")
               + f"{par.strategy} on {par.gpus} GPU(s).")
    st.caption(ui.provenance_caption(prov) + (" " + " ".join(f"Note: {n}." for n in est.notes) if est.notes else ""))
    verdict(est, gpu)
    state.or_error(lambda: closest_published(config, preset, w, par), None)
    breakdown_section(est, gpu)
    limits_section(model, w, par, gpu, options)
    advice_section(model, w, par, gpu, options)
    state.or_error(lambda: closest_section(model, config, preset, w, par, options), None)


def page() -> None:
    with derive.advice_run(PAGE):
        main()


state.run_page(page)
