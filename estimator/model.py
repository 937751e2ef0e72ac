"""A model as the estimator sees it: its name, its config.json, and the inventory read from the model itself.

    model = from_hf_config(load_config("llama-3.1-8b")[1], "llama-3.1-8b")
    model.params, model.layers, model.inventory.linears

Any config whose `model_type` transformers builds works: the inventory (estimator.inventory) is read from a
meta-device build of transformers' own class the first time and cached; shipped presets carry theirs. The memory
of a step comes from the model's profile (estimator.profile), derived the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

from estimator.families import SPATIAL_VISION_TYPES, VISION_TYPES, family_of, unpriced_vision_option
from estimator.inventory import Inventory
from estimator.presets import config_hash
from estimator import store


@dataclass(frozen=True, eq=False)
class Model:
    name: str
    config: dict                     # the config.json (never modified)
    inventory: Inventory

    def __hash__(self) -> int:
        return hash((self.name, self.inventory.config_hash))

    def __eq__(self, other) -> bool:
        return isinstance(other, Model) and (self.name, self.inventory.config_hash) == \
            (other.name, other.inventory.config_hash)

    # the summary fields people read
    @property
    def model_type(self) -> str:
        return self.inventory.model_type

    @property
    def family(self) -> str:
        return family_of(self.model_type)

    @property
    def params(self) -> int:
        return self.inventory.params

    @property
    def active_params(self) -> int:
        return self.inventory.active_params

    @property
    def is_moe(self) -> bool:
        return self.inventory.is_moe

    @property
    def n_experts(self) -> int:
        return self.inventory.n_experts

    @property
    def experts_per_token(self) -> int:
        return self.inventory.experts_per_token

    @property
    def layers(self) -> int:
        return self.inventory.layers

    @property
    def hidden(self) -> int:
        return self.inventory.hidden

    @property
    def heads(self) -> int:
        return self.inventory.heads

    @property
    def kv_heads(self) -> int:
        return self.inventory.kv_heads

    @property
    def head_dim(self) -> int:
        return self.inventory.head_dim

    @property
    def vocab(self) -> int:
        return self.inventory.vocab

    @property
    def max_positions(self) -> int:
        return self.inventory.max_positions or (1 << 20)

    @property
    def learned_positions(self) -> bool:
        return self.inventory.learned_positions

    @property
    def tie_embeddings(self) -> bool:
        return self.inventory.tie_embeddings

    @property
    def causal(self) -> bool:
        return self.inventory.causal

    @property
    def default_attention(self) -> str:
        """What transformers runs when no attn_implementation is asked for: SDPA where the model has it."""
        return "sdpa" if self.inventory.supports_sdpa else "eager"

    @property
    def config_hash(self) -> str:
        return self.inventory.config_hash


def from_hf_config(config: dict, name: str = "model", *, derive: bool = True, progress=None) -> Model:
    """The Model for a config.json dict; its inventory from disk or, the first time, from a meta-device build.

    Bad configs raise ValueError in one line: a missing model_type, an architecture transformers does not have
    (with the reason it gives), remote code, encoder-decoder models, heads that do not divide the hidden size."""
    if not isinstance(config, dict):
        raise ValueError("model: a config.json must be a JSON object")
    _check_config(config)

    inv = store.inventory(config, name, derive=derive, progress=progress)
    if inv.config_hash != config_hash(config):  # defensive: the store keys by the hash
        raise ValueError("model: inventory does not belong to this config")
    return Model(name, config, inv)


# Sizes every decoder config names (where it names them): a value that is no positive integer is refused here, in
# one line naming the field, before transformers (and torch) is imported; lists and null pass (per-layer sizes).
SIZE_FIELDS = ("vocab_size", "num_hidden_layers", "n_layer", "intermediate_size", "max_position_embeddings",
               "n_positions", "head_dim", "num_local_experts", "num_experts", "num_experts_per_tok")


def _check_config(config: dict) -> None:
    """The one-line checks a user's config gets before transformers sees it (transformers' own errors are
    reported too, see tracer.meta.hf_config); the model type itself is checked against the installed
    transformers before it is imported (estimator.store.inventory)."""
    if not isinstance(config.get("model_type"), str) or not config["model_type"].strip():
        raise ValueError("model_type: missing; a config.json names its model_type" if config.get("model_type") is None
                         else f"model_type: must be a model type name, got {config['model_type']!r}")
    unpriced = unpriced_vision_option(config["model_type"], config.get)
    if unpriced:
        raise ValueError(unpriced)
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in SIZE_FIELDS:
        v = cfg.get(key)
        if v is not None and not isinstance(v, (list, dict)) and (isinstance(v, bool) or not isinstance(v, int)
                                                                   or v < 1):
            raise ValueError(f"{key}: must be a positive integer, got {v!r}")
    hidden = _first(cfg, ("hidden_size", "n_embd", "d_model"))
    heads = _first(cfg, ("num_attention_heads", "n_head", "num_heads"))
    kv = _first(cfg, ("num_key_value_heads", "num_kv_heads"))
    for key, v in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if isinstance(v, list):   # one per stage (PVT-v2, Swin) or per layer
            if v and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
                continue
            raise ValueError(f"{key}: must be a positive integer or a list of them, got {v!r}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{key}: must be a positive integer, got {v!r}")
    # hidden_size % heads is no check of ours: models take head_dim = hidden_size // heads (glm4_moe's defaults,
    # 4096 over 96 heads, build and run); what the code would fail on is refused where it fails (tracer.meta)
    if isinstance(heads, int) and isinstance(kv, int) and heads and kv and heads % kv:
        raise ValueError(f"num_key_value_heads: {kv} does not divide num_attention_heads {heads}")


# The fields that size a model, each with the spellings configs use for it. A config.json that lacks one is
# filled in from transformers' defaults for its class (a llama config with only hidden_size becomes a 6.74B
# model), so a user's config must state them, or say --allow-defaults and see which were filled in.
SIZE_FIELDS = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "ffn_dim",
                          "encoder_ffn_dim"),
    "vocab_size": ("vocab_size", "n_vocab", "padded_vocab_size"),
}
# model types whose code computes the MLP width from the hidden size when the config has none (4 * hidden)
FFN_FROM_HIDDEN = frozenset({"gpt2", "gpt_bigcode", "falcon", "bloom", "gpt_neo", "gptj", "codegen", "mpt"})
# model types whose mixer width is expand * hidden_size (transformers Mamba2Mixer / MambaMixer: `intermediate_size
# = int(config.expand * self.hidden_size)`), with no intermediate_size field: `expand` states it
WIDTH_FROM_EXPAND = frozenset({"mamba", "mamba2", "falcon_mamba"})
# model types with no attention layer at all (Mamba-1 mixers only): their configs have no attention heads to state
ATTENTION_FREE = frozenset({"mamba", "falcon_mamba"})


# A vision encoder's (families.VISION_TYPES): no vocabulary; its image and patch sizes set its tokens. DINOv2 sizes
# its MLP by mlp_ratio (4 by default in its code) rather than intermediate_size.
VISION_SIZE_FIELDS = {
    "num_hidden_layers": ("num_hidden_layers",),
    "num_attention_heads": ("num_attention_heads",),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("intermediate_size", "mlp_ratio"),
    "image_size": ("image_size",),
    "patch_size": ("patch_size",),
}


# A spatial vision model's (families.SPATIAL_VISION_TYPES: conv nets, hierarchical encoders): blocks per stage and
# widths per stage; its image size defaults to 224 pixels where its config has none (tracer.vision.DEFAULT_IMAGE_SIZE)
SPATIAL_SIZE_FIELDS = {
    "depths": ("depths",),
    "hidden_sizes": ("hidden_sizes", "embed_dims", "embed_dim"),
}
# the conv nets sized by multipliers of a fixed block list instead (their config.json has no depths)
SCALED_SIZE_FIELDS = {
    "efficientnet": {"width_coefficient": ("width_coefficient",), "depth_coefficient": ("depth_coefficient",)},
    "mobilenet_v1": {"depth_multiplier": ("depth_multiplier",)},
    "mobilenet_v2": {"depth_multiplier": ("depth_multiplier",)},
}


def defaulted_sizes(config: dict) -> list[str]:
    """The size fields (SIZE_FIELDS) a config.json leaves to transformers' defaults, in SIZE_FIELDS order.
    A composite config (text_config) is checked in its text part; a vision encoder's (SigLIP's and CLIP's
    vision_config) by VISION_SIZE_FIELDS."""
    if config.get("model_type") in SPATIAL_VISION_TYPES:
        fields = SCALED_SIZE_FIELDS.get(config["model_type"], SPATIAL_SIZE_FIELDS)
        return [name for name, keys in fields.items() if _first(config, keys) is None]
    if config.get("model_type") in VISION_TYPES:
        cfg = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else config
        return [name for name, keys in VISION_SIZE_FIELDS.items() if _first(cfg, keys) is None]
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = cfg.get("model_type") or config.get("model_type")
    stated_width = model_type in FFN_FROM_HIDDEN or (model_type in WIDTH_FROM_EXPAND and cfg.get("expand"))
    missing = [name for name, keys in SIZE_FIELDS.items()
               if _first(cfg, keys) is None and not (name == "intermediate_size" and stated_width)
               and not (name == "num_attention_heads" and model_type in ATTENTION_FREE)]
    # an encoder-decoder config in BART's spelling sizes its decoder apart (T5's decoder defaults to its encoder's
    # num_layers, as its config class says); a BART-style decoder left out would take the class's 12 layers
    if "encoder_layers" in cfg:
        missing += [k for k in ("decoder_layers", "decoder_attention_heads", "decoder_ffn_dim") if k not in cfg]
    return missing


def check_sizes(config: dict, allow_defaults: bool = False) -> list[str]:
    """Refuse, in one line naming them, a config that leaves size fields to defaults; with allow_defaults return
    those fields (for defaults_note once the model is built). Call it on a config a user wrote or pasted."""
    if isinstance(config, dict):  # what the config gets wrong outright is said first, then what it leaves out
        _check_config(config)
        store.check_model_type(config)
    missing = defaulted_sizes(config) if isinstance(config, dict) else []
    if missing and not allow_defaults:
        raise ValueError(f"model: the config.json lacks {', '.join(missing)} (the fields that size the model); add "
                         "them, or accept transformers' defaults for them (--allow-defaults; in the app: 'Accept defaults for "
                         "missing sizes')")
    return missing


def defaults_note(model: "Model", missing: list[str]) -> str:
    """'defaults filled in: num_hidden_layers=32, ...': the values the built model took for the missing fields."""
    up = [out for name, _in, out, *_ in model.inventory.linears
          if name in ("up_proj", "gate_proj", "fc1", "c_fc", "dense_h_to_4h", "w1")]
    read = {"num_hidden_layers": model.layers, "num_attention_heads": model.heads, "hidden_size": model.hidden,
            "vocab_size": model.vocab, **({"intermediate_size": up[0]} if up else {})}
    values = ", ".join(f"{k}={read[k]:,}" if k in read else f"{k} (the class default)" for k in missing)
    return f"defaults filled in (not in the config.json; transformers' {model.model_type} defaults): {values}"


def _first(cfg: dict, keys):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return None


def check_context(model: Model, seq: int, gen_tokens: int = 0, allow_beyond: bool = False) -> str | None:
    """Refuse a run past the model's context, in one line naming max_position_embeddings; with allow_beyond, a
    note to show instead (None when the run is within the context). Past learned position embeddings (GPT-2,
    OPT, BERT) there is no row for those positions, so the model cannot run it at all and allow_beyond does not
    help (fake tensors would not notice the bad index). Past a RoPE model's context the model runs, but it was
    not trained there (RoPE scaling or extrapolation is the user's choice)."""
    tokens, context = seq + gen_tokens, model.inventory.max_positions
    if not context or tokens <= context:
        return None
    if model.learned_positions:
        raise ValueError(f"seq: {tokens} tokens exceed {model.name}'s {context} learned positions (absolute position "
                         "embeddings, max_position_embeddings); use a shorter seq")
    if not allow_beyond:
        # the field to change: seq where the generated tokens leave room for a prompt, else gen_tokens itself
        fix = f"seq <= {context - gen_tokens}" if gen_tokens < context else f"gen_tokens <= {context - seq}" \
            if seq < context else "a shorter seq"
        field = "seq" if gen_tokens < context else "gen_tokens"
        what = f"{tokens} tokens (seq {seq} + {gen_tokens} generated)" if gen_tokens else f"{tokens} tokens"
        raise ValueError(f"{field}: {what} exceed {model.name}'s context "
                         f"of {context} tokens (max_position_embeddings); use {fix}, or --allow-beyond-context if you "
                         "run it longer (RoPE scaling; T5's relative positions run past its n_positions)")
    return (f"{tokens} tokens are beyond {model.name}'s context of {context} (max_position_embeddings): "
            "the memory is estimated as asked; the model was not trained that long")
