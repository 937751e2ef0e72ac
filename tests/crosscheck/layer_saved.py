"""What autograd keeps for backward, op by op: the rules the per-family layers (layer_families.py) compose.

Each function returns the tensors that PyTorch autograd saves for one piece of a transformers 5.x decoder
layer (models/<arch>/modeling_<arch>.py), with PEFT LoRA adapters and torch.autocast where the workload says
so. The rules, from torch's autograd formulas (tools/autograd/derivatives.yaml):
- A Linear (mm/addmm) saves its input only when its weight trains, and its weight only when the input needs a
  gradient; a matmul of two activations saves each operand only when the other one needs a gradient.
- LayerNorm saves its input and the fp32 mean/rstd; RMSNorm (LlamaRMSNorm) saves the fp32 upcast, the rsqrt and,
  when its weight trains, the normalised tensor. Nothing is saved for an input that needs no gradient: under LoRA
  the embeddings are frozen, so the first layer saves less until the first adapter (`Ctx.x_grad`).
- Under autocast each Linear reading an fp32 tensor casts its own half copy and saves it (the weight cast cache
  holds leaf parameters only, torch/csrc/autograd autocast_mode.cpp); a Linear reading a half tensor shares it.
- PEFT casts the adapter input to the fp32 adapter dtype (`LoraLayer._cast_input_dtype`): lora_A saves that copy
  (a half copy under autocast, the input itself when compute is fp32), lora_B saves lora_A's r-wide output.
- SDPA (flash): q, k, v, the output and the fp32 logsumexp; GQA keys/values stay kv-head wide
  (transformers `use_gqa_in_sdpa`). A value that is a view of a fused qkv projection keeps the whole fused
  output alive. The output has the memory layout of q (flash_api.cpp `empty_like`), so a q made contiguous in
  (b, heads, s, d) by a rotary `cat` makes the `transpose(1, 2).contiguous()` before o_proj copy it.
- Eager: the q/k/v copies matmul makes (repeat_kv or reshape), the softmax output (fp32 where the family
  upcasts), its half copy for the product with V, and the output's transpose copy for o_proj.
- Dropout saves a 1-byte mask per element (CUDA's fused native_dropout; the CPU kernel keeps a mask in the
  input's dtype, see docs/activations.md).
All sizes are bytes per token of one layer; `Saved.fixed` holds the few that do not scale with tokens.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

from crosscheck.model import ModelSpec
from estimator.spec import Workload
from estimator.units import dtype_bytes

# How many I-wide tensors an activation saves (transformers ACT2FN); 1 = just its input.
# gelu_new (NewGELUActivation) is a Python formula: it saves x, tanh(..), 1 + tanh(..) and 0.5 * x.
ACT_SAVED = {"silu": 1, "swish": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "gelu_new": 4, "relu": 0}


@dataclass(frozen=True)
class Saved:
    """One tensor (or a group of same-sized ones) kept for backward."""

    what: str
    per_token: int      # bytes per token
    fixed: int = 0      # bytes per layer independent of the token count
    seq_sharded: bool = False  # in Megatron's sequence-parallel region (norms, dropout, norm outputs): / tp with SP


@dataclass(frozen=True)
class Ctx:
    """What decides dtypes and which tensors need gradients, for one layer of one workload."""

    a: int              # compute dtype bytes (2 for bf16/fp16, 4 for fp32)
    r: int              # residual-stream bytes: 4 under amp (fp32 weights: linears emit half, adds promote)
    amp: bool
    full: bool          # every weight trains
    targets: frozenset  # LoRA target module names
    x_grad: bool        # the layer's input needs a gradient (False: first layer, frozen embeddings)
    eager: bool
    selective: bool     # the attention core is recomputed (runner's selective checkpointing)
    seq: int
    drop_attn: bool     # dropout on attention probabilities is active
    drop_hidden: bool   # dropout on the residual branches is active
    tp: int
    sp: bool            # sequence parallelism shards the norm/residual part over tp

    rank: int           # LoRA rank

    def trains(self, name: str) -> bool:
        """Does this module get a gradient for its weight (base weight or a LoRA adapter)?"""
        return self.full or name.split(".")[-1] in self.targets


def context(model: ModelSpec, w: Workload, seq: int, tp: int = 1, sp: bool = False, first: bool = False) -> Ctx:
    a = dtype_bytes(w.precision)
    train = w.mode == "train"
    return Ctx(a=a, r=4 if w.recipe in ("amp", "fp32") else a, amp=w.recipe == "amp", full=w.method == "full",
               targets=frozenset(w.lora_targets), x_grad=w.method == "full" or not first,
               eager=w.attention == "eager", selective=w.checkpointing == "selective", seq=seq,
               drop_attn=train and model.attn_dropout > 0, drop_hidden=train and model.hidden_dropout > 0,
               tp=tp, sp=sp, rank=w.lora_rank)


def linear_inputs(ctx: Ctx, names: tuple[str, ...], width: int, src_bytes: int, what: str,
                  kept: bool = False, norm_out: bool = False) -> list[Saved]:
    """What the Linears `names` that read one tensor (`width` wide, `src_bytes` per element) save of it.

    Full fine-tuning: one shared tensor, except under autocast from an fp32 source, where each Linear saves its
    own half cast. LoRA: each adapter saves a cast copy (fp32 under `pure`, half under autocast) and lora_B
    saves lora_A's r-wide output; with fp32 compute the cast is a no-op and the source itself is kept.
    `kept`: the source is saved anyway by another op (SDPA's output), so sharing it adds nothing.
    `norm_out`: the source is a norm's output (sequence-sharded under sequence parallelism)."""
    a, out = ctx.a, []
    base = [n for n in names if ctx.full]
    lora = [n for n in names if not ctx.full and ctx.trains(n)]
    own_cast = ctx.amp and src_bytes == 4
    if base:
        shared = 0 if kept else src_bytes * width
        out.append(Saved(f"{what} (input of {', '.join(base)})", len(base) * a * width if own_cast else shared,
                         seq_sharded=norm_out))
    if lora:
        if a == 4:
            out.append(Saved(f"{what} (read by the adapters of {', '.join(lora)})", 0 if base or kept else 4 * width,
                             seq_sharded=norm_out))
        else:
            out.append(Saved(f"LoRA input casts ({', '.join(lora)})", len(lora) * (a if ctx.amp else 4) * width,
                             seq_sharded=norm_out))
        out.append(Saved("lora_A outputs", len(lora) * (a if ctx.amp else 4) * ctx.rank))
    return out


def rms_norm(ctx: Ctx, width: int, grad_in: bool, what: str, gemma: bool = False, half_in: bool = False) -> list[Saved]:
    """LlamaRMSNorm: fp32 upcast (the fp32 residual itself under amp), rsqrt, and the normalised tensor in the
    input dtype when the weight trains (`half_in`: a norm on a projection's half output, e.g. MLA's latents).
    Gemma multiplies by (1 + weight) in fp32: the normalised tensor is
    fp32 and (1 + weight.float()) is kept too (`fixed`)."""
    if not grad_in:
        return []
    trained = ctx.full
    out = [Saved(f"{what}: fp32 input", 4 * width, seq_sharded=True), Saved(f"{what}: rsqrt", 4, seq_sharded=True)]
    if trained:
        out.append(Saved(f"{what}: normalised", (4 if gemma else ctx.a if half_in else ctx.r) * width,
                         seq_sharded=True))
    if gemma:
        out.append(Saved(f"{what}: 1 + weight (fp32)", 0, 4 * width))
    return out


def layer_norm(ctx: Ctx, width: int, grad_in: bool, what: str, with_input: bool = True) -> list[Saved]:
    """nn.LayerNorm (native_layer_norm): its input (fp32 under autocast) and fp32 mean and rstd."""
    if not grad_in:
        return []
    out = [Saved(f"{what}: mean, rstd (fp32)", 8, seq_sharded=True)]
    if with_input:
        out.append(Saved(f"{what}: input", ctx.r * width, seq_sharded=True))
    return out


def dropout_mask(ctx: Ctx, width: int, grad_in: bool, what: str) -> list[Saved]:
    return [Saved(f"{what} dropout mask", width, seq_sharded=True)] if ctx.drop_hidden and grad_in else []


# -- attention ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How a family hands q, k and v to the attention kernel, which decides what the saved tensors alias."""

    q: str              # "rope": new tensor from RoPE (fp32 under autocast: half q times fp32 cos); "cat": RoPE
                        # through torch.cat, a new tensor contiguous in (b, heads, s, d); "new": a new half tensor
                        # (OPT's q * scaling); "view": a view of its projection's output
    fused: bool         # q, k, v are views of one projection output, kept whole by the view of v
    softmax32: bool     # eager softmax in fp32 (else in the scores' dtype; fp32 under autocast either way)
    math: bool = False  # SDPA runs the math kernel: Falcon's multi-query k/v have 1 head, and both fused
                        # kernels require equal head counts (sdp_utils_cpp.h, on CPU and CUDA alike)
    wrapped: bool = True  # goes through transformers' attention interface (what selective checkpointing wraps)


LAYOUTS = {
    "llama": Layout("rope", False, True), "phi3": Layout("cat", True, True), "gpt_neox": Layout("cat", True, True),
    "falcon": Layout("rope", True, False, math=True, wrapped=False), "opt": Layout("new", False, True),
    "gpt2": Layout("view", True, False), "bert": Layout("view", False, False),
}


def _heads(model: ModelSpec, ctx: Ctx) -> tuple[int, int, int, int]:
    nh = max(1, model.heads // ctx.tp)
    return nh, max(1, model.kv_heads // ctx.tp), model.head_dim, model.v_head_dim


def attention(model: ModelSpec, ctx: Ctx, lay: Layout, grads: tuple[bool, bool, bool], o_name: str) -> list[Saved]:
    """The attention core (after the q/k/v projections, up to and including o_proj's input)."""
    qg, kg, vg = grads
    nh, kv, hd, vd = _heads(model, ctx)
    a, o_w = ctx.a, nh * vd
    if not (qg or kg or vg):
        return linear_inputs(ctx, (o_name,), o_w, a, "attention output")
    fused = a * (nh * hd + kv * hd + kv * vd) if lay.fused else 0
    if ctx.selective and lay.wrapped:  # checkpoint keeps the interface's inputs; its output is new
        q_b = 4 if ctx.amp and lay.q in ("rope", "cat") else a  # RoPE output: half q times fp32 cos
        k_b = q_b if lay.q in ("rope", "cat") else a
        own = lay.q != "view"  # q and k are new tensors (RoPE, cat, OPT's scaling), not views of the projection
        views = lay.q in ("new", "view") and not lay.fused  # k (and a viewed q) alive as projection outputs
        held = [Saved("q, k (held by the checkpoint)", q_b * nh * hd + k_b * kv * hd if own or views else 0),
                Saved("v (held by the checkpoint)", fused or a * kv * vd)]
        return held + linear_inputs(ctx, (o_name,), o_w, a, "attention output")
    # CUDA's backend choice (sdp_utils.cpp): flash takes fp16/bf16 only (check_dtypes_low_precision) and the
    # memory-efficient kernel has no enable_gqa in 2.13, so fp32 attention with GQA runs the math composite.
    if ctx.a == 4 and kv < nh and not lay.math:
        lay = dataclasses.replace(lay, math=True)
    if ctx.eager or lay.math:
        copy = linear_inputs(ctx, (o_name,), o_w, a, "attention output copy")
        return _attention_explicit(model, ctx, lay, grads) + copy
    copy = lay.q == "cat"  # output laid out like q: (b, heads, s, d) -> transpose(1, 2).contiguous() copies
    out = [Saved("q, k, v" + (" (the fused projection output, via v's view)" if lay.fused else ""),
                 fused or a * (nh * hd + kv * hd + kv * vd)),
           Saved("q, k after RoPE (new tensors)", a * (nh + kv) * hd if lay.fused and lay.q != "view" else 0),
           Saved("SDPA output", a * o_w), Saved("SDPA logsumexp (fp32)", 4 * nh)]
    return out + linear_inputs(ctx, (o_name,), o_w, a, "attention output" + (" copy" if copy else ""), kept=not copy)


def _attention_explicit(model: ModelSpec, ctx: Ctx, lay: Layout, grads: tuple[bool, bool, bool]) -> list[Saved]:
    """Eager attention, or SDPA's math kernel (q @ k^T, softmax, @ v as separate autograd ops)."""
    qg, kg, vg = grads
    nh, _, hd, vd = _heads(model, ctx)
    a, s, qk_g = ctx.a, ctx.seq, qg or kg
    if lay.math and not ctx.eager:  # math kernel: fp32 copies of q, k, v (heads expanded), fp32 softmax
        return [Saved("q (fp32, scaled)", 4 * nh * hd if kg else 0),
                Saved("k (fp32, heads expanded)", 4 * nh * hd if qg else 0),
                Saved("softmax (fp32)", 4 * nh * s if qk_g else 0),
                Saved("v (fp32, heads expanded)", 4 * nh * vd if qk_g else 0)]
    sm = 4 if lay.softmax32 or ctx.r == 4 else a  # autocast runs softmax in fp32 (CUDA autocast policy)
    out = [Saved("q copy", a * nh * hd if kg else 0), Saved("k copy (heads repeated)", a * nh * hd if qg else 0),
           Saved("tanh of soft-capped scores", a * nh * s if model.attn_softcap and qk_g else 0),
           Saved("softmax output", sm * nh * s if qk_g else 0),
           Saved("v copy (heads repeated)", a * nh * vd if qk_g else 0)]
    if ctx.drop_attn:
        out += [Saved("attention dropout mask", nh * s if qk_g else 0),
                Saved("dropped probabilities", a * nh * s if vg else 0)]
    elif sm != a:
        out.append(Saved("half copy of the probabilities", a * nh * s if vg else 0))
    return out


# -- MLPs -----------------------------------------------------------------------------------------------------
def gated_mlp(ctx: Ctx, width: int, grad_in: bool, ups: tuple[str, ...], down: str, act: str) -> list[Saved]:
    """SwiGLU/GeGLU after the projections: act(gate) * up -> down. Phi-3's fused gate_up_proj output is saved
    through its two halves (views), the same 2*I bytes. `width` is the intermediate size on this GPU."""
    a = ctx.a
    g = grad_in or any(ctx.trains(n) for n in ups)
    return [Saved("gate, up projection outputs", 2 * a * width if g else 0),
            Saved("activation intermediates", (ACT_SAVED.get(act, 1) - 1) * a * width if g else 0),
            Saved("act(gate)", a * width if g else 0)] + linear_inputs(ctx, (down,), width, a, "act(gate) * up")


def dense_mlp(ctx: Ctx, width: int, grad_in: bool, up: str, down: str, act: str) -> list[Saved]:
    """fc1 -> activation -> fc2. ReLU saves its output, which is fc2's input too. GPT-2's gelu_new saves x,
    tanh(..), 1 + tanh(..), 0.5 * x; under autocast CUDA runs its pow in fp32 (autocast's fp32 list), so x's
    fp32 cast, the tanh and 1 + tanh are fp32 and fc2 casts the fp32 product back to half."""
    a = ctx.a
    if not (grad_in or ctx.trains(up)):
        return linear_inputs(ctx, (down,), width, a, "activation output")
    if act == "relu":
        return [Saved("relu output", a * width)] + linear_inputs(ctx, (down,), width, a, "relu output", kept=True)
    if act == "gelu_new" and ctx.amp:
        return [Saved("gelu_new: fp32 x, tanh, 1 + tanh", 12 * width), Saved("gelu_new: 0.5 * x", a * width)] + \
            linear_inputs(ctx, (down,), width, 4, "gelu_new output (fp32)")
    return [Saved(f"{act} intermediates", ACT_SAVED.get(act, 1) * a * width)] + \
        linear_inputs(ctx, (down,), width, a, f"{act} output")


def moe(model: ModelSpec, ctx: Ctx, width: int, grad_in: bool) -> list[Saved]:
    """Router + routed experts through transformers' default `grouped_mm` experts (integrations/moe.py,
    grouped_mm_experts_forward): tokens sorted by expert, k copies of each token's input gathered, one grouped
    matmul per projection. grouped_mm is not autocast-enabled: under amp the experts run in their fp32 weights'
    dtype. `width` = one expert's intermediate size; k = experts per token, E = experts."""
    a, h, k, n = ctx.a, model.hidden, model.experts_per_token, model.n_experts
    e = 4 if ctx.amp else a
    router_g = grad_in or ctx.trains("gate")
    weights_b = 4 if model.model_type in ("mixtral", "deepseek_v2", "deepseek_v3") else a  # Qwen casts them to half
    deepseek = model.model_type in ("deepseek_v2", "deepseek_v3")
    out = [Saved("router softmax/sigmoid (fp32)", 4 * n if router_g else 0),
           Saved("DeepSeek router: score mask (bool); weight.float() copy (pure)", n if deepseek and router_g else 0,
                 4 * n * h if deepseek and router_g and not ctx.amp and a != 4 else 0),
           Saved("router top-k indices (int64)", 8 * k if router_g else 0),
           Saved("top-k renormalisation (values, sum)", 4 * k + 4 if router_g and model.norm_topk else 0),
           Saved("expert sort permutation, gather and inverse indices (int64)", 8 * k * (router_g + 2 * grad_in)),
           Saved("gathered token copies (input of gate_up)", k * h * e if ctx.full else 0),
           Saved("gate_up output and act(gate)", 3 * k * width * e if grad_in or ctx.full else 0),
           Saved("act(gate) * up (input of down)", k * width * e if ctx.full else 0),
           Saved("expert outputs and their routing weights", k * (h * e + weights_b) if router_g else 0),
           Saved("grouped_mm offsets (int32)", 0, 4 * n)]
    return out


def routed_width(ls) -> int:
    """One routed expert's intermediate width in this layer type (0 for a dense layer)."""
    return next((lin.out_features for lin in ls.linears if lin.role == "expert" and lin.name == "gate_proj"), 0)


def shared_width(ls) -> int:
    return sum(lin.out_features for lin in ls.linears if lin.role == "shared" and lin.name == "gate_proj")
