"""The shared inputs (model, workload, hardware, allocator settings) generated from their declarations
(estimator.spec), the model, and the
way numbers are shown in both units. Nothing here computes memory.

Not a page (the underscore; app.py routes with st.navigation, which ignores files it is not given).
"""
from __future__ import annotations
import streamlit as st
from estimator import knobs, spec
from estimator.seq2seq import seq2seq_of
from estimator.audio import audio_of
from estimator.vision import grid, images_of, is_vision, pixtral, sizable, traced_depths
from estimator.gpus import gpu_names, load_gpus
from estimator.model import Model
from estimator.presets import default_lora_targets, preset_names
from estimator.units import fmt_bytes
from estimator.reserved import alloc_mode
from estimator.model import from_hf_config
from estimator.store import where
from pages._state import Field, state_key, widget


DEFAULT_MODEL = "llama-3.1-8b"


DEFAULT_GPU = "h100-sxm-80gb"


_W = spec.Workload()


def workload_fields() -> list[Field]:
    """Every Workload input, generated from its declaration (estimator.spec.Workload: label, help, choices)."""
    return [Field(d.name, d.kind, list(d.default) if d.kind == "multi" else d.default, d.knob.choices,
                  lo=d.knob.lo, hi=d.knob.hi, label=d.knob.label, help=d.knob.help) for d in knobs.declared()]


def hardware_fields() -> list[Field]:
    names = tuple(gpu_names())
    return [
        Field("gpu", "choice", DEFAULT_GPU if DEFAULT_GPU in names else names[0], names, label="GPU",
              help="Memory is what the driver reports (nvidia-smi memory.total), e.g. 81559 MiB for an "
                   "'80 GB' H100; see data/gpus.json."),
        Field("strategy", "choice", "single", spec.STRATEGIES, label="Parallelism strategy",
              help="single GPU; ddp replicates everything; zero1/2/3 shard optimizer states / + gradients / "
                   "+ weights; fsdp = ZeRO-3; tp splits each matrix; pp splits the layers; ep the experts."),
        Field("gpus", "int", 1, lo=1, hi=spec.MAX_GPUS, label="Number of GPUs",
              help="World size. Memory is reported per GPU (the most loaded one)."),
    ]


def alloc_conf_field() -> Field:
    return Field("alloc", "text", "", label="PYTORCH_CUDA_ALLOC_CONF",
                 help="The allocator settings the run uses, e.g. expandable_segments:True. Changes the reserved "
                      "bytes through the fitted classes (docs/allocator.md); empty = torch's defaults.")


def alloc_conf_input(page: str, field: Field, container) -> str | None:
    """The alloc-conf text box; a string torch would reject shows parse_alloc_conf's one line and gives None."""

    text = widget(page, field, container).strip()
    try:
        alloc_mode(text)
    except ValueError as e:
        st.error(f"{e}. Fix PYTORCH_CUDA_ALLOC_CONF in the sidebar (or leave it empty).")
        return None
    return text


def model_field() -> Field:
    names = tuple(preset_names())
    return Field("model", "choice", DEFAULT_MODEL if DEFAULT_MODEL in names else names[0], names,
                 label="Model preset", help="A Hugging Face config.json shipped in data/models/.")


def lora_target_options(model: Model) -> list[str]:
    """Names PEFT can target in this model (its Linear modules, read from the model itself)."""
    return model.inventory.lora_target_names()


def kinds(model) -> dict:
    """What sets a model's inputs apart, as workload_inputs / workload_from_dict take it: a vision encoder
    (`vision`), a vision-language model (`vlm`: images per sample; `grid`: of a size the user picks, Qwen2-VL's and
    LLaVA-NeXT's families), an encoder-decoder model (`seq2seq`: the decoder's tokens in training)."""
    s2s = seq2seq_of(model)
    # a speech model's seq is its decoder's tokens already (its audio window is fixed): no target length to ask for
    return {"vision": is_vision(model), "vlm": images_of(model) is not None,
            "seq2seq": s2s is not None and s2s["kind"] == "text",
            "grid": sizable(model),   # its images' size is asked for
            "audio": audio_of(model) is not None,   # audio clips per sample (estimator.audio)
            "speech": s2s is not None and bool(s2s.get("any_length"))}   # its audio's seconds


def shown_workload_fields(mode: str, method: str, advanced: bool = False, vision: bool = False,
                          vlm: bool = False, seq2seq: bool = False, grid: bool = False,
                          audio: bool = False, speech: bool = False) -> list[str]:
    """Which workload inputs apply (from each field's declaration): inference has no optimizer or LoRA, training
    no generated tokens, a vision encoder an image size instead of a sequence length (`vision`), a vision-language
    model its images per sample (`vlm`). advanced=True adds the recipe knobs the sidebar folds under "More
    settings"."""
    return [d.name for d in knobs.declared()
            if knobs.applies(d, mode, method, vision, vlm, seq2seq, grid, audio, speech)
            and (advanced or not d.knob.advanced)]


def workload_from_dict(values: dict, vision: bool = False, vlm: bool = False, seq2seq: bool = False,
                       grid: bool = False, audio: bool = False, speech: bool = False) -> spec.Workload:
    """A Workload from input values; inputs that do not apply to the mode/method (and the model: `vision`) keep the
    spec defaults.

    Raises ValueError (naming the field) for a contradictory combination, which the page shows.
    """
    shown = shown_workload_fields(values.get("mode", _W.mode), values.get("method", _W.method), advanced=True,
                                  vision=vision, vlm=vlm, seq2seq=seq2seq, grid=grid, audio=audio, speech=speech)
    kwargs = {k: values[k] for k in shown if k in values}
    if "lora_targets" in kwargs:
        kwargs["lora_targets"] = tuple(kwargs["lora_targets"])
    return spec.Workload(**kwargs)


def default_images(page: str, model) -> None:
    """The first vision-language model of a session starts with one image per sample (its images are what sets it
    apart; 0 prices a text-only step), and the first audio-language model with one audio clip, unless the link or the
    user set the number. The first of Qwen2-VL's family
    (and a Pixtral-towered one) also starts under FlashAttention-2, the one attention its vision tower is priced
    under."""
    vlm = images_of(model) is not None
    packed = grid(model) is not None or pixtral(model) is not None
    if packed and not st.session_state.get(f"{page}:flash_defaulted"):
        st.session_state[f"{page}:flash_defaulted"] = True
        if "attention" not in st.query_params:
            st.session_state[state_key(page, "attention")] = "flash"
    for field, takes in (("images", vlm), ("audios", audio_of(model) is not None)):   # an audio-language model's
        flag = f"{page}:{field}_defaulted"                                            # first: one clip per sample
        if not takes or st.session_state.get(flag):
            continue
        st.session_state[flag] = True
        key = state_key(page, field)
        if not st.session_state.get(key) and field not in st.query_params:
            st.session_state[key] = 1


def images_error(e: ValueError) -> str:
    """A refused image setting (estimator.vision.check_images) with where to change it."""
    field = str(e).split(":", 1)[0]
    where = {"attention": "the attention kernel (under More settings)", "checkpointing": "the checkpointing",
             "image_size": "the image size", "audios": "the audio clips per sample"}.get(
        field, "the sequence length or the audio clips per sample" if "audio clip" in str(e) else
        "the sequence length or the images per sample")
    return f"{e}. Change {where} in the sidebar."


def prepare_lora_targets(page: str, options: list[str], model_type: str = "") -> None:
    """Keep the selected LoRA targets among the model's modules (a model change can invalidate them); with none
    left, PEFT's default for the model type (T5: q, v; GPT-2: c_attn), else the first module."""
    key = state_key(page, "lora_targets")
    chosen = [t for t in st.session_state.get(key, []) if t in options]
    if not chosen:
        chosen = [t for t in _W.lora_targets if t in options] or \
            [t for t in default_lora_targets(model_type) if t in options] or options[:1]
    if chosen != st.session_state.get(key):
        st.session_state[key] = chosen


def workload_inputs(page: str, fields: dict[str, Field], container, vision: bool = False,
                    vlm: bool = False, seq2seq: bool = False, grid: bool = False,
                    audio: bool = False, speech: bool = False) -> tuple[dict, list[str]]:
    """Draw the workload widgets that apply (a vision encoder's image size instead of a sequence length: `vision`; a
    vision-language model's images per sample: `vlm`), the advanced ones folded; returns (values, names shown)."""
    mode = widget(page, fields["mode"], container)
    method = widget(page, fields["method"], container) if mode == "train" else _W.method
    kind = {"vision": vision, "vlm": vlm, "seq2seq": seq2seq, "grid": grid, "audio": audio, "speech": speech}
    shown = shown_workload_fields(mode, method, advanced=True, **kind)
    core = set(shown_workload_fields(mode, method, **kind))
    values = {"mode": mode, "method": method}
    more = container.expander("More settings (loop, loss, recipe knobs)")
    for name in shown:
        if name not in values:
            values[name] = widget(page, fields[name], container if name in core else more)
    return values, shown


def gpu_label(name: str) -> str:
    gpu = load_gpus()[name]
    return f"{gpu.display_name} ({fmt_bytes(gpu.memory_bytes, 'GiB', 1)})"


def both_units(n_bytes: int | float) -> str:
    """'12.55 GiB (13.48 GB)': the binary unit first, the decimal one beside it."""
    return f"{fmt_bytes(n_bytes, 'GiB')} ({fmt_bytes(n_bytes, 'GB')})"


NO_TRACE = dict(derive=False)  # searches, advice and comparisons price what has a profile; they never trace


def load_model(config: dict, name: str):
    """The Model for a config (its inventory: shipped, cached, or read once from transformers on meta)."""

    if where(config) is None:
        with st.spinner(f"Reading {name}'s parameters from transformers (meta device, no weights)..."):
            return from_hf_config(config, name)
    return from_hf_config(config, name, derive=False)


def provenance_caption(prov: dict) -> str:
    """One sentence saying where the numbers come from."""
    how = {"shipped": "shipped with willitfit", "cache": "derived earlier on this machine",
           "derived now": "derived just now"}.get(prov.get("where"), "")
    depths = traced_depths(prov)
    return (f"Memory profile {how}: traced from transformers {prov.get('transformers')} (torch {prov.get('torch')}, "
            f"{prov.get('kernels')} kernels), {prov.get('traces')} traces of {depths} in {prov.get('seconds')} s, "
            "extended to the full depth." + (f" It assumes {prov['scan']}." if prov.get("scan") else ""))
