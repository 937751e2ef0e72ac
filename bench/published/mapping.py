"""Map the published GPU measurements into willitfit's vocabulary (the rules, one function per field).

    python -m bench import-published --from ../shared/published/points.csv   # map again, then import

The collected file (one row per number a framework published: torchtune, litgpt, PEFT, GaLore, unsloth) describes
each run in its source's words ("bf16 (bf16-true)", "FSDP x2 (Lightning Fabric default FSDP strategy)",
"bitsandbytes PagedAdamW8bit (config default)"). `map_row` turns one such row into a `Workload`/`Parallel` of
estimator/spec.py, a typed metric and integer bytes, and records for every workload field whether the source
states it or it is inferred (and from what): `field_origins`. A row that cannot be expressed is kept with
`mapping_status` 'unmapped' (or 'partial': expressible, with a setting that has no field) and the reason.
The rules and their sources are listed in docs/published.md. Nothing here is tuned to the values.
"""
from __future__ import annotations

import json
import re
from estimator.model import from_hf_config
from estimator.presets import load_config

GB, GiB, MiB = 10**9, 2**30, 2**20

# published model name -> preset (data/models); None: no preset, the row stays unmapped with the reason
MODELS = {
    "Llama-2-7B": "llama-2-7b", "Llama-2-13B": "llama-2-13b", "Llama-2-70B": "llama-2-70b",
    "Llama-3-8B": "llama-3-8b", "Llama-3.1-8B": "llama-3.1-8b", "Llama-3.1-70B": "llama-3.1-70b",
    "Llama-3.1-405B": "llama-3.1-405b", "Llama-3.2-1B": "llama-3.2-1b", "Llama-3.2-3B": "llama-3.2-3b",
    "CodeLlama-34B": "codellama-34b", "TinyLlama-1.1B": "tinyllama-1.1b", "Mistral-7B": "mistral-7b",
    "Falcon-7B": "falcon-7b", "Falcon-40B": "falcon-40b", "phi-1.5": "phi-1_5", "phi-2": "phi-2",
    "Phi-3-mini-4k": "phi-3-mini", "Gemma-2B": "gemma-2b", "Gemma-7B": "gemma-7b", "Gemma-2-2B": "gemma-2-2b",
    "Gemma-2-9B": "gemma-2-9b", "StableLM-base-alpha-3B": "stablelm-base-alpha-3b",
    "LLaMA-7B (GaLore llama_7b.json)": "galore-llama-7b",
}
# models willitfit does not model, with the model_type the row is stored under and why
UNMODELLED = {
    "T0_3B (T5-3B LM-adapted)": ("t5", "an encoder-decoder model (T5); willitfit models decoder and encoder LMs"),
    "mt0-xxl (mT5-XXL)": ("mt5", "an encoder-decoder model (mT5); willitfit models decoder and encoder LMs"),
    "Stable Diffusion v1-4": ("unet-2d-condition", "a diffusion UNet, not a language model"),
    "bloomz-7b1": ("bloom", "no BLOOM preset ships (ALiBi attention; add data/models/bloomz-7b1.json to map it)"),
}
GPUS = [("a100-sxm4-40gb", "a100-sxm-40gb"), ("a100 40gb", "a100-sxm-40gb"), ("a100 80gb", "a100-sxm-80gb"),
        ("a100 (80gb", "a100-sxm-80gb"), ("a10g", "a10g"), ("rtx 4090", "rtx-4090"), ("rtx a6000", "rtx-a6000"),
        ("a6000", "rtx-a6000")]


# Llama module names (how the sources describe targets) -> each architecture's Linear names in transformers
TARGET_NAMES = {
    "gpt_neox": {"q_proj": "query_key_value", "k_proj": "query_key_value", "v_proj": "query_key_value",
                 "o_proj": "dense", "gate_proj": "dense_h_to_4h", "up_proj": "dense_h_to_4h",
                 "down_proj": "dense_4h_to_h"},
    "phi": {"o_proj": "dense", "gate_proj": "fc1", "up_proj": "fc1", "down_proj": "fc2"},
    "phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"},
}
TARGET_NAMES["falcon"] = TARGET_NAMES["gpt_neox"]


def translate_targets(model_type: str, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The architecture's own Linear names for Llama-named targets (fused projections appear once)."""
    names = TARGET_NAMES.get(model_type, {})
    out: list[str] = []
    for t in targets:
        n = names.get(t, t)
        if n not in out:
            out.append(n)
    return tuple(out)


def preset_supports_sdpa(preset: str) -> bool:
    """Whether transformers runs this preset with SDPA (its inventory, read from the shipped profiles)."""
    return from_hf_config(load_config(preset)[1], preset, derive=False).inventory.supports_sdpa


def preset_model_type(preset: str) -> str:

    return str(load_config(preset)[1].get("model_type"))


class Origins:
    """field -> "stated" or "inferred: why"."""

    def __init__(self):
        self.d: dict[str, str] = {}

    def stated(self, field: str) -> None:
        self.d[field] = "stated"

    def inferred(self, field: str, why: str) -> None:
        self.d[field] = f"inferred: {why}"


def _text(raw: dict, key: str) -> str:
    v = raw.get(key)
    return "" if v is None or (isinstance(v, float) and v != v) else str(v).strip()


def _int(text: str) -> int | None:
    m = re.match(r"\s*(\d+)", text)
    return int(m.group(1)) if m else None


def metric(text: str) -> tuple[str, str]:
    """(typed metric, how): allocated | active | reserved | tracemalloc | capacity | unknown."""
    t = text.lower()
    if "capacity" in t and "not a peak" in t:
        return "capacity", "a capacity at which the setting is the largest that fits, not a peak reading"
    if "tracemalloc" in t:
        return "tracemalloc", "PEFT's TorchTracemalloc: memory at the start plus the peak delta of max_memory_allocated"
    if "active" in t and "allocated" not in t:
        return "active", "torch memory_stats active_bytes.all.peak"
    if "reserved" in t and "allocated" not in t:
        if "stated" in t or t.startswith("peak memory reserved"):
            return "reserved", "the source labels it reserved (max_memory_reserved)"
        return "reserved", "inferred: the same figure is labelled reserved elsewhere in the source"
    if "max_memory_allocated" in t or "peak allocated" in t or "peak memory allocated" in t:
        return "allocated", "torch.cuda.max_memory_allocated"
    return "unknown", "the source does not say which counter it read"


def unit_bytes(value: float, unit: str) -> tuple[int, str]:
    """Integer bytes of a published value and the conversion applied."""
    u = unit.strip()
    if u == "GB(1e9)":
        return round(value * GB), "GB = 10^9 B, as the source's code divides by 1e9"
    if u == "GiB":
        return round(value * GiB), "GiB = 2^30 B, as the source's code divides by 1024^3 at that commit"
    if u == "MiB":
        return round(value * MiB), "MiB = 2^20 B"
    if u == "GB(ambiguous)":
        return round(value * GB), "GB taken as 10^9 B; the source does not say which"
    raise ValueError(f"measured_unit: {unit!r} is not one of GB(1e9), GiB, MiB, GB(ambiguous)")


def _precision(raw: dict, o: Origins) -> dict:
    """recipe, precision, weight_format, QLoRA scope and double quantisation from weight_dtype / method."""
    wd, method = _text(raw, "weight_dtype").lower(), _text(raw, "method").lower()
    out = {"precision": "bf16"}
    o.stated("precision") if "bf16" in (wd + _text(raw, "compute_dtype").lower()) else \
        o.inferred("precision", "compute dtype not stated as bf16; bf16 is these recipes' default")
    if "bf16-mixed" in wd or "autocast" in _text(raw, "compute_dtype").lower():
        out["recipe"] = "amp"
        o.inferred("recipe", "bf16-mixed: fp32 weights under bf16 autocast (litgpt precision flag)")
    elif wd.startswith("fp32") and "bf16" not in wd:
        out.update(recipe="fp32", precision="fp32")
        o.inferred("recipe", "fp32 weights and compute")
    else:
        out["recipe"] = "pure"
        o.inferred("recipe", "bf16 weights, no fp32 master copy (torchtune default, litgpt bf16-true)")
    quant = "nf4" in wd or "nf4" in method or "qlora" in method or "4-bit" in wd
    if quant:
        out["double_quant"] = "-dq" in wd or "nf4-dq" in method
        o.stated("double_quant") if ("nf4" in wd or "nf4" in method) else \
            o.inferred("double_quant", "not stated")
        if "lora-wrapped linears only" in wd or "torchao" in (wd + method):
            out["quantize_scope"] = "adapted"
            o.stated("quantize_scope")
        else:
            out["quantize_scope"] = "all"
            o.inferred("quantize_scope", "bitsandbytes quantizes every transformer-block Linear (litgpt, PEFT)")
    return out


def _method(raw: dict, o: Origins, quant: bool) -> tuple[dict, str | None]:
    """(method fields, reason it cannot be expressed)."""
    m = _text(raw, "method").lower()
    mode = _text(raw, "mode").lower()
    if "init" in m or mode.startswith("model load"):
        return {}, "a model-load figure, not a training or inference step"
    if "adapter" in m:
        return {}, "LLaMA-Adapter fine-tuning has no field (willitfit models full, LoRA and QLoRA)"
    if "galore" in m:
        return {}, "GaLore's low-rank gradient projection has no field"
    if "init" in m or mode.startswith("model load"):
        return {}, "a model-load figure, not a training or inference step"
    if mode.startswith("inference") or m.startswith("generate") or "parallel" in m:
        out = {"mode": "infer", "method": "full"}
        o.stated("mode")
        if quant:
            out["weight_format"] = "nf4"
            o.stated("weight_format")
        return out, None
    out = {"mode": "train"}
    o.stated("mode")
    if "lora" in m:
        out["method"] = "qlora" if quant else "lora"
        o.stated("method")
        cfg = _text(raw, "lora_config").lower()
        r = re.search(r"r=(\d+)", cfg)
        if r:
            out["lora_rank"] = int(r.group(1))
            o.stated("lora_rank")
        else:
            out["lora_rank"] = 8
            o.inferred("lora_rank", "not stated; 8 is the default of PEFT, litgpt and torchtune")
        out["lora_targets"] = _targets(cfg, o)
    elif m.startswith("full"):
        out["method"] = "full"
        o.stated("method")
    else:
        return out, f"method {raw.get('method')!r} has no field"
    return out, None


def _targets(cfg: str, o: Origins) -> tuple[str, ...]:
    """LoRA target module names (transformers' Llama names) from the published description, e.g.
    "r=8, alpha=16; q,k,v,output_proj + MLP + final output proj" or litgpt's "q,k,v,proj,mlp,head (all)"."""
    c = cfg.replace(" ", "")
    if "query_key_value" in c:
        o.stated("lora_targets")
        return ("query_key_value",)
    if "query,value" in c:
        o.stated("lora_targets")
        return ("q_proj", "v_proj")
    part = cfg.split(";")[-1]
    toks = set(re.findall(r"[a-z_]+", part))
    if "final output proj" in part:
        toks.add("finaloutputproj")
    out = []
    for tok, names in (("q", ("q_proj",)), ("k", ("k_proj",)), ("v", ("v_proj",)), ("o", ("o_proj",)),
                       ("proj", ("o_proj",)), ("output_proj", ("o_proj",)), ("mlp", ("gate_proj", "up_proj",
                                                                                     "down_proj")),
                       ("gate", ("gate_proj",)), ("up", ("up_proj",)), ("down", ("down_proj",)),
                       ("head", ("lm_head",)), ("finaloutputproj", ("lm_head",))):
        if tok in toks:
            out += [n for n in names if n not in out]
    if out:
        o.stated("lora_targets")
        return tuple(out)
    o.inferred("lora_targets", "not stated; q and v are PEFT's and litgpt's defaults")
    return ("q_proj", "v_proj")


def _optimizer(raw: dict, o: Origins, method: str | None) -> dict:
    t = _text(raw, "optimizer").lower()
    if "paged" in t and ("when quantized" not in t or method == "qlora"):
        out = {"optimizer": "paged-adamw-8bit" if "8bit" in t else "paged-adamw"}
    elif "adamw_8bit" in t or "8-bit adamw" in t:
        out = {"optimizer": "adamw-8bit"}
    elif "sgd" in t:
        out = {"optimizer": "sgd"}
    else:
        out = {"optimizer": "adamw"}
        if not t or "unspecified" in t or "unstated" in t:
            o.inferred("optimizer", "not stated; AdamW is every recipe's default")
            return out
    o.stated("optimizer") if "likely" not in t else o.inferred("optimizer", "the source guesses it")
    if "fused" in t:
        out["optimizer_impl"] = "fused"
        o.stated("optimizer_impl")
    return out


def _parallel(raw: dict, o: Origins) -> tuple[dict, str | None]:
    t = _text(raw, "parallelism").lower()
    n = _int(_text(raw, "num_gpus")) or 1
    m = re.search(r"x\s*(\d+)", t) or re.search(r"devices=(\d+)", t)
    if m:
        n = int(m.group(1)) if "devices=" not in t else int(re.search(r"devices=(\d+)", t).group(1))
    if "zero-3" in t or "zero3" in t:
        o.stated("strategy")
        return {"strategy": "zero3", "gpus": n, "offload": "optimizer+params"}, None
    if "fsdp" in t:
        o.stated("strategy")
        if "cpu offload" in t:
            return {"strategy": "fsdp", "gpus": n, "offload": "optimizer+params"}, None
        return {"strategy": "fsdp", "gpus": n}, None
    if "pp" in t:
        o.stated("strategy")
        return {"strategy": "pp", "gpus": n}, \
            "litgpt's sequential layer split runs one stage at a time, not a pipeline schedule" if n > 1 else None
    if "tp" in t:
        o.stated("strategy")
        return {"strategy": "tp", "gpus": n}, None
    o.stated("strategy")
    return {"strategy": "single", "gpus": 1}, None


def _sizes(raw: dict, o: Origins, mode: str) -> tuple[dict, str | None]:
    b = _int(_text(raw, "micro_batch_size"))
    out = {"batch": b or 1}
    o.stated("batch") if b and "assumed" not in _text(raw, "micro_batch_size") else \
        o.inferred("batch", "the script's default of 1")
    note = _text(raw, "seq_len_note").lower()
    seq = _int(_text(raw, "seq_len"))
    if mode == "infer":
        gen = re.search(r"max_new_tokens=(\d+)", note)
        out["gen_tokens"] = int(gen.group(1)) if gen else 50
        o.stated("gen_tokens") if gen else o.inferred("gen_tokens", "litgpt generate's default of 50")
        out["seq"] = seq or 8
        o.stated("seq") if seq else o.inferred("seq", "a short default prompt: about 8 tokens")
        return out, None
    if not seq:
        return out, "the sequence length is not stated"
    out["seq"] = seq
    if any(k in note for k in ("padded", "longest", "variable", "truncat")):
        o.inferred("seq", "variable-length data: the longest batch sets the peak; this is its stated length")
    else:
        o.stated("seq")
    ga = _int(_text(raw, "grad_accum"))
    if ga:
        out["grad_accum"] = ga
        o.stated("grad_accum")
    return out, None


def _knobs(raw: dict, o: Origins) -> tuple[dict, list[str]]:
    t = _text(raw, "other_memory_opts").lower()
    ck = _text(raw, "activation_checkpointing").lower()
    out: dict = {}
    if ck.startswith("yes") or "presumably yes" in ck or "gradient checkpointing" in ck:
        out["checkpointing"] = "full"
        o.stated("checkpointing") if ck.startswith("yes") else o.inferred("checkpointing", ck)
    elif ck.startswith("no"):
        out["checkpointing"] = "none"
        o.stated("checkpointing")
    else:
        out["checkpointing"] = "none"
        o.inferred("checkpointing", "not stated; off is the default")
    att = _text(raw, "attention_impl").lower()
    out["attention"] = "eager" if "eager" in att else ("flash" if "flashattention" in att else "sdpa")
    o.stated("attention") if att and "unspecified" not in att else o.inferred("attention", "SDPA: the default")
    extra = []
    if "chunked ce" in t:
        out.update(loss="chunked", loss_chunks=8)
        o.stated("loss")
        o.inferred("loss_chunks", "torchtune CEWithChunkedOutputLoss num_output_chunks=8")
    if "opt_in_bwd" in t or "optimizer_in_bwd" in t or "optimizer step in backward" in t:
        out["optimizer_in_backward"] = True
        o.stated("optimizer_in_backward")
    if "act offload" in t or "activation offloading" in t:
        out["activation_offload"] = True
        o.stated("activation_offload")
    if "compile" in t:
        out["compile"] = True
        o.stated("compile")
    if "packed" in t:
        extra.append("packed sequences (no field: the run is taken as unpacked rows of the stated length)")
    if "fsdp cpu offload" in t:
        extra.append("FSDP CPU offload with a fused optimizer")
    return out, extra


def gpu_preset(text: str) -> str | None:
    t = text.lower()
    if "estimated on" in t:
        return None
    for key, name in GPUS:
        if key in t:
            return name
    return None


def map_row(raw: dict) -> dict:
    """One collected row -> the project's published row (workload fields, metric, bytes, status, origins)."""
    o = Origins()
    pid = _text(raw, "id")
    if not re.fullmatch(r"P\d{3}", pid):
        raise ValueError(f"id: {pid!r} is not a published id like P001")
    value = raw.get("measured_value")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"measured_value: {value!r} of {pid} is not a number") from None
    if not value > 0:
        raise ValueError(f"measured_value: {value!r} of {pid} must be positive")
    nbytes, conversion = unit_bytes(value, _text(raw, "measured_unit"))
    kind, how = metric(_text(raw, "metric"))
    model = _text(raw, "model")
    source = _text(raw, "source")
    row = {"published_id": pid, "source_repo": source, "source_section": _text(raw, "source_section"),
           "source_version": _text(raw, "source_version"), "source_url": "https://" + source,
           "model_published": model, "params_b_published": raw.get("params_B"),
           "gpu_published": _text(raw, "gpu"), "gpu": gpu_preset(_text(raw, "gpu")),
           "metric": kind, "metric_how": how, "measured_value": value, "measured_unit": _text(raw, "measured_unit"),
           "measured_bytes": nbytes, "conversion": conversion, "per_gpu": _text(raw, "per_gpu").startswith("yes"),
           "reliability": _text(raw, "reliability")}
    reasons, partial = [], []
    if model in MODELS:
        row["preset"] = MODELS[model]
    else:
        mt, why = UNMODELLED.get(model, ("unknown", f"model {model!r} has no preset"))
        row.update(preset=None, model_type=mt)
        reasons.append(why)
    prec = _precision(raw, o)
    quant = "quantize_scope" in prec
    fields, why = _method(raw, o, quant)
    if why:
        reasons.append(why)
    fields.update(prec)
    if fields.get("mode") == "infer":
        for k in ("quantize_scope", "double_quant", "recipe"):
            fields.pop(k, None)
            o.d.pop(k, None)
        fields["recipe"] = "pure"
        wd = _text(raw, "weight_dtype").lower()
        if "int8" in wd:
            fields["weight_format"] = "int8"
        elif "fp4" in wd:
            reasons.append("bitsandbytes FP4 weights have no weight format (NF4 and int8 do)")
        elif "fp32" in wd and "bf16-mixed" in wd:
            fields["weight_format"] = "fp32"
            partial.append("bf16-mixed generation: fp32 weights, bf16 compute")
        elif wd.startswith("fp32"):
            fields.update(precision="fp32", weight_format="fp32")
    else:
        fields.update(_optimizer(raw, o, fields.get("method")))
    par, why = _parallel(raw, o)
    if why:
        partial.append(why)
    fields.update(par)
    sizes, why = _sizes(raw, o, fields.get("mode", "train"))
    if why:
        reasons.append(why)
    fields.update(sizes)
    knobs, extra = _knobs(raw, o)
    fields.update(knobs)
    partial += extra
    if kind == "capacity":
        reasons.append("the value is a capacity, not a peak reading")
    if row.get("preset") is None and not reasons:
        reasons.append("no preset")
    status = "unmapped" if reasons else ("partial" if partial else "mapped")
    if row.get("preset") and fields.get("attention") == "sdpa" and not preset_supports_sdpa(row["preset"]):
        mt = preset_model_type(row["preset"])
        fields["attention"] = "eager"
        o.inferred("attention", f"transformers runs {mt} with eager attention only (it refuses SDPA)")
        partial.append(f"{mt} priced with transformers' eager attention; the source ran its own SDPA")
        status = "partial" if status == "mapped" else status
    if row.get("preset") and fields.get("lora_targets"):
        fields["lora_targets"] = translate_targets(preset_model_type(row["preset"]), fields["lora_targets"])
    row.update(fields)
    row.update(mapping_status=status, mapping_reason="; ".join(reasons + partial),
               field_origins=json.dumps(o.d, sort_keys=True), note=_note(raw, row))
    return row


def _note(raw: dict, row: dict) -> str:
    """A short note in this project's words: what makes the comparison uncertain."""
    bits = []
    if row.get("metric") == "unknown":
        bits.append("counter not stated")
    if row.get("metric") == "tracemalloc":
        bits.append("PEFT's tracemalloc figure: comparable with allocated bytes at the peak")
    if row.get("optimizer", "").startswith("paged"):
        bits.append("paged optimizer states live in CUDA unified memory, outside the torch allocator")
    note = _text(raw, "seq_len_note").lower()
    if any(k in note for k in ("padded", "longest", "variable")):
        bits.append("variable-length batches: the peak comes from the longest one")
    if row.get("measured_unit") == "GB(ambiguous)":
        bits.append("unit not stated; read as 10^9 bytes")
    if row.get("reliability") in ("suspect", "derived", "low"):
        bits.append(f"reliability {row['reliability']}")
    return "; ".join(bits)
