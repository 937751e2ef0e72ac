"""Read a model's inventory from the model itself: built on PyTorch's meta device from its config (torch).

    inv = read_inventory(config)     # -> dict, the JSON form of estimator.inventory.Inventory

transformers builds the model from the config class (`AutoConfig.for_model`) and the Auto class for causal or
masked LMs; a multimodal config's `text_config` is built as its text model. Nothing is downloaded and no remote
code runs: `auto_map` is ignored when transformers has the architecture natively, and refused when it does not. Every parameter is read: its shape, which decoder layer owns it,
and its role:
- `embedding`: weights of nn.Embedding modules (token, position, token type);
- `head`: the output embedding (lm_head) when it is not the input embedding itself (tied weights count once);
- `linear` / `bias`: weight and bias of nn.Linear and transformers' Conv1D (what LoRA adapts and bitsandbytes
  quantizes); `router`: a Linear-like weight of a mixture-of-experts router (its class name says Router or
  Gate, or it maps the hidden size to the expert count);
- `expert`: routed experts (transformers 5's fused (n_experts, ...) parameters, or inside an `experts` module);
- `norm`: every other 1-D parameter (norm weights and biases); `other`: anything else.
"""
from __future__ import annotations

import functools
import math
from collections import Counter

import torch

from estimator.families import AUDIO_ROUTE, vlm_route
from tracer import serialized
import tracer  # noqa: F401  (quiets torchao's import-time logging before transformers loads it)
from tracer import audio, config_check, seq2seq, vision, vlm
from tracer.depth import layer_infos, layer_stacks, text_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_vision_model(model) -> bool:
    """Built as a vision encoder (tracer.vision: pixel values in, one forward pass, no KV cache)."""
    return bool(getattr(model, "_willitfit_vision", False) or getattr(getattr(model, "base_model", None),
                                                                     "_willitfit_vision", False))


def is_masked_lm(model) -> bool:
    """Built as a masked LM (an encoder: one forward pass, no KV cache, no generation)."""
    return bool(getattr(model, "_willitfit_masked_lm", False) or getattr(getattr(model, "base_model", None),
                                                                        "_willitfit_masked_lm", False))

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk", "top_k")


def hf_config(config: dict):
    """transformers' config object for a config.json dict (tracer.config_check.build); refusals in one line naming
    why."""
    cfg = config_check.build(config)
    seq2seq.start_token_stated(cfg)
    _every_layer_runs(cfg)
    return cfg


def _every_layer_runs(cfg) -> None:
    """LayerDrop (fairseq's; M2M-100's and NLLB-MoE's configs default to 0.05) skips each layer of a training step
    with that probability, drawn on the host (`torch.rand([]) < layerdrop`, which a fake tensor cannot answer): the
    step is priced with every layer run, the most a step holds. Set on transformers' config object, never on the
    config.json (whose hash keys the profiles)."""
    # the config and each config nested in it (text_config, encoder_config: Canary's Parakeet encoder, ...)
    for c in (cfg, *(v for v in vars(cfg).values() if hasattr(v, "to_dict") and hasattr(v, "__dict__"))):
        for key, value in list(vars(c).items()) if c is not None and hasattr(c, "__dict__") else ():
            if key.endswith("layerdrop") and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
                setattr(c, key, 0.0)


def model_class(cfg, mode: str = "train"):
    """The Auto class transformers uses for this config: a vision encoder's image-classification model (training)
    or base vision model (inference, `mode` "infer"; tracer.vision), else causal LM, else masked LM; the text model of
    a multimodal config (its `text_config`) when the top-level type has none of these."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMaskedLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    mt = cfg.model_type
    if vision.is_vision(cfg):
        return vision.vision_class(cfg, mode)
    if seq2seq.is_encoder_decoder(cfg):   # the whole encoder-decoder model (tracer.seq2seq)
        return seq2seq.model_class(cfg), cfg
    if vlm.is_vlm(cfg):   # the whole image-text-to-text model: a step with images runs its vision tower (tracer.vlm)
        return AutoModelForImageTextToText, cfg
    if audio.is_audio(cfg):   # the whole audio-language model: a step with audio runs its audio encoder (tracer.audio)
        return audio.audio_class(mt), cfg
    if mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(cfg, "is_decoder", False):
        return AutoModelForMaskedLM, cfg  # encoders (BERT, RoBERTa...) are also listed as causal LMs with is_decoder
    if mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM, cfg
    text = getattr(cfg, "text_config", None)
    if text is not None and text.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM, text
    if causal_image_text(mt):
        return AutoModelForImageTextToText, cfg
    vision.refuse_unmodelled_vision(mt)
    raise ValueError(f"model_type: {mt!r} has no causal-LM or masked-LM model in transformers (and no text "
                     "model that has one)")


def causal_image_text(model_type: str) -> bool:
    """A type transformers lists as image-text-to-text only whose class there is a causal LM of text alone (Mistral-4's
    `Mistral4ForCausalLM`): built and priced as that causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type, "").endswith("ForCausalLM")


def _roles(model, n_experts: int) -> dict[int, str]:
    """id(parameter) -> role (see the module docstring)."""

    roles: dict[int, str] = {}
    out = model.get_output_embeddings()
    for name, module in model.named_modules():
        cls = type(module).__name__
        own = list(module.named_parameters(recurse=False))
        in_experts = ".experts." in f".{name}." and "shared" not in name
        for pname, p in own:
            if id(p) in roles:
                continue
            if isinstance(module, torch.nn.Embedding):
                roles[id(p)] = "embedding"
            elif out is not None and module is out:
                roles[id(p)] = "head" if pname == "weight" else "bias"
            elif in_experts or (p.ndim >= 3 and n_experts and p.shape[0] == n_experts):
                roles[id(p)] = "expert"  # fused experts: (E, ...) in transformers 5
            elif p.ndim == 2 and ("Router" in cls or cls.endswith("Gate") or (n_experts and p.shape[0] == n_experts
                                                                              and "gate" in name.split(".")[-1])):
                roles[id(p)] = "router"
            elif p.ndim == 2 and (isinstance(module, torch.nn.Linear) or cls == "Conv1D"):
                roles[id(p)] = "linear"
            elif p.ndim == 1 and (isinstance(module, torch.nn.Linear) or cls == "Conv1D") and pname == "bias":
                roles[id(p)] = "bias"
            elif p.ndim == 1:
                roles[id(p)] = "norm"
            else:
                roles[id(p)] = "other"
    return roles


def _first_int(cfg, keys, across_layers=max) -> int:
    """The first positive int among `keys`. On a heterogeneous config (transformers' per_layer_config: Gemma-4's
    head_dim, DOTS-3's heads differ by layer) a per-layer key is read from every layer and combined with
    `across_layers` (max for sizes; math.gcd for head counts, which a TP degree must divide in every layer)."""
    for k in keys:
        try:
            v = getattr(cfg, k, None)
        except RuntimeError as e:  # AmbiguousGlobalPerLayerAttributeError: a per-layer attribute read globally
            if type(e).__name__ != "AmbiguousGlobalPerLayerAttributeError":
                raise
            per_layer = getattr(cfg, "per_layer_config", None) or []
            vals = [getattr(c, k, None) for c in per_layer]
            vals = [x for x in vals if isinstance(x, int) and not isinstance(x, bool) and x > 0]
            v = functools.reduce(across_layers, vals) if vals else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _learned_positions(model, tcfg) -> bool:
    """Absolute position embeddings (GPT-2 wpe, OPT embed_positions with its offset of 2, BERT): an nn.Embedding
    besides the token embedding with one row per position, so no run can go past max_position_embeddings."""

    max_pos = _first_int(tcfg, ("max_position_embeddings", "n_positions"))
    return bool(max_pos) and any(isinstance(m, torch.nn.Embedding) and m is not model.get_input_embeddings()
                                 and max_pos <= m.num_embeddings <= max_pos + 2 for m in model.modules())


def _runs(layer_linears: dict[int, list]) -> list:
    """Consecutive identical layers' Linear lists as [[[name, fan_in, fan_out], ...], layer count] runs."""
    runs: list = []
    for layer in sorted(layer_linears):
        if runs and runs[-1][0] == layer_linears[layer]:
            runs[-1][1] += 1
        else:
            runs.append([layer_linears[layer], 1])
    return runs


@serialized
def read_inventory(config: dict) -> dict:
    """The inventory of the model this config builds, as a JSON-ready dict (see estimator.inventory)."""


    cfg = hf_config(config)
    cls, build_cfg = model_class(cfg)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = cls.from_config(build_cfg)
    except (ValueError, TypeError, NotImplementedError, RuntimeError, AttributeError, KeyError, IndexError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"model_type: transformers cannot build {cfg.model_type!r} on the meta device ({first})") \
            from None
    finally:
        torch.set_default_dtype(old)
    audio_refused = None
    if audio.is_audio(cfg):
        try:
            audio.audio_token_id(model.config)   # its forward finds the clips' places by it
            model._willitfit_audio_tokens = audio.audio_tokens(model)
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:   # its own audio path fails
            audio_refused = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    images_refused = None
    if vlm.is_vlm(cfg):
        try:
            model._willitfit_image_tokens = vlm.image_tokens(model)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:  # its own image path fails on this config
            images_refused = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    tcfg = text_config(model.config)
    n_experts = _first_int(tcfg, EXPERT_COUNT_KEYS)
    roles = _roles(model, n_experts)
    try:
        stacks = layer_stacks(model)
        layers = [layer for _, _, stack in stacks for layer in stack]
        path = " + ".join(f"{type(parent).__name__}.{attr}" for parent, attr, _ in stacks)
    except ValueError:  # no stack of GradientCheckpointingLayer modules (ALBERT shares one layer): no per-layer view
        stacks, layers, path = [], [], f"{type(model).__name__}."
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    groups: Counter = Counter()
    per_layer = [0] * len(layers)
    totals: Counter = Counter()
    for p in model.parameters():  # deduplicated: a tied weight once
        role = roles.get(id(p), "other")
        layer = layer_of.get(id(p))
        groups[(role, tuple(p.shape), layer is not None)] += 1
        totals[role] += p.numel()
        if layer is not None:
            per_layer[layer] += p.numel()
    linears: Counter = Counter()
    layer_linears: dict[int, list] = {}
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if w is None or getattr(w, "ndim", 0) != 2 or roles.get(id(w)) not in ("linear", "router"):
            continue
        cls_name = type(module).__name__
        if cls_name == "Conv1D":
            fan_in, fan_out = w.shape
        else:
            fan_out, fan_in = w.shape
        bias = getattr(module, "bias", None) is not None
        linears[(name.split(".")[-1], int(fan_in), int(fan_out), bias, roles[id(w)], id(w) in layer_of)] += 1
        if roles[id(w)] == "linear" and id(w) in layer_of:  # module order: what PEFT's adapters follow, A then B
            layer_linears.setdefault(layer_of[id(w)], []).append([name.split(".")[-1], int(fan_in), int(fan_out)])
    linear_runs = _runs(layer_linears)
    sizes = [p.numel() for p in model.parameters()]  # the optimizer's order (runner: trainable model.parameters())
    forloop_elems = max((2 * n + prev for prev, n in zip([0] + sizes[:-1], sizes)), default=0)
    tied = sum(1 for v in names.values() if len(v) > 1)
    out_emb = model.get_output_embeddings()
    tie = out_emb is not None and out_emb.weight is model.get_input_embeddings().weight
    infos = layer_infos(model) if layers else []
    sig_ids: dict[str, int] = {}
    layer_types = [sig_ids.setdefault(li.signature, len(sig_ids)) for li in infos]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # a multimodal model built whole: the parameters outside its language model and output head (vision tower,
    # projector), which a text-only step never reaches (no gradient, no optimizer state)
    # (under its base model, or, as Llama4ForConditionalGeneration holds it, on the top model itself)
    # (Idefics2/3 and SmolVLM name theirs text_model: without it their image side read empty, and a swapped
    # optimizer's formulas counted the vision tower in a text-only step: hypothesis found fused AdamW's temporaries
    # at -196,459,008 B on smolvlm2-500m)
    base = getattr(model, "model", None)
    lm = getattr(base, "language_model", None) or getattr(model, "language_model", None) or \
        getattr(base, "text_model", None)
    image_side: Counter = Counter()
    if lm is not None:
        head = model.get_output_embeddings()
        text_ids = {id(p) for p in lm.parameters()} | {id(p) for p in (head.parameters() if head is not None else ())}
        image_side.update(tuple(p.shape) for p in model.parameters() if id(p) not in text_ids)
    seen = vision.info(model) if vision.is_vision(cfg) else None
    if seen is not None:  # the inference step runs the base vision model: its own parameter count
        base_cls, base_cfg = model_class(cfg, "infer")
        with torch.device("meta"):
            seen["base_params"] = int(sum(p.numel() for p in base_cls.from_config(base_cfg).parameters()))
    heads = _first_int(tcfg, ("num_attention_heads", "n_head", "num_heads"), math.gcd)
    hidden = _first_int(tcfg, ("hidden_size", "n_embd", "d_model"))
    return {
        "model_type": str(config["model_type"]), "built_as": type(model).__name__,
        "text_model_type": str(tcfg.model_type),
        "causal": cls.__name__ in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForSeq2SeqLM",
                                   "AutoModelForSpeechSeq2Seq"),
        "params": int(sum(p.numel() for p in model.parameters())),
        "params_by_role": {k: int(v) for k, v in sorted(totals.items())},
        "param_groups": [[role, list(shape), in_layer, n] for (role, shape, in_layer), n in sorted(groups.items())],
        "linears": [[name, fi, fo, b, role, in_layer, n] for (name, fi, fo, b, role, in_layer), n
                    in sorted(linears.items())],
        "layers": len(layers), "layer_params": per_layer, "layer_types": layer_types,
        "tie_embeddings": bool(tie), "tied_names": tied, "buffer_bytes_bf16_build": int(buffers),
        "hidden": hidden, "heads": heads,
        "kv_heads": _first_int(tcfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv"), math.gcd) or heads,
        "head_dim": _first_int(tcfg, ("head_dim",)) or (hidden // heads if heads else 0),
        "vocab": _first_int(tcfg, ("vocab_size",)),
        # max_target_positions: Whisper's decoder (its seq is the decoder's tokens, tracer.seq2seq)
        "max_positions": _first_int(tcfg, ("max_position_embeddings", "n_positions", "max_sequence_length",
                                           "max_target_positions")),
        "learned_positions": _learned_positions(model, tcfg),
        "n_experts": n_experts, "experts_per_token": _first_int(tcfg, TOPK_KEYS) if n_experts else 0,
        "attention_dropout": max(float(getattr(tcfg, k, 0.0) or 0.0) for k in
                                 ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")),
        "decoder_path": path,
        # torch's forloop Adam/AdamW (estimator.components.optimizer_step_temp_bytes): the step's temporaries peak
        # at max over parameters of 2 x this one + the one before it (elements); LoRA's from the Linear order
        "forloop_elems": int(forloop_elems), "linear_runs": linear_runs,
        # transformers' own flag: Gemma-2 (logit softcapping) and gpt-oss (attention sinks) have no SDPA path
        "sdpa": bool(getattr(type(model), "_supports_sdpa", True)),
        **({"vision": seen} if seen is not None else {}),
        # (FSMT's layers are no GradientCheckpointingLayer modules: no stacks to count, traced whole)
        **({"seq2seq": {**seq2seq.info(model), "encoder_layers": len(stacks[0][2]) if len(stacks) > 1 else 0,
                        "decoder_layers": len(stacks[1][2]) if len(stacks) > 1 else 0}}
           if seq2seq.is_encoder_decoder(cfg) else {}),
        **({"vlm": vlm.info(model)} if vlm.is_vlm(cfg) and images_refused is None else {}),
        **({"vlm_refused": images_refused} if images_refused is not None else {}),
        **({"vlm_route": vlm_route(cfg.model_type)} if vlm.is_vlm(cfg) else {}),
        **({"audio": audio.info(model)} if audio.is_audio(cfg) and audio_refused is None else {}),
        **({"audio_refused": audio_refused} if audio_refused is not None else {}),
        **({"audio_route": AUDIO_ROUTE} if audio.is_audio(cfg) else {}),
        **({"image_side": [[list(k), n] for k, n in sorted(image_side.items())]} if image_side else {}),
    }
