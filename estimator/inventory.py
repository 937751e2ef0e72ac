"""A model's inventory: every parameter of the model transformers builds from a config, by role and layer.

    inv = store.inventory(config, "llama-3.1-8b")     # shipped, cached, or read from a meta-device build
    inv.params, inv.trainable_shapes(workload), inv.lora_shapes(("q_proj", "v_proj"))

It is read from the model itself (`tracer.meta`, torch, built on the meta device: no memory, no
weights) and kept as JSON, so that the estimator answers for any architecture transformers builds without one
hand-written line per family, and evaluates without importing torch. Parameter counts are exact by
construction: they are `sum(p.numel() for p in model.parameters())` of that model, tied weights once.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from estimator.spec import Workload
from estimator.families import family_of

ROLES = ("embedding", "head", "linear", "bias", "router", "expert", "norm", "other")
FORMAT = 1


@dataclass(frozen=True, eq=False)
class Inventory:
    """What a model holds (see tracer.meta for how each field is read)."""

    name: str
    config_hash: str
    model_type: str
    built_as: str                    # the transformers class, e.g. "LlamaForCausalLM"
    causal: bool                     # causal LM (else masked LM: an encoder)
    params: int
    params_by_role: dict             # role -> parameters
    param_groups: tuple              # (role, shape, in a decoder layer, count) per distinct tensor shape
    linears: tuple                   # (module name, in, out, bias, role, in a layer, count)
    layers: int
    layer_params: tuple              # parameters of each decoder layer, in order
    layer_types: tuple               # per decoder layer, a type id (layers with equal ids are alike)
    tie_embeddings: bool
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    learned_positions: bool
    n_experts: int = 0
    experts_per_token: int = 0
    extra: dict = field(default_factory=dict)   # the rest of the JSON (text_model_type, decoder_path, ...)

    def __hash__(self) -> int:
        return hash((self.config_hash, self.name))

    def __eq__(self, other) -> bool:
        return isinstance(other, Inventory) and (self.config_hash, self.name) == (other.config_hash, other.name)

    # -- summaries ---------------------------------------------------------------------------------
    @property
    def supports_sdpa(self) -> bool:
        """Whether transformers runs this model with SDPA (`_supports_sdpa` of its class; older inventories say
        nothing and are taken to)."""
        return bool(self.extra.get("sdpa", True))

    @property
    def takes_images(self) -> bool:
        """A vision-language model priced with its images (tracer.vlm): PEFT's target names and bitsandbytes'
        conversion reach its vision tower's and projector's Linears too, not only the language model's layers."""
        return "vlm" in self.extra

    @property
    def takes_audio(self) -> bool:
        """An audio-language model priced with its audio (tracer.audio): PEFT's target names reach its audio
        encoder's Linears too."""
        return "audio" in self.extra

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def family(self) -> str:
        return family_of(self.model_type)

    @cached_property
    def active_params(self) -> int:
        """Parameters one token runs through: routed experts count experts_per_token of n_experts."""
        expert = self.params_by_role.get("expert", 0)
        if not self.n_experts:
            return self.params
        return self.params - expert + expert * self.experts_per_token // self.n_experts

    @property
    def embedding_params(self) -> int:
        return self.params_by_role.get("embedding", 0)

    @property
    def lm_head_params(self) -> int:
        return self.params_by_role.get("head", 0)

    @cached_property
    def linear_params(self) -> int:
        return sum(n * fi * fo for _, fi, fo, _, role, _, n in self.linears if role == "linear")

    # -- what trains ---------------------------------------------------------------------------------
    def lora_target_names(self) -> list[str]:
        """Module names a LoRA target can name: the model's Linear (and Conv1D) modules inside the layers."""
        return sorted({name for name, _, _, _, role, in_layer, _ in self.linears if in_layer and role == "linear"})

    def lora_shapes(self, targets: tuple[str, ...], layers_only: bool = False) -> tuple[tuple[int, int, int], ...]:
        """(count, in, out) of every Linear a target names (PEFT matches the module name's last component,
        peft/tuners/tuners_utils.py `check_target_module_exists`). As PEFT does, names that match nothing are
        skipped as long as one matches (PEFT's defaults q_proj,v_proj adapt only q_proj in DeepSeek-V2-Lite);
        raises when none does (PEFT: "Target modules ... not found in the base model")."""
        wanted = {t.split(".")[-1] for t in targets}
        # a vision-language model: PEFT adapts its vision tower's Linears of the name too (`layers_only`: those of the
        # language model's layers, the ones a text-only step trains)
        anywhere = (self.takes_images or self.takes_audio) and not layers_only
        out = tuple((n, fi, fo) for name, fi, fo, _, role, in_layer, n in self.linears
                    if name in wanted and role == "linear" and (in_layer or anywhere))
        if not out:
            names = self.lora_target_names()
            raise ValueError(f"lora_targets: {', '.join(targets)} match no Linear module of {self.model_type}; "
                             + (f"available: {', '.join(names)}" if names else "it has no Linear module in its "
                                "layers to adapt (a conv net: use --method full)"))
        return out

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """r * (in + out) per adapted Linear (A: r x in, B: out x r; PEFT LoraLayer)."""
        return sum(n * rank * (fi + fo) for n, fi, fo in self.lora_shapes(targets))

    def trainable_params(self, w: Workload) -> int:
        if w.mode == "infer":
            return 0
        if w.method == "full":
            return self.params
        return self.lora_params(w.lora_rank, w.lora_targets)

    def trainable_shapes(self, w: Workload) -> tuple[tuple[int, int, int], ...]:
        """(copies, rows, cols) of every trainable tensor (vectors: cols == 1); drives per-tensor optimizer terms."""
        if w.mode == "infer":
            return ()
        # a multimodal model's step without its images or audio
        text_only = "image_side" in self.extra and not (w.images or w.audios)
        # with images (audio), what the step still leaves without a gradient (tracer.vlm.unreached: LLaVA's last CLIP
        # layer; tracer.audio.unreached)
        missed = ((self.extra.get("vlm") or {}).get("unreached") or []) if w.images else \
            ((self.extra.get("audio") or {}).get("unreached") or []) if w.audios else []
        if w.method != "full":
            wanted = {t.split(".")[-1] for t in w.lora_targets}
            skip: Counter = Counter()   # (in, out) of the targeted Linears no gradient reaches: their adapters neither
            for name, shape, k in missed:
                if name.endswith(".weight") and len(shape) == 2 and name.split(".")[0] in wanted:
                    skip[(shape[1], shape[0])] += k
            shapes = []
            for n, fi, fo in self.lora_shapes(w.lora_targets, layers_only=text_only):
                k = min(n, skip[(fi, fo)])
                skip[(fi, fo)] -= k
                n -= k
                if n:
                    shapes += [(n, w.lora_rank, fi), (n, fo, w.lora_rank)]
            return tuple(shapes)
        # parameters the step never reaches get no gradient and no optimizer state (tracer.vision.info: a vision
        # encoder's mask_token; a multimodal model's vision tower and projector in a text-only step, its inventory's
        # image_side); the traced step has none, so the swapped optimizer's formulas must not count them
        # (SigLIP's pooling head, CLIP's post_layernorm: of any role; the formulas read shapes only)
        side = Counter() if not text_only else Counter({tuple(s): n for s, n in self.extra["image_side"]})
        side.update(tuple(s) for s in (self.extra.get("vision") or {}).get("unreached", ()))
        for _, shape, k in missed:
            side[tuple(shape)] += k
        out = []
        for role, shape, _, n in self.param_groups:
            skip = min(n, side[tuple(shape)])
            side[tuple(shape)] -= skip
            n -= skip
            rows = shape[0] if shape else 1
            cols = 1
            for d in shape[1:]:
                cols *= d
            if n:
                out.append((n, rows, cols))
        return tuple(out)

    def forloop_elems(self, w: Workload) -> int | None:
        """Elements of torch's forloop Adam/AdamW step temporaries at their peak (`_single_tensor_adam`: `denom =
        (exp_avg_sq.sqrt() / c).add_(eps)` holds sqrt's result and the quotient of parameter i while parameter
        i - 1's denom is still bound): max over the trainable parameters, in the optimizer's order, of 2 n_i +
        n_{i-1}. Full fine-tuning: from the inventory (meta.read_inventory); LoRA: its adapters in module order,
        A (r x in) then B (out x r) of each adapted Linear. None for an inventory written before these fields."""
        if w.mode == "infer":
            return 0
        if w.method == "full":
            return self.extra.get("forloop_elems")
        runs = self.extra.get("linear_runs")
        if runs is None:
            return None
        wanted = {t.split(".")[-1] for t in w.lora_targets}
        best, prev = 0, 0
        for pattern, count in runs:
            seq = [x for name, fi, fo in pattern if name in wanted for x in (fi, fo)]
            for _ in range(min(count, 2)):  # a third identical layer repeats the second's pairs
                for n in seq:
                    best, prev = max(best, 2 * n + prev), n
        return best * w.lora_rank

    # -- JSON ----------------------------------------------------------------------------------------
    @staticmethod
    def from_dict(d: dict, name: str, config_hash: str) -> "Inventory":
        known = {f for f in Inventory.__dataclass_fields__ if f not in ("name", "config_hash", "extra")}
        try:
            kw = {k: d[k] for k in known}
            kw["param_groups"] = tuple((r, tuple(s), bool(i), int(n)) for r, s, i, n in d["param_groups"])
            kw["linears"] = tuple((str(a), int(b), int(c), bool(e), str(r), bool(i), int(n))
                                  for a, b, c, e, r, i, n in d["linears"])
            kw["layer_params"] = tuple(int(x) for x in d["layer_params"])
            kw["layer_types"] = tuple(int(x) for x in d["layer_types"])
            kw["params_by_role"] = {str(k): int(v) for k, v in d["params_by_role"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"inventory: not a valid willitfit inventory ({e})") from None
        extra = {k: v for k, v in d.items() if k not in known}
        return Inventory(name=name, config_hash=config_hash, extra=extra, **kw)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("name", "config_hash", "extra")}
        d.update(self.extra)
        d["format"] = FORMAT
        return json.loads(json.dumps(d))
