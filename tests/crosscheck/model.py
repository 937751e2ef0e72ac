"""ModelSpec: the architecture of a Hugging Face model, read from its config.json, down to every weight matrix.

A model is described as the list of its weight tensors, grouped by role, so that every later formula (quantized
weights, LoRA adapters, TP/EP sharding, parameter counts) reads the same shapes. The counts are exact: a test
builds every shipped preset with transformers on the `meta` device and compares with sum(p.numel()).

The module layouts mirror transformers 5.x `modeling_<arch>.py` (LlamaDecoderLayer, Gemma2DecoderLayer,
Phi3DecoderLayer, GPT2Block, GPTNeoXLayer, FalconDecoderLayer, OPTDecoderLayer, MixtralSparseMoeBlock,
Qwen2MoeSparseMoeBlock, DeepseekV3Attention/MoE, BertLayer + BertForMaskedLM head).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

# model_type -> family name used for activation constants and calibration (one k per family)
FAMILIES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    "gemma": "gemma", "gemma2": "gemma",
    "phi3": "llama",
    "gpt2": "gpt2", "gpt_neox": "gpt_neox", "falcon": "falcon", "opt": "opt",
    "mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe",
    "deepseek_v2": "deepseek", "deepseek_v3": "deepseek",
    "bert": "bert",
}
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES))


@dataclass(frozen=True)
class Linear:
    """One weight matrix (per layer), `count` copies of it (e.g. MoE experts)."""

    name: str          # HF module name (q_proj, gate_proj, c_attn, ...), used for LoRA targets
    in_features: int
    out_features: int
    bias: bool = False
    count: int = 1     # instances per layer (experts)
    role: str = "attn"  # attn | mlp | expert | shared | router: decides TP/EP sharding and MoE activity

    @property
    def params(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))


@dataclass(frozen=True)
class LayerSpec:
    """One transformer block type; `norm_params` are the 1-D parameters (norm weights/biases, router biases)."""

    linears: tuple[Linear, ...]
    norm_params: int

    @cached_property  # derived once per (frozen) spec: estimate() reads it often
    def params(self) -> int:
        return sum(lin.params for lin in self.linears) + self.norm_params


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str
    hidden: int                # h
    layers: int                # L
    heads: int                 # attention heads (query)
    kv_heads: int              # key/value heads (GQA/MQA); == heads for MHA
    head_dim: int              # per-head dim of q/k (MLA: qk_nope + qk_rope)
    v_head_dim: int            # per-head dim of v (== head_dim except MLA)
    intermediate: int          # dense MLP width
    vocab: int
    max_positions: int
    tie_embeddings: bool
    gated_mlp: bool            # SwiGLU/GeGLU (3 matrices) vs GELU MLP (2)
    layer_groups: tuple[tuple[int, LayerSpec], ...]  # (number of layers, layer type), in order
    embed_params: int          # token (+ position, token-type) embeddings and their norm
    head_params: int           # final norm + untied lm_head (+ MLM head)
    norm_kind: str = "rms"     # rms | layer: LayerNorm saves mean/rstd, RMSNorm an fp32 copy
    parallel_residual: bool = False  # attention and MLP read the same normed input (GPT-J/NeoX/Falcon)
    attn_dropout: float = 0.0
    hidden_dropout: float = 0.0
    causal: bool = True        # False for encoders (BERT)
    n_experts: int = 0         # routed experts per MoE layer
    experts_per_token: int = 0
    kv_lora_rank: int = 0      # MLA latent width (DeepSeek); 0 = ordinary K/V cache
    qk_rope_head_dim: int = 0  # MLA decoupled RoPE key width, cached beside the latent
    dtype: str = "bf16"        # dtype the checkpoint ships in (informational)
    learned_positions: bool = False  # absolute position embeddings (GPT-2, OPT, BERT): no run past max_positions
    # What the layers keep for backward depends on these too (tests/crosscheck/layer_saved.py):
    act: str = "silu"          # MLP activation, a transformers ACT2FN key (gelu_new saves 4 tensors, relu 0)
    rotary_dim: int = 0        # RoPE-rotated dims per head (partial rotary: NeoX 0.25 * head_dim); 0 = no RoPE
    attn_softcap: bool = False  # Gemma-2 tanh soft-capping of attention scores (eager saves the tanh)
    logit_softcap: bool = False  # Gemma-2 tanh soft-capping of the final logits (saves the tanh, V wide)
    norm_topk: bool = False    # MoE router renormalises its top-k weights (saves their sum)
    embed_dropout: float = 0.0  # dropout on the summed embeddings (GPT-2 embd_pdrop, BERT hidden dropout)

    def __hash__(self) -> int:  # dataclass keeps an explicit __hash__; specs key lru_caches on every estimate()
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))  # the fields __eq__ compares

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @cached_property  # derived once per (frozen) spec: estimate() reads it often
    def params(self) -> int:
        """Total parameters, as sum(p.numel()) of the transformers model (tied weights counted once)."""
        return self.embed_params + self.head_params + sum(n * ls.params for n, ls in self.layer_groups)

    @cached_property  # derived once per (frozen) spec: estimate() reads it often
    def active_params(self) -> int:
        """Parameters touched per token: routed experts count experts_per_token of n_experts."""
        total = self.embed_params + self.head_params
        for n, ls in self.layer_groups:
            for lin in ls.linears:
                if lin.role == "expert":
                    total += n * lin.params * self.experts_per_token // lin.count
                else:
                    total += n * lin.params
            total += n * ls.norm_params
        return total

    @property
    def embedding_params(self) -> int:
        """Input token-embedding matrix alone (left unquantized by bitsandbytes, GPTQ and AWQ)."""
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    def linears(self):
        """Yield (layers, Linear) for every per-layer weight matrix."""
        for n, ls in self.layer_groups:
            for lin in ls.linears:
                yield n, lin

    @cached_property  # derived once per (frozen) spec: estimate() reads it often
    def linear_params(self) -> int:
        """Parameters in the transformer blocks' Linear layers (what quantizers convert)."""
        return sum(n * lin.count * lin.in_features * lin.out_features for n, lin in self.linears())

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """Elements cached per token over all layers: K and V of every kv head, or MLA's latent + rope key."""
        if self.is_mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return self.layers * self.kv_heads * (self.head_dim + self.v_head_dim)


def check_context(model: ModelSpec, seq: int, gen_tokens: int = 0) -> None:
    """Raise ValueError when a run cannot exist: a model with learned absolute position embeddings has no
    embedding for positions past max_positions (RoPE/ALiBi models run longer, at their own quality risk)."""
    if model.learned_positions and seq + gen_tokens > model.max_positions:
        raise ValueError(f"seq: {seq + gen_tokens} tokens exceed {model.name}'s {model.max_positions} learned "
                         f"position embeddings; allowed seq + gen_tokens <= {model.max_positions}")


def _get(cfg: dict, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def _req_int(cfg: dict, *keys) -> int:
    v = _get(cfg, *keys)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"config.{keys[0]}: must be a positive integer, got {v!r}")
    return v


def from_hf_config(cfg: dict, name: str = "custom") -> ModelSpec:
    """Build a ModelSpec from a parsed Hugging Face config.json.

    Raises ValueError for an unsupported model_type (naming the supported ones) or a missing/invalid field.
    """
    from crosscheck import architectures  # one builder per family; kept apart to keep this file readable

    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ValueError(f"model_type: {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return architectures.BUILDERS[mt](cfg, name)
