"""One builder per supported `model_type`: config.json -> ModelSpec with every weight matrix.

Each builder mirrors the module tree of transformers 5.x `models/<arch>/modeling_<arch>.py`; the comment on each
names the classes it follows. Config defaults are those of the matching `configuration_<arch>.py`.
"""
from __future__ import annotations

from crosscheck.model import LayerSpec, Linear, ModelSpec, _get, _req_int


def _common(cfg: dict) -> dict:
    h = _req_int(cfg, "hidden_size", "n_embd", "d_model")
    heads = _req_int(cfg, "num_attention_heads", "n_head")
    return dict(
        hidden=h,
        layers=_req_int(cfg, "num_hidden_layers", "n_layer"),
        heads=heads,
        kv_heads=_get(cfg, "num_key_value_heads", default=heads),
        head_dim=_get(cfg, "head_dim", default=h // heads),
        vocab=_req_int(cfg, "vocab_size"),
        max_positions=_get(cfg, "max_position_embeddings", "n_positions", default=2048),
        dtype={"float32": "fp32", "float16": "fp16"}.get(_get(cfg, "torch_dtype", "dtype", default="bfloat16"), "bf16"),
    )


def _rotary_dim(cfg: dict, head_dim: int, default_factor: float = 1.0,
                legacy_key: str = "partial_rotary_factor") -> int:
    """RoPE-rotated dims per head: head_dim * partial_rotary_factor (transformers 5 keeps it in rope_parameters;
    older configs carry it at top level, GPT-NeoX as rotary_pct)."""
    rope = _get(cfg, "rope_parameters", "rope_scaling", default={}) or {}
    factor = _get(rope, "partial_rotary_factor", default=_get(cfg, legacy_key, default=default_factor))
    return int(head_dim * factor)


def _gated_mlp(h: int, inter: int, bias: bool = False, role: str = "mlp", count: int = 1) -> tuple[Linear, ...]:
    return (Linear("gate_proj", h, inter, bias, count, role), Linear("up_proj", h, inter, bias, count, role),
            Linear("down_proj", inter, h, bias, count, role))


def _gqa_attn(h: int, heads: int, kv: int, hd: int, qkv_bias: bool, o_bias: bool) -> tuple[Linear, ...]:
    return (Linear("q_proj", h, heads * hd, qkv_bias), Linear("k_proj", h, kv * hd, qkv_bias),
            Linear("v_proj", h, kv * hd, qkv_bias), Linear("o_proj", heads * hd, h, o_bias))


def llama_like(cfg: dict, name: str) -> ModelSpec:
    """LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Gemma(2)ForCausalLM.

    Qwen2 hard-codes bias on q/k/v only; Qwen3 adds per-head RMSNorm on q and k (q_norm, k_norm); Gemma-2 has four
    RMSNorms per layer (pre/post attention and feed-forward); Gemma ties embeddings by default.
    """
    mt = cfg["model_type"]
    c = _common(cfg)
    h, hd, heads, kv = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"]
    inter = _req_int(cfg, "intermediate_size")
    if mt == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(_get(cfg, "attention_bias", default=False))
    mlp_bias = bool(_get(cfg, "mlp_bias", default=False))
    norms = {"gemma2": 4}.get(mt, 2) * h + (2 * hd if mt == "qwen3" else 0)
    layer = LayerSpec(_gqa_attn(h, heads, kv, hd, qkv_bias, o_bias) + _gated_mlp(h, inter, mlp_bias), norms)
    tie = bool(_get(cfg, "tie_word_embeddings", default=mt in ("gemma", "gemma2")))
    act_default = "gelu_pytorch_tanh" if mt in ("gemma", "gemma2") else "silu"
    act = _get(cfg, "hidden_activation", "hidden_act", default=act_default) if mt == "gemma2" else \
        _get(cfg, "hidden_act", default=act_default)
    if mt == "gemma" and act == "gelu":  # GemmaConfig maps the legacy "gelu" to the tanh approximation
        act = "gelu_pytorch_tanh"
    softcap = {k: mt == "gemma2" and _get(cfg, k, default=d) is not None
               for k, d in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))}
    return ModelSpec(
        name=name, model_type=mt, v_head_dim=hd, intermediate=inter, tie_embeddings=tie, gated_mlp=True,
        layer_groups=((c["layers"], layer),), embed_params=c["vocab"] * h,
        head_params=h + (0 if tie else c["vocab"] * h), attn_dropout=float(_get(cfg, "attention_dropout", default=0.0)),
        act=act, rotary_dim=hd, attn_softcap=softcap["attn_logit_softcapping"],
        logit_softcap=softcap["final_logit_softcapping"], **c)


def phi3(cfg: dict, name: str) -> ModelSpec:
    """Phi3ForCausalLM: fused qkv_proj and gate_up_proj, no biases, RMSNorm, untied head (Phi-3-mini)."""
    c = _common(cfg)
    h, hd, heads, kv = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"]
    inter = _req_int(cfg, "intermediate_size")
    layer = LayerSpec((Linear("qkv_proj", h, (heads + 2 * kv) * hd), Linear("o_proj", heads * hd, h),
                       Linear("gate_up_proj", h, 2 * inter, role="mlp"), Linear("down_proj", inter, h, role="mlp")),
                      2 * h)
    tie = bool(_get(cfg, "tie_word_embeddings", default=False))
    return ModelSpec(name=name, model_type="phi3", v_head_dim=hd, intermediate=inter, tie_embeddings=tie,
                     gated_mlp=True, layer_groups=((c["layers"], layer),), embed_params=c["vocab"] * h,
                     head_params=h + (0 if tie else c["vocab"] * h),
                     attn_dropout=float(_get(cfg, "attention_dropout", default=0.0)),
                     hidden_dropout=float(_get(cfg, "resid_pdrop", default=0.0)),
                     act=_get(cfg, "hidden_act", default="silu"), rotary_dim=_rotary_dim(cfg, hd),
                     embed_dropout=float(_get(cfg, "embd_pdrop", default=0.0)), **c)


def gpt2(cfg: dict, name: str) -> ModelSpec:
    """GPT2LMHeadModel: learned positions, Conv1D c_attn/c_proj/c_fc with biases, LayerNorm, tied lm_head."""
    c = _common(cfg)
    h = c["hidden"]
    inter = _get(cfg, "n_inner", default=4 * h) or 4 * h
    layer = LayerSpec((Linear("c_attn", h, 3 * h, True), Linear("c_proj", h, h, True),
                       Linear("c_fc", h, inter, True, role="mlp"), Linear("mlp.c_proj", inter, h, True, role="mlp")),
                      4 * h)
    return ModelSpec(name=name, model_type="gpt2", v_head_dim=c["head_dim"], intermediate=inter, tie_embeddings=True,
                     gated_mlp=False, layer_groups=((c["layers"], layer),),
                     embed_params=(c["vocab"] + c["max_positions"]) * h, head_params=2 * h, norm_kind="layer", learned_positions=True,
                     attn_dropout=float(_get(cfg, "attn_pdrop", default=0.1)),
                     hidden_dropout=float(_get(cfg, "resid_pdrop", default=0.1)),
                     act=_get(cfg, "activation_function", default="gelu_new"),
                     embed_dropout=float(_get(cfg, "embd_pdrop", default=0.1)), **c)


def gpt_neox(cfg: dict, name: str) -> ModelSpec:
    """GPTNeoXForCausalLM: fused query_key_value, parallel residual, LayerNorm, untied embed_out."""
    c = _common(cfg)
    h = c["hidden"]
    inter = _req_int(cfg, "intermediate_size")
    bias = bool(_get(cfg, "attention_bias", default=True))
    layer = LayerSpec((Linear("query_key_value", h, 3 * h, bias), Linear("dense", h, h, bias),
                       Linear("dense_h_to_4h", h, inter, True, role="mlp"),
                       Linear("dense_4h_to_h", inter, h, True, role="mlp")), 4 * h)
    tie = bool(_get(cfg, "tie_word_embeddings", default=False))
    return ModelSpec(name=name, model_type="gpt_neox", v_head_dim=c["head_dim"], intermediate=inter,
                     tie_embeddings=tie, gated_mlp=False, layer_groups=((c["layers"], layer),),
                     embed_params=c["vocab"] * h, head_params=2 * h + (0 if tie else c["vocab"] * h),
                     norm_kind="layer", parallel_residual=bool(_get(cfg, "use_parallel_residual", default=True)),
                     attn_dropout=float(_get(cfg, "attention_dropout", default=0.0)),
                     hidden_dropout=float(_get(cfg, "hidden_dropout", default=0.0)),
                     act=_get(cfg, "hidden_act", default="gelu"),
                     rotary_dim=_rotary_dim(cfg, c["head_dim"], 0.25, "rotary_pct"), **c)


def falcon(cfg: dict, name: str) -> ModelSpec:
    """FalconForCausalLM: fused query_key_value (multi-query: 1 KV head), parallel attention, tied head."""
    c = _common(cfg)
    h, hd, heads = c["hidden"], c["head_dim"], c["heads"]
    new_arch = bool(_get(cfg, "new_decoder_architecture", default=False))
    if new_arch:
        kv = _get(cfg, "num_kv_heads", default=heads)
    else:
        kv = 1 if _get(cfg, "multi_query", default=True) else heads
    bias = bool(_get(cfg, "bias", default=False))
    inter = _get(cfg, "ffn_hidden_size", default=4 * h) or 4 * h
    parallel = bool(_get(cfg, "parallel_attn", default=True))
    n_norms = 2 if (new_arch and _get(cfg, "num_ln_in_parallel_attn", default=2) == 2) or not parallel else 1
    layer = LayerSpec((Linear("query_key_value", h, (heads + 2 * kv) * hd, bias), Linear("dense", heads * hd, h, bias),
                       Linear("dense_h_to_4h", h, inter, bias, role="mlp"),
                       Linear("dense_4h_to_h", inter, h, bias, role="mlp")), n_norms * 2 * h)
    tie = bool(_get(cfg, "tie_word_embeddings", default=True))
    c["kv_heads"] = kv
    return ModelSpec(name=name, model_type="falcon", v_head_dim=hd, intermediate=inter, tie_embeddings=tie,
                     gated_mlp=False, layer_groups=((c["layers"], layer),), embed_params=c["vocab"] * h,
                     head_params=2 * h + (0 if tie else c["vocab"] * h), norm_kind="layer",
                     parallel_residual=parallel, attn_dropout=float(_get(cfg, "attention_dropout", default=0.0)),
                     hidden_dropout=float(_get(cfg, "hidden_dropout", default=0.0)),
                     act="gelu", rotary_dim=0 if _get(cfg, "alibi", default=False) else hd, **c)  # FalconMLP: nn.GELU()


def opt(cfg: dict, name: str) -> ModelSpec:
    """OPTForCausalLM: learned positions with offset 2, k/v/q/out_proj and fc1/fc2 with biases, tied head."""
    c = _common(cfg)
    h = c["hidden"]
    inter = _req_int(cfg, "ffn_dim")
    bias = bool(_get(cfg, "enable_bias", default=True))
    affine = bool(_get(cfg, "layer_norm_elementwise_affine", default=True))
    proj = _get(cfg, "word_embed_proj_dim", default=h)
    layer = LayerSpec((Linear("q_proj", h, h, bias), Linear("k_proj", h, h, bias), Linear("v_proj", h, h, bias),
                       Linear("out_proj", h, h, bias), Linear("fc1", h, inter, bias, role="mlp"),
                       Linear("fc2", inter, h, bias, role="mlp")), 4 * h if affine else 0)
    final_ln = 2 * h if (_get(cfg, "do_layer_norm_before", default=True)
                         and not _get(cfg, "_remove_final_layer_norm", default=False) and affine) else 0
    project = 2 * proj * h if proj != h else 0  # project_in / project_out (no bias)
    tie = bool(_get(cfg, "tie_word_embeddings", default=True))
    return ModelSpec(name=name, model_type="opt", v_head_dim=c["head_dim"], intermediate=inter, tie_embeddings=tie,
                     gated_mlp=False, layer_groups=((c["layers"], layer),),
                     embed_params=c["vocab"] * proj + (c["max_positions"] + 2) * h + project,
                     head_params=final_ln + (0 if tie else c["vocab"] * proj), norm_kind="layer", learned_positions=True,
                     attn_dropout=float(_get(cfg, "attention_dropout", default=0.0)),
                     hidden_dropout=float(_get(cfg, "dropout", default=0.1)),
                     act=_get(cfg, "activation_function", default="relu"), **c)


def mixtral(cfg: dict, name: str) -> ModelSpec:
    """MixtralForCausalLM: Llama attention + MixtralSparseMoeBlock (router gate + E fused SwiGLU experts)."""
    c = _common(cfg)
    h, hd, heads, kv = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"]
    inter = _req_int(cfg, "intermediate_size")
    e = _req_int(cfg, "num_local_experts")
    layer = LayerSpec(_gqa_attn(h, heads, kv, hd, False, False) + (Linear("gate", h, e, role="router"),)
                      + _gated_mlp(h, inter, role="expert", count=e), 2 * h)
    tie = bool(_get(cfg, "tie_word_embeddings", default=False))
    return ModelSpec(name=name, model_type="mixtral", v_head_dim=hd, intermediate=inter, tie_embeddings=tie,
                     gated_mlp=True, layer_groups=((c["layers"], layer),), embed_params=c["vocab"] * h,
                     head_params=h + (0 if tie else c["vocab"] * h), n_experts=e,
                     experts_per_token=_req_int(cfg, "num_experts_per_tok"),
                     attn_dropout=float(_get(cfg, "attention_dropout", default=0.0)),
                     act=_get(cfg, "hidden_act", default="silu"), rotary_dim=hd, norm_topk=True, **c)


def qwen_moe(cfg: dict, name: str) -> ModelSpec:
    """Qwen2MoeForCausalLM / Qwen3MoeForCausalLM: sparse layers every decoder_sparse_step (not in mlp_only_layers),
    each with router, E experts, and (Qwen2-MoE) one gated shared expert."""
    mt = cfg["model_type"]
    c = _common(cfg)
    h, hd, heads, kv, L = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"], c["layers"]
    inter = _req_int(cfg, "intermediate_size")
    e = _req_int(cfg, "num_experts")
    moe_inter = _req_int(cfg, "moe_intermediate_size")
    qkv_bias = bool(_get(cfg, "qkv_bias", default=True)) if mt == "qwen2_moe" else bool(_get(cfg, "attention_bias", default=False))
    attn = _gqa_attn(h, heads, kv, hd, qkv_bias, False)
    norms = 2 * h + (2 * hd if mt == "qwen3_moe" else 0)
    sparse = (Linear("gate", h, e, role="router"),) + _gated_mlp(h, moe_inter, role="expert", count=e)
    if mt == "qwen2_moe":
        sh = _req_int(cfg, "shared_expert_intermediate_size")
        sparse += _gated_mlp(h, sh, role="shared") + (Linear("shared_expert_gate", h, 1, role="router"),)
    step = _get(cfg, "decoder_sparse_step", default=1)
    only = set(_get(cfg, "mlp_only_layers", default=[]) or [])
    n_sparse = sum(1 for i in range(L) if i not in only and (i + 1) % step == 0)
    groups = ((n_sparse, LayerSpec(attn + sparse, norms)),)
    if L - n_sparse:
        groups += ((L - n_sparse, LayerSpec(attn + _gated_mlp(h, inter), norms)),)
    tie = bool(_get(cfg, "tie_word_embeddings", default=False))
    return ModelSpec(name=name, model_type=mt, v_head_dim=hd, intermediate=inter, tie_embeddings=tie, gated_mlp=True,
                     layer_groups=groups, embed_params=c["vocab"] * h, head_params=h + (0 if tie else c["vocab"] * h),
                     n_experts=e, experts_per_token=_req_int(cfg, "num_experts_per_tok"),
                     attn_dropout=float(_get(cfg, "attention_dropout", default=0.0)),
                     act=_get(cfg, "hidden_act", default="silu"), rotary_dim=hd,
                     norm_topk=bool(_get(cfg, "norm_topk_prob", default=False)), **c)


def deepseek(cfg: dict, name: str) -> ModelSpec:
    """DeepseekV2/V3ForCausalLM: Multi-head Latent Attention (arXiv 2405.04434 sec. 2.1) + DeepSeekMoE.

    The first `first_k_dense_replace` layers are dense; the rest hold a router (weight only; V3's
    e_score_correction_bias is a buffer), E routed experts and n_shared_experts fused into one shared MLP.
    The multi-token-prediction module of V3 is not built by transformers and is not counted.
    """
    mt = cfg["model_type"]
    c = _common(cfg)
    h, heads, L = c["hidden"], c["heads"], c["layers"]
    nope, rope = _req_int(cfg, "qk_nope_head_dim"), _req_int(cfg, "qk_rope_head_dim")
    vhd, kvr = _req_int(cfg, "v_head_dim"), _req_int(cfg, "kv_lora_rank")
    qr = _get(cfg, "q_lora_rank")
    ab = bool(_get(cfg, "attention_bias", default=False))
    qk = nope + rope
    if qr:
        q = (Linear("q_a_proj", h, qr, ab), Linear("q_b_proj", qr, heads * qk))
    else:
        q = (Linear("q_proj", h, heads * qk),)
    attn = q + (Linear("kv_a_proj_with_mqa", h, kvr + rope, ab), Linear("kv_b_proj", kvr, heads * (nope + vhd)),
                Linear("o_proj", heads * vhd, h, ab))
    norms = 2 * h + kvr + (qr or 0)
    inter, moe_inter = _req_int(cfg, "intermediate_size"), _req_int(cfg, "moe_intermediate_size")
    e, shared = _req_int(cfg, "n_routed_experts"), _get(cfg, "n_shared_experts", default=0) or 0
    k_dense = min(L, _get(cfg, "first_k_dense_replace", default=0))
    sparse = (Linear("gate", h, e, role="router"),) + _gated_mlp(h, moe_inter, role="expert", count=e)
    if shared:
        sparse += _gated_mlp(h, moe_inter * shared, role="shared")
    groups = ()
    if k_dense:
        groups += ((k_dense, LayerSpec(attn + _gated_mlp(h, inter), norms)),)
    if L - k_dense:
        groups += ((L - k_dense, LayerSpec(attn + sparse, norms)),)
    tie = bool(_get(cfg, "tie_word_embeddings", default=False))
    c.update(head_dim=qk, kv_heads=heads)
    return ModelSpec(name=name, model_type=mt, v_head_dim=vhd, intermediate=inter, tie_embeddings=tie, gated_mlp=True,
                     layer_groups=groups, embed_params=c["vocab"] * h, head_params=h + (0 if tie else c["vocab"] * h),
                     n_experts=e, experts_per_token=_req_int(cfg, "num_experts_per_tok"), kv_lora_rank=kvr,
                     qk_rope_head_dim=rope, attn_dropout=float(_get(cfg, "attention_dropout", default=0.0)),
                     act=_get(cfg, "hidden_act", default="silu"), rotary_dim=rope,
                     norm_topk=bool(_get(cfg, "norm_topk_prob", default=True)), **c)


def bert(cfg: dict, name: str) -> ModelSpec:
    """BertForMaskedLM: word + position + token-type embeddings with LayerNorm; post-LN layers with biases;
    MLM head = dense + LayerNorm + decoder tied to the word embeddings + output bias (no pooler)."""
    c = _common(cfg)
    h, v = c["hidden"], c["vocab"]
    inter = _req_int(cfg, "intermediate_size")
    layer = LayerSpec((Linear("query", h, h, True), Linear("key", h, h, True), Linear("value", h, h, True),
                       Linear("attention.output.dense", h, h, True), Linear("intermediate.dense", h, inter, True, role="mlp"),
                       Linear("output.dense", inter, h, True, role="mlp")), 4 * h)
    types = _get(cfg, "type_vocab_size", default=2)
    return ModelSpec(name=name, model_type="bert", v_head_dim=c["head_dim"], intermediate=inter, tie_embeddings=True,
                     gated_mlp=False, layer_groups=((c["layers"], layer),),
                     embed_params=(v + c["max_positions"] + types) * h + 2 * h,
                     head_params=h * h + h + 2 * h + v, norm_kind="layer", causal=False, learned_positions=True,
                     attn_dropout=float(_get(cfg, "attention_probs_dropout_prob", default=0.1)),
                     hidden_dropout=float(_get(cfg, "hidden_dropout_prob", default=0.1)),
                     act=_get(cfg, "hidden_act", default="gelu"),
                     embed_dropout=float(_get(cfg, "hidden_dropout_prob", default=0.1)), **c)


BUILDERS = {
    "llama": llama_like, "mistral": llama_like, "qwen2": llama_like, "qwen3": llama_like,
    "gemma": llama_like, "gemma2": llama_like, "phi3": phi3, "gpt2": gpt2, "gpt_neox": gpt_neox,
    "falcon": falcon, "opt": opt, "mixtral": mixtral, "qwen2_moe": qwen_moe, "qwen3_moe": qwen_moe,
    "deepseek_v2": deepseek, "deepseek_v3": deepseek, "bert": bert,
}
