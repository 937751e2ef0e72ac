"""Working set of one layer's forward pass without saved tensors, op by op: inference prefill and decode, and
a layer's forward under full activation checkpointing.

Without saved tensors, what decides the peak is which intermediates are alive together inside one layer:
e.g. eager attention at the softmax (the masked scores, their fp32 copy and the fp32 output, 10 bytes per
score in bf16), or a SwiGLU MLP at act(gate) * up (three I-wide tensors). Each family function below replays
the op order of its transformers 5.x module on a `Tape` that tracks live bytes: an op output is allocated, and a
tensor is dropped when its last Python reference goes (a reassigned local, a returned function). What stays
alive across the whole forward (the embedding output the model loop keeps, the layer input held by the caller,
RoPE cos/sin, the eager causal mask) is the tape's base. Sizes are bytes for the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from crosscheck.layer_saved import routed_width, shared_width
from crosscheck.model import ModelSpec


class Tape:
    """Live bytes along a sequence of ops; `peak` is the largest total seen."""

    def __init__(self, base: int = 0) -> None:
        self.live: dict[str, int] = {}
        self.cur = self.peak = base

    def new(self, name: str, nbytes: int) -> None:
        self.live[name] = self.live.get(name, 0) + nbytes
        self.cur += nbytes
        self.peak = max(self.peak, self.cur)

    def free(self, *names: str) -> None:
        for n in names:
            self.cur -= self.live.pop(n, 0)


@dataclass(frozen=True)
class Fwd:
    """Shapes and dtypes of one no-grad forward step."""

    a: int          # bytes of the model dtype
    b: int          # batch
    q: int          # query tokens this step (prompt length in prefill, 1 in decode)
    kv: int         # key/value length after this step's cache update
    eager: bool
    tp: int = 1
    cat: int = 0    # decode: one layer's old keys (or values), alive while DynamicCache's torch.cat copies them
    cached: bool = True  # k/v come from a KV cache (contiguous); False: a checkpointed training forward, where
                         # k/v are the RoPE/projection outputs laid out (b, s, heads, d) and matmul copies them

    @property
    def t(self) -> int:  # tokens this step
        return self.b * self.q


def _rms(t: Tape, f: Fwd, h: int, gemma: bool = False) -> None:
    """LlamaRMSNorm / GemmaRMSNorm on a half input: fp32 copy, x^2, x*rsqrt, cast back, times the weight."""
    n = f.t * h
    t.new("n32", 4 * n), t.new("pow", 4 * n), t.free("pow")
    t.new("normed", 4 * n), t.free("n32")
    if gemma:  # output * (1 + weight.float()) in fp32, then type_as(x)
        t.new("scaled", 4 * n), t.free("normed"), t.new("norm_out", f.a * n), t.free("scaled")
    else:
        t.new("cast", f.a * n), t.new("norm_out", f.a * n), t.free("cast", "normed")


def _layer_norm(t: Tape, f: Fwd, h: int, name: str = "norm_out") -> None:
    """nn.LayerNorm: output, plus fp32 mean and rstd (freed at once)."""
    t.new(name, f.a * f.t * h)


def _rope(t: Tape, f: Fwd, width: int, cat: bool, name: str) -> None:
    """q * cos + rotate_half(q) * sin (rotate_half: a negated half and a cat); the partial-rotary form
    slices, rotates the first part and cats it back with the pass-through part."""
    n = f.a * f.t * width
    t.new(name + "_cos", n), t.new(name + "_neg", n // 2), t.new(name + "_rot", n), t.free(name + "_neg")
    t.new(name + "_sin", n), t.free(name + "_rot")
    t.new(name + "_emb", n), t.free(name + "_cos", name + "_sin")
    if cat:
        t.new(name + "_cat", n), t.free(name + "_emb")


def _core(t: Tape, f: Fwd, nh: int, kv_heads: int, hd: int, vd: int, softcap: bool, softmax32: bool,
          q_view_ok: bool = False) -> None:
    """The attention kernel after RoPE and the cache update, up to 'ctx' (b, s, heads*vd), which it leaves
    alive. SDPA (flash): output and an fp32 logsumexp. Eager: repeat_kv copies, q @ k^T (matmul copies a q
    that is not contiguous per head, and k/v when not repeated), scale, mask, softmax (fp32 cast and output),
    the half probabilities (kept until the attention module returns: they are its second output), @ v and
    the transpose copy."""
    a, s_q, kvl, b = f.a, f.q, f.kv, f.b
    if not f.eager:
        t.new("ctx", a * f.t * nh * vd), t.new("lse", 4 * b * nh * s_q), t.free("lse")
        return
    scores = b * nh * s_q * kvl
    rep = kv_heads < nh
    if rep:
        t.new("k_rep", a * b * nh * kvl * hd), t.new("v_rep", a * b * nh * kvl * vd)
    if not q_view_ok:
        t.new("q_copy", a * f.t * nh * hd)
    t.new("k_copy", 0 if f.cached or rep else a * b * nh * kvl * hd)  # cached k/v are contiguous: viewed
    t.new("qk", a * scores), t.free("q_copy", "k_copy")
    t.new("scaled", a * scores), t.free("qk")
    if softcap:
        t.new("capped", a * scores), t.free("scaled"), t.new("tanh", a * scores), t.free("capped")
        t.new("scaled", a * scores), t.free("tanh")
    t.new("masked", a * scores), t.free("scaled")
    if softmax32:
        t.new("s32", 4 * scores), t.new("probs32", 4 * scores), t.free("s32")
        t.new("probs", a * scores), t.free("probs32", "masked")
    else:
        t.new("probs", a * scores), t.free("masked")
    t.new("v_copy", 0 if f.cached or rep else a * b * nh * kvl * vd)
    t.new("pv", a * f.t * nh * vd), t.free("v_copy")
    t.new("ctx", a * f.t * nh * vd), t.free("pv", "k_rep", "v_rep")


def _gated(t: Tape, f: Fwd, width: int, fused: bool, h: int, out: str = "mlp_out") -> None:
    """down(act(gate(x)) * up(x)); Phi-3: one gate_up output chunked. Leaves `out`."""
    n = f.a * f.t * width
    if fused:
        t.new("gate_up", 2 * n), t.new("act", n), t.new("prod", n), t.free("gate_up", "act")
    else:
        t.new("gate", n), t.new("act", n), t.free("gate"), t.new("up", n), t.new("prod", n), t.free("act", "up")
    t.new(out, f.a * f.t * h), t.free("prod")


def _experts(t: Tape, m: ModelSpec, f: Fwd, width: int) -> None:
    """Router + grouped_mm experts (integrations/moe.py grouped_mm_experts_forward), op by op; its locals
    live until it returns, and the router logits until the block ends (unpacked into `_`). Leaves 'moe_out'."""
    a, n, k, h = f.a, f.t, m.experts_per_token, m.hidden
    wb = 4 if m.model_type == "mixtral" else a  # Qwen casts the top-k weights to the logits' dtype
    t.new("logits", a * n * m.n_experts), t.new("router_probs", 4 * n * m.n_experts)
    t.new("topv", 4 * n * k), t.new("topi", 8 * n * k), t.free("router_probs")
    if wb != 4:
        t.new("topv_h", a * n * k), t.free("topv")
    t.new("sorted", 16 * n * k), t.new("idx", 8 * n * k), t.new("sel", a * n * k * h), t.free("idx")
    t.new("w_g", wb * n * k), t.new("histc_in", 4 * n * k)
    t.new("gate_up", 2 * a * n * k * width), t.new("act", a * n * k * width), t.new("prod", a * n * k * width)
    t.free("gate_up", "act"), t.new("down", a * n * k * h), t.free("prod")
    wo = max(a, wb)  # half output times fp32 routing weights promotes to fp32
    t.new("weighted", wo * n * k * h), t.new("inv", 8 * n * k), t.new("reordered", wo * n * k * h)
    t.free("weighted"), t.new("summed", wo * n * h)
    if wo != a:
        t.new("moe_out", a * n * h), t.free("summed")
    else:
        t.live["moe_out"] = t.live.pop("summed")
    t.free("sel", "w_g", "down", "sorted", "inv", "reordered", "histc_in", "topv", "topv_h", "topi")


def llama_forward(m: ModelSpec, f: Fwd, ls) -> int:
    """Peak of one Llama-family decoder layer beyond its input (Phi-3's fused projections, Gemma-2's four
    norms and softcap, MoE blocks). The current layer's cache update writes into the KV cache (counted there)."""
    a, h, t = f.a, m.hidden, Tape()
    nh, kv, hd, vd = max(1, m.heads // f.tp), max(1, m.kv_heads // f.tp), m.head_dim, m.v_head_dim
    gemma, phi3 = m.model_type in ("gemma", "gemma2"), m.model_type == "phi3"
    _rms(t, f, h, gemma)
    if phi3:
        t.new("qkv", a * f.t * (nh + 2 * kv) * hd)
    else:
        t.new("q", a * f.t * nh * hd), t.new("k", a * f.t * kv * hd), t.new("v", a * f.t * kv * vd)
    _rope(t, f, nh * hd, phi3, "q"), _rope(t, f, kv * hd, phi3, "k")
    t.new("cache_old", f.cat), t.free("cache_old")  # the cache's cat keeps the old copy for a moment
    t.free("q", "k")
    if f.cached:
        t.free("v", "k_emb", "k_cat")  # the cache keeps cat copies of k and v (kv_cache)
    _core(t, f, nh, kv, hd, vd, m.attn_softcap, True, q_view_ok=phi3)
    # eager's probabilities are the attention's second output, unpacked into `_` by the decoder layer: they
    # stay alive until the layer returns
    t.new("attn_out", a * f.t * h), t.free("ctx", "q_emb", "q_cat", "qkv", "k_emb", "k_cat", "v")
    if m.model_type == "gemma2":
        _rms(t, f, h, gemma), t.free("attn_out")
    t.new("h1", a * f.t * h), t.free("attn_out", "norm_out")
    _rms(t, f, h, gemma)
    routed = routed_width(ls)
    if routed:
        if shared_width(ls):
            _gated(t, f, shared_width(ls) // f.tp, False, h, "shared")
        _experts(t, m, f, routed // f.tp)
        if m.model_type == "qwen2_moe":  # sigmoid(shared_expert_gate(x)) * shared_expert(x), then the sum
            t.new("sg", a * f.t), t.new("sig", a * f.t), t.new("gated", a * f.t * h), t.free("sg", "shared", "sig")
            t.new("mlp_out", a * f.t * h)
        t.free("logits")
    else:
        _gated(t, f, m.intermediate // f.tp, phi3, h)
    return t.peak


def _eager_scores(t: Tape, f: Fwd, nh: int, hd: int, q_copy: bool, softmax: int) -> None:
    """q @ k^T (matmul copies a q that is not contiguous per head), scale, add the mask, softmax in `softmax`
    bytes (an fp32 softmax casts its input first), cast back to half: leaves 'probs'."""
    a, scores = f.a, f.b * nh * f.q * f.kv
    t.new("q_copy", a * f.t * nh * hd if q_copy else 0), t.new("qk", a * scores), t.free("q_copy")
    t.new("scaled", a * scores), t.free("qk"), t.new("masked", a * scores), t.free("scaled")
    if softmax == 4:
        t.new("s32", 4 * scores), t.new("probs32", 4 * scores), t.free("s32")
        t.new("probs", a * scores), t.free("probs32", "masked")
    else:
        t.new("probs", a * scores), t.free("masked")


def _dense_mlp(t: Tape, f: Fwd, width: int, h: int, act: str, frees: str = "") -> None:
    """fc1 -> activation -> fc2; GPT-2's gelu_new evaluates 0.5*x first, then pow, 0.044715*pow, ...
    `frees`: the input, when fc1's output replaces its last reference (OPT reassigns `hidden_states`)."""
    n = f.a * f.t * width
    t.new("fc1", n), t.free(frees)
    if act == "gelu_new":
        t.new("half_x", n), t.new("pow", n), t.new("c_pow", n), t.free("pow"), t.new("inner", n), t.free("c_pow")
        t.new("scaled_in", n), t.free("inner"), t.new("tanh", n), t.free("scaled_in"), t.new("one_p", n)
        t.free("tanh"), t.new("act", n), t.free("half_x", "one_p")
    else:
        t.new("act", n)
    t.free("fc1"), t.new("mlp_out", f.a * f.t * h), t.free("act")


def neox_forward(m: ModelSpec, f: Fwd, ls) -> int:
    """GPTNeoXLayer: LN -> fused qkv (kept while the attention runs) -> partial RoPE through cat -> attention
    (SDPA's output is laid out like the cat q, so its transpose is copied) -> dense; the parallel MLP reads a
    second LN of the layer input."""
    a, h, t = f.a, m.hidden, Tape()
    nh, hd = max(1, m.heads // f.tp), m.head_dim
    _layer_norm(t, f, h), t.new("qkv", 3 * a * f.t * nh * hd)
    rot = m.rotary_dim * nh
    for x in ("q", "k"):
        _rope(t, f, rot, False, x), t.new(x + "_cat", a * f.t * nh * hd), t.free(x + "_emb")
    t.new("cache_old", f.cat), t.free("cache_old", "k_cat")
    if f.eager:
        _eager_scores(t, f, nh, hd, False, 4), t.new("pv", a * f.t * nh * hd), t.new("ctx", a * f.t * nh * hd)
        t.free("pv")
    else:
        t.new("kernel_out", a * f.t * nh * hd), t.new("ctx", a * f.t * nh * hd), t.free("kernel_out")
    t.new("attn_out", a * f.t * h), t.free("ctx", "qkv", "q_cat", "norm_out")
    if not m.parallel_residual:
        t.new("h1", a * f.t * h)
    _layer_norm(t, f, h), _dense_mlp(t, f, m.intermediate // f.tp, h, m.act)
    return t.peak


def falcon_forward(m: ModelSpec, f: Fwd, ls) -> int:
    """FalconDecoderLayer (parallel attention, multi-query): fused qkv kept while the attention runs, q made
    contiguous (b, heads, s, d) by a reshape copy. SDPA is the math kernel (kv heads != q heads): fp32 copies of
    q, k, v, the scaled q, fp32 scores and softmax; eager keeps scores and probabilities in the model dtype
    and the previous layer's probabilities stay alive (returned through the layer's output tuple)."""
    a, h, t = f.a, m.hidden, Tape()
    nh, kv, hd = max(1, m.heads // f.tp), max(1, m.kv_heads // f.tp), m.head_dim
    scores = f.b * nh * f.q * f.kv
    # matmul broadcasts the single kv head over the q heads by expand + reshape, which copies unless the
    # batch is 1 (a size-1 batch dim merges with the stride-0 head dim into a view)
    expand = f.b * nh * hd * f.kv if f.b > 1 else 0
    if f.eager:
        t.new("prev_probs", a * scores)
    _layer_norm(t, f, h), t.new("qkv", a * f.t * (nh + 2 * kv) * hd), t.new("q_copy", a * f.t * nh * hd)
    _rope(t, f, nh * hd, False, "q"), t.free("q_copy"), _rope(t, f, kv * hd, False, "k")
    t.new("cache_old", f.cat), t.free("cache_old", "k_emb")
    if f.eager:
        t.new("k_exp", a * expand), t.new("scores", a * scores), t.free("k_exp")
        t.new("masked", a * scores), t.new("probs", a * scores), t.free("masked", "scores")
        t.new("v_exp", a * expand), t.new("pv", a * f.t * nh * hd), t.free("v_exp")
    else:
        # _scaled_dot_product_attention_math: fp32 copies of q, k, v; q and k^T scaled; scores; + mask (out of
        # place); _safe_softmax; a half copy of the weights it also returns; probabilities @ expanded v
        kv_len = f.b * kv * f.kv * hd
        t.new("q32", 4 * f.t * nh * hd), t.new("kv32", 8 * kv_len), t.new("qs", 4 * f.t * nh * hd)
        t.new("ks", 4 * kv_len), t.new("k_exp", 4 * expand), t.new("scores", 4 * scores)
        t.free("ks", "k_exp"), t.new("masked", 4 * scores), t.free("scores")
        t.new("sm", 4 * scores), t.free("masked"), t.new("weights_h", a * scores)
        t.new("v_exp", 4 * expand), t.new("pv32", 4 * f.t * nh * hd), t.free("v_exp")
        t.new("pv", a * f.t * nh * hd), t.free("pv32", "sm", "weights_h", "qs", "q32", "kv32")
    t.new("ctx", a * f.t * nh * hd), t.free("pv"), t.new("attn_out", a * f.t * h), t.free("ctx", "qkv", "q_emb")
    _dense_mlp(t, f, m.intermediate // f.tp, h, m.act)
    return t.peak


def opt_forward(m: ModelSpec, f: Fwd, ls) -> int:
    """OPTDecoderLayer (pre-LN): q = q_proj(x) * scaling, k/v cached, fp32 eager softmax, ReLU MLP."""
    a, h, t = f.a, m.hidden, Tape()
    nh, hd = max(1, m.heads // f.tp), m.head_dim
    _layer_norm(t, f, h), t.new("q_proj", a * f.t * nh * hd), t.new("q", a * f.t * nh * hd), t.free("q_proj")
    t.new("kv_proj", 2 * a * f.t * nh * hd), t.new("cache_old", f.cat), t.free("cache_old", "kv_proj")
    if f.eager:
        _eager_scores(t, f, nh, hd, True, 4), t.new("pv", a * f.t * nh * hd)
        t.new("ctx", a * f.t * nh * hd), t.free("pv")
    else:
        t.new("ctx", a * f.t * nh * hd)
    t.new("attn_out", a * f.t * h), t.free("ctx", "q", "norm_out", "probs")
    t.new("h1", a * f.t * h), t.free("attn_out"), _layer_norm(t, f, h)
    _dense_mlp(t, f, m.intermediate // f.tp, h, m.act, frees="norm_out")
    return t.peak


def gpt2_forward(m: ModelSpec, f: Fwd, ls) -> int:
    """GPT2Block: ln_1 -> c_attn (q, k, v views, kept while the attention runs) -> attention (the eager
    probabilities stay until the block returns) -> c_proj; ln_2 -> c_fc -> gelu_new -> mlp.c_proj."""
    a, h, t = f.a, m.hidden, Tape()
    nh, hd = max(1, m.heads // f.tp), m.head_dim
    _layer_norm(t, f, h), t.new("qkv", 3 * a * f.t * nh * hd), t.new("cache_old", f.cat), t.free("cache_old")
    if f.eager:
        _eager_scores(t, f, nh, hd, True, a), t.new("pv", a * f.t * nh * hd)
    else:
        t.new("pv", a * f.t * nh * hd)
    t.new("ctx", a * f.t * nh * hd), t.free("pv", "qkv"), t.new("attn_out", a * f.t * h), t.free("ctx")
    t.new("h1", a * f.t * h), t.free("norm_out"), _layer_norm(t, f, h)  # attn_output lives to the block's end
    _dense_mlp(t, f, m.intermediate // f.tp, h, m.act)
    return t.peak


def bert_forward(m: ModelSpec, f: Fwd, ls) -> int:
    """BertLayer (post-LN): query/key/value (views), attention (eager probabilities returned up to the layer),
    output dense + LayerNorm(dense + input), intermediate dense + GELU, output dense + LayerNorm."""
    a, h, t = f.a, m.hidden, Tape()
    nh, hd = max(1, m.heads // f.tp), m.head_dim
    t.new("qkv", 3 * a * f.t * nh * hd)
    if f.eager:
        scores = f.b * nh * f.q * f.kv
        t.new("q_copy", a * f.t * nh * hd), t.new("k_copy", a * f.t * nh * hd), t.new("qk", a * scores)
        t.free("q_copy", "k_copy"), t.new("scaled", a * scores), t.free("qk")
        t.new("probs", a * scores), t.free("scaled"), t.new("v_copy", a * f.t * nh * hd)
        t.new("pv", a * f.t * nh * hd), t.free("v_copy"), t.new("ctx", a * f.t * nh * hd), t.free("pv")
    else:
        t.new("ctx", a * f.t * nh * hd)
    t.free("qkv"), t.new("dense", a * f.t * h), t.free("ctx"), t.new("sum", a * f.t * h), t.free("dense")
    _layer_norm(t, f, h, "ln1"), t.free("sum")
    _dense_mlp(t, f, m.intermediate // f.tp, h, m.act)
    return t.peak


def deepseek_forward(m: ModelSpec, f: Fwd, ls) -> int:
    """DeepseekV3DecoderLayer with the latent cache: the q path (q_a, its norm, q_b), the latent path (kv_a,
    its norm), RoPE, q = cat(q_pass, q_rot); kv_b_proj expands the whole cached latent to per-head k/v (b,
    heads, kv, ...) every step, and k is assembled in a new_empty tensor. SDPA here is the memory-efficient
    kernel (CUDA; q/k and v head sizes differ)."""
    a, h, t = f.a, m.hidden, Tape()
    nh, qk, vd, rope, kvr = max(1, m.heads // f.tp), m.head_dim, m.v_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    qr = next((lin.out_features for lin in ls.linears if lin.name == "q_a_proj"), 0)
    _rms(t, f, h)
    if qr:
        t.new("q_a", a * f.t * qr), _rms(Tape(), f, qr), t.new("q_a_n", a * f.t * qr), t.free("q_a")
    t.new("q_b", a * f.t * nh * qk), t.free("q_a_n"), t.new("kv_a", a * f.t * (kvr + rope))
    t.new("kv_n", a * f.t * kvr), _rope(t, f, nh * rope, False, "q"), _rope(t, f, rope, False, "k")
    # q_states (q_b's output) and the rotated q_rot stay referenced until the attention returns
    t.new("q", a * f.t * nh * qk), t.new("cache_old", f.cat), t.free("cache_old", "kv_n")
    t.new("kv_b", a * f.b * f.kv * nh * (qk - rope + vd)), t.new("k", a * f.b * f.kv * nh * qk)
    if f.eager:
        _eager_scores(t, f, nh, qk, False, 4), t.new("v_copy", a * f.b * f.kv * nh * vd)
        t.new("pv", a * f.t * nh * vd), t.free("v_copy"), t.new("ctx", a * f.t * nh * vd), t.free("pv")
    else:
        t.new("ctx", a * f.t * nh * vd), t.new("lse", 4 * f.b * nh * f.q), t.free("lse")
    t.new("attn_out", a * f.t * h), t.free("ctx", "q", "k", "kv_b", "kv_a", "q_b", "q_emb", "k_emb", "norm_out")
    t.new("h1", a * f.t * h), t.free("attn_out"), _rms(t, f, h)
    routed = routed_width(ls)
    if routed:
        _experts(t, m, f, routed // f.tp)
        if shared_width(ls):
            _gated(t, f, shared_width(ls) // f.tp, False, h, "shared")
        t.free("logits")
    else:
        _gated(t, f, m.intermediate // f.tp, False, h)
    return t.peak


_TWO_MASKS = ("gemma2", "qwen2_moe")  # build a full and a sliding-window causal mask, both materialised in eager


@lru_cache(maxsize=8192)  # pure in the frozen model and Fwd
def model_base(m: ModelSpec, f: Fwd) -> int:
    """Alive beside a (non-first) layer: the embedding output(s) the model keeps, the layer's input held by
    the model loop, position ids, RoPE cos/sin (1, s, rotary_dim) each, and the causal mask(s) eager (and
    Falcon's math SDPA) materialise as (b, 1, s, kv) in the model dtype."""
    a, h, mt = f.a, m.hidden, m.model_type
    base = 2 * a * f.t * h + 2 * f.q * m.rotary_dim * a
    base += 0 if mt in ("bert", "opt") else 8 * f.q                 # position ids (1, s) int64
    base += {"gpt2": a * f.q * h, "opt": a * f.t * h + 12 * f.t}.get(mt, 0)  # position embeddings; OPT's
    if m.causal and (f.eager or mt == "falcon"):                   # mask ones and their int64 cast
        base += (2 if mt in _TWO_MASKS else 1) * a * f.b * f.q * f.kv
        base += f.q * f.kv if mt == "falcon" and not f.eager else 0  # Falcon's SDPA path also keeps a bool mask
    elif mt in _TWO_MASKS:  # SDPA: the full mask is is_causal, the sliding one a (1, 1, s, kv) bool
        base += f.q * f.kv
    return base


def _end(m: ModelSpec, f: Fwd) -> int:
    """After the layers: the last hidden state and the final norm, then the logits: the last position's with
    generate's fp32 copy (logits_to_keep=1), or every position's for BERT's masked-LM head."""
    a, h, v = f.a, m.hidden, m.vocab // f.tp
    if not m.causal:  # sequence output, transform output, logits
        return 2 * a * f.t * h + a * f.t * v
    norm = Tape(2 * a * f.t * h)
    _rms(norm, f, h, m.model_type in ("gemma", "gemma2")) if m.norm_kind == "rms" else _layer_norm(norm, f, h)
    return max(norm.peak, a * f.t * h + (a + 4) * v * f.b)


LAYER_FORWARD = {**{mt: llama_forward for mt in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
                                                    "mixtral", "qwen2_moe", "qwen3_moe")},
                 "gpt_neox": neox_forward, "falcon": falcon_forward, "opt": opt_forward, "gpt2": gpt2_forward,
                 "bert": bert_forward, "deepseek_v2": deepseek_forward, "deepseek_v3": deepseek_forward}


@lru_cache(maxsize=8192)  # pure in the frozen model and Fwd
def inference_peak(m: ModelSpec, f: Fwd) -> int:
    """Largest working set of one no-grad forward step beyond weights and KV cache."""
    layer = max(LAYER_FORWARD[m.model_type](m, f, ls) for _, ls in m.layer_groups)
    return max(model_base(m, f) + layer, _end(m, f))


@lru_cache(maxsize=8192)  # pure in the frozen model and Fwd
def checkpointed_layer_peak(m: ModelSpec, f: Fwd) -> int:
    """The working set of one layer's forward under full activation checkpointing (nothing saved), for the
    families whose forward is replayed here in training form (Llama family); 0 for the others."""
    if LAYER_FORWARD.get(m.model_type) is not llama_forward:
        return 0
    return max(llama_forward(m, f, ls) for _, ls in m.layer_groups)
