"""Per-family composition of what one layer (and the model outside its layers) keeps for backward.

Each function below follows the forward of one transformers 5.x module, in order, and lists the tensors the
rules of tests/crosscheck/layer_saved.py say autograd keeps: which Linears read which tensor, which tensors need a
gradient (the first layer under LoRA: none of its input's), the family's attention layout. The tables in
docs/activations.md are these lists, evaluated per token per layer.
"""
from __future__ import annotations

from functools import lru_cache

from crosscheck.layer_saved import (LAYOUTS, Ctx, Saved, _heads, attention, context, dense_mlp, dropout_mask,
                                   gated_mlp, layer_norm, linear_inputs, moe, rms_norm, routed_width,
                                   shared_width)
from crosscheck.model import ModelSpec
from estimator.spec import Workload
from estimator.units import dtype_bytes


def _ffn(model: ModelSpec, ctx: Ctx, ls, grad_in: bool) -> list[Saved]:
    """The feed-forward block of a Llama-style layer after its norm: dense SwiGLU, or router + experts
    (+ Qwen2-MoE's gated shared expert, DeepSeek's shared experts), with the norm output's consumers."""
    h, r, tp = model.hidden, ctx.r, ctx.tp
    routed, shared = routed_width(ls), shared_width(ls)
    if not routed:
        ups = ("gate_up_proj",) if model.model_type == "phi3" else ("gate_proj", "up_proj")
        return (linear_inputs(ctx, ups, h, r, "pre-MLP norm output", norm_out=True)
                + gated_mlp(ctx, model.intermediate // tp, grad_in, ups, "down_proj", model.act))
    gated = model.model_type == "qwen2_moe"
    deepseek = model.model_type in ("deepseek_v2", "deepseek_v3")
    readers = (("gate",) * (not deepseek) + (("gate_proj", "up_proj") if shared else ())
               + (("shared_expert_gate",) if gated else ()))
    out = linear_inputs(ctx, readers, h, r, "pre-MLP norm output", norm_out=True)
    out += moe(model, ctx, routed // tp, grad_in)
    if deepseek:  # F.linear(hidden.float(), weight.float()): an fp32 copy (autocast: a half cast) of the input
        out.append(Saved("router input (fp32 copy)", (ctx.a if ctx.amp else 4) * h if ctx.full else 0))
    if shared:
        out += gated_mlp(ctx, shared // tp, grad_in, ("gate_proj", "up_proj"), "down_proj", model.act)
    if gated:  # sigmoid(shared_expert_gate(x)) * shared_expert(x): both factors saved
        out.append(Saved("shared expert output and its sigmoid gate", ctx.a * (h + 1) if grad_in else 0))
    return out


def _qk_norms(model: ModelSpec, ctx: Ctx, qg: bool, kg: bool) -> list[Saved]:
    """Qwen3's per-head RMSNorm on q and k (before RoPE)."""
    if model.model_type not in ("qwen3", "qwen3_moe"):
        return []
    nh, kv, hd, _ = _heads(model, ctx)
    out = []
    for heads, g, name in ((nh, qg, "q_norm"), (kv, kg, "k_norm")):
        if g:
            out += [Saved(f"{name}: fp32 input, rsqrt", 4 * heads * hd + 4 * heads),  # normalised in q/k's half dtype
                    Saved(f"{name}: normalised", ctx.a * heads * hd if ctx.full else 0)]
    return out


def llama_layer(model: ModelSpec, ctx: Ctx, ls) -> list[Saved]:
    """Llama, Mistral, Qwen2/3, Gemma(-2), Phi-3, Mixtral, Qwen-MoE: pre-RMSNorm attention + SwiGLU or MoE.
    Gemma-2 adds post-attention and post-feedforward norms (four per layer)."""
    h, r, x = model.hidden, ctx.r, ctx.x_grad
    gemma, gemma2 = model.model_type in ("gemma", "gemma2"), model.model_type == "gemma2"
    fused = model.model_type == "phi3"
    names = ("qkv_proj",) * 3 if fused else ("q_proj", "k_proj", "v_proj")
    qg, kg, vg = (x or ctx.trains(n) for n in names)
    out = rms_norm(ctx, h, x, "input_layernorm", gemma)
    out += linear_inputs(ctx, names[:1] if fused else names, h, r, "input_layernorm output", norm_out=True)
    out += _qk_norms(model, ctx, qg, kg)
    out += attention(model, ctx, LAYOUTS["phi3" if fused else "llama"], (qg, kg, vg), "o_proj")
    attn_g = qg or kg or vg or ctx.trains("o_proj")
    if gemma2:
        out += rms_norm(ctx, h, attn_g, "post_attention_layernorm", gemma)
    h_g = x or attn_g
    out += rms_norm(ctx, h, h_g, "pre_feedforward_layernorm" if gemma2 else "post_attention_layernorm", gemma)
    out += _ffn(model, ctx, ls, h_g)
    if gemma2:
        out += rms_norm(ctx, h, h_g, "post_feedforward_layernorm", gemma)
    return out + dropout_mask(ctx, 2 * h, h_g, "residual (x2)")


def neox_layer(model: ModelSpec, ctx: Ctx, ls) -> list[Saved]:
    """GPTNeoXLayer: fused query_key_value, partial RoPE through cat, LayerNorm. With the parallel residual both
    LayerNorms read the layer input, which is saved once; post_attention_layernorm's output feeds the MLP."""
    h, r, x, tp = model.hidden, ctx.r, ctx.x_grad, ctx.tp
    g = x or ctx.trains("query_key_value")
    out = layer_norm(ctx, h, x, "input_layernorm")
    out += linear_inputs(ctx, ("query_key_value",), h, r, "input_layernorm output", norm_out=True)
    out += attention(model, ctx, LAYOUTS["gpt_neox"], (g, g, g), "dense")
    attn_g = g or ctx.trains("dense")
    mlp_g = x if model.parallel_residual else x or attn_g
    out += layer_norm(ctx, h, mlp_g, "post_attention_layernorm", with_input=not model.parallel_residual)
    out += linear_inputs(ctx, ("dense_h_to_4h",), h, r, "post_attention_layernorm output", norm_out=True)
    out += dense_mlp(ctx, model.intermediate // tp, mlp_g, "dense_h_to_4h", "dense_4h_to_h", model.act)
    return out + dropout_mask(ctx, h, attn_g, "post-attention") + dropout_mask(ctx, h, mlp_g, "post-MLP")


def falcon_layer(model: ModelSpec, ctx: Ctx, ls) -> list[Saved]:
    """FalconDecoderLayer (parallel attention): one LayerNorm feeds both query_key_value and dense_h_to_4h
    (two, ln_attn and ln_mlp, in the new decoder architecture), multi-query attention."""
    h, r, x, tp = model.hidden, ctx.r, ctx.x_grad, ctx.tp
    two_norms = ls.norm_params >= 4 * h
    g = x or ctx.trains("query_key_value")
    out = layer_norm(ctx, h, x, "ln_attn" if two_norms else "input_layernorm")
    readers = ("query_key_value",) if two_norms or not model.parallel_residual else ("query_key_value", "dense_h_to_4h")
    out += linear_inputs(ctx, readers, h, r, "layernorm output", norm_out=True)
    out += attention(model, ctx, LAYOUTS["falcon"], (g, g, g), "dense")
    mlp_g = x if model.parallel_residual else x or g or ctx.trains("dense")
    if two_norms or not model.parallel_residual:
        out += layer_norm(ctx, h, mlp_g, "ln_mlp", with_input=not model.parallel_residual)
        out += linear_inputs(ctx, ("dense_h_to_4h",), h, r, "ln_mlp output", norm_out=True)
    return out + dense_mlp(ctx, model.intermediate // tp, mlp_g, "dense_h_to_4h", "dense_4h_to_h", model.act)


def opt_layer(model: ModelSpec, ctx: Ctx, ls) -> list[Saved]:
    """OPTDecoderLayer (pre-LayerNorm): q = q_proj(x) * scaling, ReLU MLP, dropout on both residual branches."""
    h, r, x, tp = model.hidden, ctx.r, ctx.x_grad, ctx.tp
    names = ("q_proj", "k_proj", "v_proj")
    qg, kg, vg = (x or ctx.trains(n) for n in names)
    out = layer_norm(ctx, h, x, "self_attn_layer_norm")
    out += linear_inputs(ctx, names, h, r, "self_attn_layer_norm output", norm_out=True)
    out += attention(model, ctx, LAYOUTS["opt"], (qg, kg, vg), "out_proj")
    h_g = x or qg or kg or vg or ctx.trains("out_proj")
    out += dropout_mask(ctx, h, h_g, "attention residual") + layer_norm(ctx, h, h_g, "final_layer_norm")
    out += linear_inputs(ctx, ("fc1",), h, r, "final_layer_norm output", norm_out=True)
    return out + dense_mlp(ctx, model.intermediate // tp, h_g, "fc1", "fc2", model.act) + \
        dropout_mask(ctx, h, h_g, "MLP residual")


def gpt2_layer(model: ModelSpec, ctx: Ctx, ls) -> list[Saved]:
    """GPT2Block: ln_1, Conv1D c_attn (q, k, v are views of its output), c_proj, ln_2, c_fc, gelu_new,
    mlp.c_proj; dropout after attention and after the MLP (and on the probabilities)."""
    h, r, x, tp = model.hidden, ctx.r, ctx.x_grad, ctx.tp
    g = x or ctx.trains("c_attn")
    out = layer_norm(ctx, h, x, "ln_1") + linear_inputs(ctx, ("c_attn",), h, r, "ln_1 output", norm_out=True)
    out += attention(model, ctx, LAYOUTS["gpt2"], (g, g, g), "c_proj")
    h_g = x or g or ctx.trains("c_proj")
    out += dropout_mask(ctx, h, h_g, "attention residual") + layer_norm(ctx, h, h_g, "ln_2")
    out += linear_inputs(ctx, ("c_fc",), h, r, "ln_2 output", norm_out=True)
    return out + dense_mlp(ctx, model.intermediate // tp, h_g, "c_fc", "mlp.c_proj", model.act) + \
        dropout_mask(ctx, h, h_g, "MLP residual")


def bert_layer(model: ModelSpec, ctx: Ctx, ls) -> list[Saved]:
    """BertLayer (post-LayerNorm): the layer input (the previous LayerNorm's output) feeds query/key/value;
    each sub-block ends in dropout, residual add and LayerNorm; GELU MLP."""
    h, r, x, tp = model.hidden, ctx.r, ctx.x_grad, ctx.tp
    names = ("query", "key", "value")
    qg, kg, vg = (x or ctx.trains(n) for n in names)
    out = linear_inputs(ctx, names, h, r, "layer input", norm_out=True)
    out += attention(model, ctx, LAYOUTS["bert"], (qg, kg, vg), "attention.output.dense")
    h_g = x or qg or kg or vg or ctx.trains("attention.output.dense")
    out += dropout_mask(ctx, h, h_g, "attention output") + layer_norm(ctx, h, h_g, "attention.output.LayerNorm")
    out += linear_inputs(ctx, ("intermediate.dense",), h, r, "attention.output.LayerNorm output", norm_out=True)
    out += dense_mlp(ctx, model.intermediate // tp, h_g, "intermediate.dense", "output.dense", model.act)
    return out + dropout_mask(ctx, h, h_g, "output") + layer_norm(ctx, h, h_g, "output.LayerNorm")


def _mla(model: ModelSpec, ctx: Ctx, qg: bool, kg: bool) -> list[Saved]:
    """DeepSeek Multi-head Latent Attention core: q = cat(q_pass, RoPE(q_rot)) and k (a new_empty filled with
    k_nope and the shared RoPE key) are new (b, heads, s, qk) tensors; v is a view of kv_b_proj's output, which
    it keeps whole. q/k and v head sizes differ, so no flash kernel: on CUDA SDPA runs the memory-efficient
    one (q, k, v, output, logsumexp; output laid out (b, s, heads, d): no copy); the CPU picks the math kernel."""
    nh, qk, vd, a, s = max(1, model.heads // ctx.tp), model.head_dim, model.v_head_dim, ctx.a, ctx.seq
    kv_b = a * nh * (qk - model.qk_rope_head_dim + vd)
    if not (qg or kg):
        return linear_inputs(ctx, ("o_proj",), nh * vd, a, "attention output")
    if ctx.selective:  # held: q (fp32 under autocast: cat of a half view and the fp32 RoPE), k, kv_b output
        held = (4 if ctx.amp else a) * nh * qk + a * nh * qk + kv_b
        return [Saved("q, k, kv_b output (held by the checkpoint)", held)] + \
            linear_inputs(ctx, ("o_proj",), nh * vd, a, "attention output")
    if ctx.eager:
        out = [Saved("q (cat), k (new_empty)", a * nh * qk * (kg + qg)), Saved("softmax output (fp32)", 4 * nh * s),
               Saved("half copy of the probabilities", a * nh * s), Saved("v copy", a * nh * vd)]
        return out + linear_inputs(ctx, ("o_proj",), nh * vd, a, "attention output copy")
    out = [Saved("q, k", 2 * a * nh * qk), Saved("kv_b_proj output (via v's view)", kv_b),
           Saved("SDPA output", a * nh * vd), Saved("SDPA logsumexp (fp32)", 4 * nh)]
    return out + linear_inputs(ctx, ("o_proj",), nh * vd, a, "attention output", kept=True)


def deepseek_layer(model: ModelSpec, ctx: Ctx, ls) -> list[Saved]:
    """DeepseekV3DecoderLayer: RMSNorm -> MLA (q_a_proj + q_a_layernorm + q_b_proj, kv_a_proj_with_mqa +
    kv_a_layernorm + kv_b_proj) -> RMSNorm -> dense SwiGLU or DeepSeekMoE (sigmoid router in fp32, routed
    experts, shared experts)."""
    h, r, x = model.hidden, ctx.r, ctx.x_grad
    qr = next((lin.out_features for lin in ls.linears if lin.name == "q_a_proj"), 0)
    kvr = model.kv_lora_rank
    q_names = ("q_a_proj", "q_b_proj") if qr else ("q_proj",)
    qg = x or any(ctx.trains(n) for n in q_names)
    kg = x or ctx.trains("kv_a_proj_with_mqa") or ctx.trains("kv_b_proj")
    out = rms_norm(ctx, h, x, "input_layernorm")
    out += linear_inputs(ctx, (q_names[0], "kv_a_proj_with_mqa"), h, r, "input_layernorm output", norm_out=True)
    if qr:
        out += rms_norm(ctx, qr, x or ctx.trains("q_a_proj"), "q_a_layernorm", half_in=True)
        out += linear_inputs(ctx, ("q_b_proj",), qr, r, "q_a_layernorm output", norm_out=True)
    out += rms_norm(ctx, kvr, x or ctx.trains("kv_a_proj_with_mqa"), "kv_a_layernorm", half_in=True)
    out += linear_inputs(ctx, ("kv_b_proj",), kvr, r, "kv_a_layernorm output", norm_out=True) + _mla(model, ctx, qg, kg)
    h_g = x or qg or kg or ctx.trains("o_proj")
    out += rms_norm(ctx, h, h_g, "post_attention_layernorm")
    return out + _ffn(model, ctx, ls, h_g)


FAMILY_LAYERS = {"llama": llama_layer, "mistral": llama_layer, "qwen2": llama_layer, "qwen3": llama_layer,
                 "gemma": llama_layer, "gemma2": llama_layer, "phi3": llama_layer, "mixtral": llama_layer,
                 "qwen2_moe": llama_layer, "qwen3_moe": llama_layer, "gpt_neox": neox_layer,
                 "falcon": falcon_layer, "opt": opt_layer, "gpt2": gpt2_layer, "bert": bert_layer,
                 "deepseek_v2": deepseek_layer, "deepseek_v3": deepseek_layer}


@lru_cache(maxsize=8192)  # pure in frozen, hashable specs: estimate() asks for the same inventories per moment
def layer_inventory(model: ModelSpec, w: Workload, seq: int, tp: int = 1, sp: bool = False, first: bool = False,
                    group: int = 0) -> tuple[Saved, ...]:
    """Every tensor one layer of layer group `group` saves for backward (zero-byte entries dropped).
    first=True: the model's first layer, whose input needs no gradient when the embeddings are frozen (LoRA)."""
    ctx = context(model, w, seq, tp, sp, first)
    ls = model.layer_groups[group][1]
    items = FAMILY_LAYERS[model.model_type](model, ctx, ls)
    if sp and tp > 1:  # sequence parallelism: the norm/dropout region holds 1/tp of the sequence
        items = [Saved(s.what, s.per_token // tp, s.fixed, True) if s.seq_sharded else s for s in items]
    return tuple(s for s in items if s.per_token or s.fixed)


# -- outside the layers -----------------------------------------------------------------------------------------
_FINAL_NORM = {"gpt_neox": "final_layer_norm", "falcon": "ln_f", "opt": "final_layer_norm", "gpt2": "ln_f"}


@lru_cache(maxsize=8192)  # pure in frozen, hashable specs: estimate() asks for the same inventories per moment
def head_inventory(model: ModelSpec, w: Workload, tp: int = 1) -> tuple[Saved, ...]:
    """What the last pipeline stage saves after the layers: the final norm, the LM head's input, Gemma-2's
    logit soft-capping and the loss's log-softmax output (fp32 for causal LMs: ForCausalLMLoss upcasts the
    logits; BERT's MLM loss takes them as they are, fp32 only under autocast's log_softmax policy)."""
    ctx = context(model, w, w.seq, tp)
    h, r, a, v = model.hidden, ctx.r, ctx.a, model.vocab // tp
    if not model.causal:
        return tuple(s for s in _mlm_head(model, ctx) if s.per_token or s.fixed)
    if model.norm_kind == "rms":
        out = rms_norm(ctx, h, True, "final norm", gemma=model.model_type in ("gemma", "gemma2"))
    else:
        out = layer_norm(ctx, h, True, _FINAL_NORM.get(model.model_type, "final norm"))
    out += linear_inputs(ctx, ("lm_head",), h, r, "final norm output", norm_out=True)
    out += [Saved("tanh of soft-capped logits", a * v if model.logit_softcap else 0),
            Saved("log_softmax output (fp32)", 4 * v)]
    return tuple(s for s in out if s.per_token or s.fixed)


def _mlm_head(model: ModelSpec, ctx: Ctx) -> list[Saved]:
    """BertForMaskedLM's head: transform (dense, GELU, LayerNorm), the tied decoder, CrossEntropyLoss."""
    h, r, a, v = model.hidden, ctx.r, ctx.a, model.vocab // ctx.tp
    out = linear_inputs(ctx, ("dense",), h, r, "last layer output")
    out += [Saved("transform.dense output (GELU input)", a * h)] + layer_norm(ctx, h, True, "transform.LayerNorm")
    out += linear_inputs(ctx, ("decoder",), h, r, "transform output")
    return out + [Saved("log_softmax output", (4 if ctx.amp else a) * v)]


@lru_cache(maxsize=8192)  # pure in frozen, hashable specs: estimate() asks for the same inventories per moment
def embed_inventory(model: ModelSpec, w: Workload, tp: int = 1) -> tuple[Saved, ...]:
    """What the first pipeline stage saves before the layers, when the embeddings train (full fine-tuning):
    position/token-type index tensors, BERT's embedding LayerNorm, embedding dropout; plus RoPE's cos and
    sin, shape (1, s, rotary_dim) in the residual dtype, read by every layer."""
    ctx = context(model, w, w.seq, tp)
    s, h, full = w.seq, model.hidden, ctx.full
    out = [Saved("RoPE cos, sin", 0, 2 * s * model.rotary_dim * ctx.r)]
    if model.model_type == "gpt2":
        out.append(Saved("position ids (int64, one row)", 0, 8 * s if full else 0))
    elif model.model_type == "opt":
        out.append(Saved("position ids (int64, cumsum of the mask)", 8 if full else 0))
    elif model.model_type == "bert":
        out += [Saved("token type ids (int64, one row)", 0, 8 * s if full else 0)]
        out += layer_norm(ctx, h, full, "embeddings.LayerNorm")
    if model.embed_dropout > 0 and full:
        out.append(Saved("embedding dropout mask", h))
    return tuple(x for x in out if x.per_token or x.fixed)


# -- autocast weight copies (estimator.activations.autocast_weight_bytes) --------------------------------------
# Linears that read the first layer's input (directly, or through a frozen path that stays gradient-free under
# LoRA), per family: under LoRA their frozen weights' casts are not kept (the Linear saves its weight only for
# the input's gradient).
_FIRST_LAYER_READERS = {"gpt_neox": ("query_key_value", "dense_h_to_4h", "dense_4h_to_h"),
                        "falcon": ("query_key_value", "dense_h_to_4h", "dense_4h_to_h"),
                        "phi3": ("qkv_proj",), "gpt2": ("c_attn",), "bert": ("query", "key", "value"),
                        "deepseek_v2": ("q_proj", "q_a_proj", "kv_a_proj_with_mqa"),
                        "deepseek_v3": ("q_proj", "q_a_proj", "kv_a_proj_with_mqa")}


def first_layer_frozen_inputs(model: ModelSpec, w: Workload) -> int:
    """Weight parameters of the first layer's Linears whose input needs no gradient under LoRA."""
    names = _FIRST_LAYER_READERS.get(model.model_type, ("q_proj", "k_proj", "v_proj"))
    if model.model_type in ("gpt_neox", "falcon") and not model.parallel_residual:
        names = names[:1]
    ls0 = model.layer_groups[0][1]
    return sum(lin.in_features * lin.out_features for lin in ls0.linears if lin.name.split(".")[-1] in names
               and lin.role != "expert")


def lora_adapter_params(model: ModelSpec, w: Workload) -> tuple[int, int]:
    """(all LoRA adapter parameters, those of the first layer's lora_A matrices that read its input): autocast
    caches every adapter cast during the forward, but keeps the latter only while the forward runs."""
    targets = set(w.lora_targets)
    first = set(_FIRST_LAYER_READERS.get(model.model_type, ("q_proj", "k_proj", "v_proj"))[:3])
    total = first_a = 0
    for n, lin in model.linears():
        if lin.role != "expert" and lin.name.split(".")[-1] in targets:
            total += n * w.lora_rank * (lin.in_features + lin.out_features)
    for lin in model.layer_groups[0][1].linears:
        if lin.role != "expert" and lin.name.split(".")[-1] in targets & first:
            first_a += w.lora_rank * lin.in_features
    return total, first_a


@lru_cache(maxsize=8192)  # pure in frozen, hashable specs: estimate() asks for the same inventories per moment
def mlp_backward_extra(model: ModelSpec, w: Workload, tp: int = 1) -> int:
    """Bytes per token the first layer's MLP backward adds over its saved tensors at its peak: the MLP of the
    last layer backward reaches, with every later layer's gradients already accumulated.

    SwiGLU: down_proj's backward makes grad(act * up) (I wide), then MulBackward makes grad(act) and grad(up)
    while it lives: 3*I, less the product down_proj saved (freed once its backward ran) when down trains.
    GELU/ReLU MLP: fc2's backward makes grad(act), the activation's backward grad(fc1): 2*I, less fc2's saved
    input (a GELU output; ReLU's output stays saved for the ReLU). Routed experts: the same per routed copy
    (k of them, in the experts' dtype)."""
    a = dtype_bytes(w.precision)
    ctx = context(model, w, w.seq, tp)
    ls0 = model.layer_groups[0][1]
    routed, shared = routed_width(ls0), shared_width(ls0)
    if model.gated_mlp:
        experts = routed * model.experts_per_token * (4 if ctx.amp else a) // a  # in half-precision units
        width = experts + shared if routed else model.intermediate
        return a * (width // tp) * (3 - (1 if ctx.trains("down_proj") and not routed else 0))
    width = model.intermediate // tp
    down = {"gpt2": "mlp.c_proj", "opt": "fc2", "bert": "output.dense"}.get(model.model_type, "dense_4h_to_h")
    kept = model.act != "relu" and ctx.trains(down)
    return a * width * (2 - (1 if kept else 0))


def first_layer_trainable(model: ModelSpec, w: Workload) -> tuple[int, int]:
    """(trainable parameters of the first layer, of which its MLP output projection): at the first layer's MLP
    backward every other layer's gradients exist, this layer's only for that projection."""
    ls0 = model.layer_groups[0][1]
    down = ("down_proj", "dense_4h_to_h", "fc2", "mlp.c_proj", "output.dense")
    if w.method == "full":
        total = ls0.params
        out = sum(lin.params for lin in ls0.linears if lin.name in down and lin.role not in ("shared",))
        return total, out
    targets, total, out = set(w.lora_targets), 0, 0
    for lin in ls0.linears:
        if lin.role != "expert" and lin.name.split(".")[-1] in targets:
            p = w.lora_rank * (lin.in_features + lin.out_features)
            total += p
            out += p if lin.name in down else 0
    return total, out


def first_layer_weights(model: ModelSpec) -> tuple[int, int]:
    """(weight parameters of the first layer's Linears, of its MLP output projection), routed experts excluded."""
    ls0 = model.layer_groups[0][1]
    down = ("down_proj", "dense_4h_to_h", "fc2", "mlp.c_proj", "output.dense")
    lins = [lin for lin in ls0.linears if lin.role != "expert"]
    return (sum(lin.count * lin.in_features * lin.out_features for lin in lins),
            sum(lin.count * lin.in_features * lin.out_features for lin in lins if lin.name in down))
