"""Decoder layers of a transformers model: find them, tell their types apart, keep a subset (reduced depth).

A profile is derived from traces of a *reduced-depth* model: the model's own first and last decoder layers and
one or two middle layers of each distinct type (dense / MoE, sliding / global attention, attention / Mamba...),
then extended to the full depth (`tracer.derive`). Nothing here knows a model family: the layers are
the `GradientCheckpointingLayer` modules transformers builds (modeling_layers.py; every decoder and encoder layer
of the causal- and masked-LM models in 5.x derives from it), and a layer's type is what it holds and what the
config says about its index.

`reduce_depth(model, keep)` keeps the layers at the given indices, in order, inside an already built (meta)
model: the decoder's ModuleList is replaced, every `layer_idx` attribute inside a kept layer is renumbered to
its new position (DynamicCache and the attention modules index by it), and the config's per-layer lists
(`layer_types`, `layers_block_type`, ...: any list as long as the layer count) are cut to the kept entries,
with `num_hidden_layers` set to the new depth. Models that loop over `self.layers[: config.num_hidden_layers]`
or index `config.layer_types[i]` by the loop position then run exactly the kept layers with their own types.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from tracer.vision import is_vision, vision_config

LAYER_INDEX_ATTRS = ("layer_idx", "layer_id", "layer_number")
VISION_PATH_WORDS = ("vision", "visual", "audio")   # a module path inside a multimodal model's vision (audio) tower


def _gc_layer_class():
    from transformers.modeling_layers import GradientCheckpointingLayer

    return GradientCheckpointingLayer


def decoder_layer_list(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList]:
    """(parent module, attribute name, ModuleList) of the model's decoder (or encoder) layers: the ModuleList
    whose items are GradientCheckpointingLayer modules; the longest one if a model has several (a vision
    tower's blocks inside a multimodal model are shorter than the text stack, or not such layers at all). An
    encoder-decoder model has two stacks: `layer_stacks`."""
    cls = _gc_layer_class()
    config = getattr(model, "config", None)   # an encoder-decoder model's stack may hold no config (FSMT's)
    want = getattr(text_config(config), "num_hidden_layers", None) if config is not None else None
    best = None
    for path, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) and all(isinstance(m, cls) for m in child):
                # the text stack first (a vision tower's blocks can number as many as a reduced text stack keeps)
                tower = any(w in f"{path}.{name}".lower() for w in VISION_PATH_WORDS)
                rank = (len(child) == want, not tower, len(child))  # then the longest
                if best is None or rank > best[3]:
                    best = (parent, name, child, rank)
    if best is None:
        raise ValueError(f"model_type: {getattr(config, 'model_type', '?')!r} has no decoder layers "
                         "(GradientCheckpointingLayer modules) to trace layer by layer")
    return best[:3]


def layer_stacks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.ModuleList]]:
    """The model's layer stacks in the order a step runs them: an encoder-decoder model's encoder layers, then its
    decoder layers (each `decoder_layer_list` of `get_encoder()` / `get_decoder()`); a pipeline rank's stages under a
    looped schedule (tracer.pp.RankStages) one stack each, in stage order; any other model's one stack."""
    parts = getattr(model, "pipeline_parts", None)
    if parts is not None:
        return [decoder_layer_list(part) for part in parts]
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        inner = getattr(model, "base_model", model)   # PEFT's wrapper
        inner = getattr(inner, "model", inner) if not hasattr(inner, "get_encoder") else inner
        get_enc, get_dec = getattr(inner, "get_encoder", None), getattr(inner, "get_decoder", None)
        if get_enc is not None and get_dec is not None:
            return [decoder_layer_list(get_enc()), decoder_layer_list(get_dec())]
    return [decoder_layer_list(model)]


def all_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every layer of `layer_stacks`, in order: the positions reduced depth and the layer blocks count."""
    return [layer for _, _, layers in layer_stacks(model) for layer in layers]


def text_config(config):
    """The config that holds the decoder's layer count: the model's own, or its nested text_config; a vision
    encoder's vision_config (SigLIP, CLIP: the tower a vision step runs)."""
    if is_vision(config):
        return vision_config(config)
    inner = getattr(config, "text_config", None)
    return inner if inner is not None and hasattr(inner, "num_hidden_layers") else config


def per_layer_lists(config, n_layers: int) -> dict[str, list]:
    """Config attributes that hold one entry per layer (lists exactly n_layers long)."""
    out = {}
    for key, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == n_layers and not key.startswith("_"):
            out[key] = list(value)
    return out


def per_layer_overrides(config) -> dict[int, dict]:
    """{layer index: overridden attributes} of a heterogeneous config (transformers' per_layer_config, e.g.
    Gemma-4's head_dim 512 on its global layers; integrations/heterogeneity/configuration_utils.py), else {}."""
    spec = vars(config).get("_heterogeneity_spec")
    return dict(getattr(spec, "per_layer_overrides", None) or {})


@dataclass(frozen=True)
class LayerInfo:
    """One decoder layer: its index, its type signature and its parameter count."""

    index: int
    signature: str      # class + parameter shapes + the config's per-layer entries for this index
    params: int


def layer_infos(model: torch.nn.Module) -> list[LayerInfo]:
    """Every decoder layer in order, with a signature that is equal exactly for layers of the same type."""
    stacks = layer_stacks(model)
    if len(stacks) > 1:   # encoder-decoder: each layer's stack is part of its type
        out = []
        for tag, (_, _, layers) in zip(("encoder", "decoder"), stacks):
            for layer in layers:
                shapes = sorted((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
                out.append(LayerInfo(len(out), repr((tag, type(layer).__name__, shapes)),
                                     sum(p.numel() for _, p in layer.named_parameters())))
        return out
    _, _, layers = stacks[0]
    cfg = text_config(model.config)
    lists = per_layer_lists(cfg, len(layers))
    overrides = per_layer_overrides(cfg)
    out = []
    for i, layer in enumerate(layers):
        shapes = sorted((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
        entries = sorted((k, repr(v[i])) for k, v in lists.items())
        if overrides:
            entries.append(("per_layer_config", repr(sorted(overrides.get(i, {}).items()))))
        sig = repr((type(layer).__name__, shapes, entries))
        out.append(LayerInfo(i, sig, sum(p.numel() for _, p in layer.named_parameters())))
    return out


def reduce_depth(model: torch.nn.Module, keep: list[int]) -> None:
    """Keep only the decoder layers at indices `keep`, in place, run in the given order; an index given twice
    keeps a deep copy of that layer too (built on meta: a second layer of the same type, its own parameters).
    See the module docstring for what is renumbered. An encoder-decoder model's indices count its encoder's layers,
    then its decoder's (`layer_stacks`): each stack keeps its own, renumbered within it."""
    stacks = layer_stacks(model)
    if len(stacks) > 1:
        _reduce_stacks(model, stacks, keep)
        return
    parent, name, layers = stacks[0]
    n = len(layers)
    if not keep or any(not 0 <= i < n for i in keep):
        raise ValueError(f"layers: indices {keep} out of range for {n} layers")
    _keep(parent, name, layers, keep)
    for cfg in {id(c): c for c in (model.config, text_config(model.config))}.values():
        if getattr(cfg, "num_hidden_layers", None) == n:
            for key, values in per_layer_lists(cfg, n).items():
                setattr(cfg, key, [values[i] for i in keep])
            pattern = vars(cfg).get("block_types")
            if isinstance(pattern, list) and 0 < len(pattern) < n:
                # RecurrentGemma's layer types are its block_types cycled over the layers (layers_block_type): the
                # kept layers' own, so its inference cache gives each kept layer the cache of its type
                full = (pattern * (n // len(pattern) + 1))[:n]
                cfg.block_types = [full[i] for i in keep]
            overrides = per_layer_overrides(cfg)
            if overrides:  # heterogeneous config: the kept layers keep their own overrides at their new index
                cfg.__dict__["_heterogeneity_spec"].per_layer_overrides = {
                    new: copy.deepcopy(overrides[old]) for new, old in enumerate(keep) if old in overrides}
            cfg.num_hidden_layers = len(keep)


def traced_whole(config, workload, shared: bool) -> str:
    """Why a model must be traced whole rather than at reduced depth (tracer.derive), or "": a block several layers
    reuse is counted once whatever the depth (Zamba: 59% off at full depth when extended); Qwen3-VL's first layers
    add the vision tower's deepstack features by their position (Qwen3VLTextModel: `layer_idx in
    range(len(deepstack_visual_embeds))`), one per deepstack_visual_indexes entry, whatever the depth."""
    if shared:
        return "its decoder layers share parameters (a block several layers reuse), so it is traced whole"
    vision = getattr(config, "vision_config", None)
    if workload.images and getattr(vision, "deepstack_visual_indexes", None):
        return ("its first layers add the vision tower's deepstack features by position, so with images it is "
                "traced whole")
    return ""


# an encoder-decoder config's layer counts: the encoder's, then the decoder's (T5: num_layers, num_decoder_layers;
# BART, Whisper: encoder_layers, decoder_layers)
STACK_COUNT_KEYS = (("num_layers", "encoder_layers"), ("num_decoder_layers", "decoder_layers"))


def _reduce_stacks(model, stacks, keep: list[int]) -> None:
    """reduce_depth of an encoder-decoder model: `keep` over the encoder's layers then the decoder's, in order, the
    encoder's first (a step runs them so)."""
    sizes = [len(layers) for _, _, layers in stacks]
    if not keep or any(not 0 <= i < sum(sizes) for i in keep):
        raise ValueError(f"layers: indices {keep} out of range for {sum(sizes)} layers")
    order = [i >= sizes[0] for i in keep]
    if order != sorted(order):
        raise ValueError(f"layers: {keep} interleaves the encoder's and the decoder's layers")
    cfg = model.config
    for stack, ((parent, name, layers), keys) in enumerate(zip(stacks, STACK_COUNT_KEYS)):
        base = sum(sizes[:stack])
        mine = [i - base for i in keep if base <= i < base + sizes[stack]]
        if not mine:
            raise ValueError(f"layers: {keep} keeps no layer of the {('encoder', 'decoder')[stack]}")
        _keep(parent, name, layers, mine)
        for key in keys:
            if vars(cfg).get(key) == len(layers):
                setattr(cfg, key, len(mine))


def _buffer_copies(layer) -> dict:
    """A deepcopy memo holding a clone of each of the layer's buffers: Tensor.__deepcopy__ refuses a meta buffer made
    with nn.Buffer (MiniMax-M3's router bias: its clone's type is not the buffer's), which a clone copies as well."""
    return {id(b): b.detach().clone() for b in layer.buffers()}


def _keep(parent, name: str, layers, keep: list[int]) -> None:
    """parent.name becomes the layers at `keep`, in order (an index given twice: a deep copy, its own parameters),
    each one's layer index attributes renumbered to its new position."""
    kept, seen = [], set()
    for i in keep:
        kept.append(copy.deepcopy(layers[i], _buffer_copies(layers[i])) if i in seen else layers[i])
        seen.add(i)
    for new, (old, layer) in enumerate(zip(keep, kept)):
        for module in layer.modules():
            for attr in LAYER_INDEX_ATTRS:
                if getattr(module, attr, None) == old:
                    setattr(module, attr, new)
    setattr(parent, name, torch.nn.ModuleList(kept))
