"""Activation memory: the detailed per-tensor model (default) and the seeds' k * b*s*h*L*bytes form.

The detailed model follows Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198, sec. 4 and Table 2: 34*s*b*h + 5*a*s^2*b per layer for GPT with fp16 and dropout),
rebuilt tensor by tensor for what PyTorch autograd actually saves in the transformers 5 modules:
- RMSNorm (LlamaRMSNorm) saves the fp32 upcast of its input and, if its weight trains, the normalised tensor;
  LayerNorm saves its input plus fp32 mean/rstd.
- A Linear saves its input only when its weight trains (frozen LoRA bases don't), so LoRA saves less.
- SwiGLU saves gate, silu(gate), up (and the product when down_proj trains): 4*I, not the 2*4h of GPT's MLP.
- SDPA/flash saves q, k, v, the output and an fp32 logsumexp; GQA keys/values stay at kv_heads
  (transformers `use_gqa_in_sdpa`). Eager materialises repeated K/V, the fp32 softmax (b*heads*s^2*4 bytes)
  and its half-precision copy, and a dropout mask when attention dropout > 0.
- The loss upcasts logits to fp32 (transformers `ForCausalLMLoss`: `logits.float()`), and log_softmax saves
  its fp32 output: b*s*V*4 bytes, gigabytes for a 128k vocabulary (seeds 000-003 omit this).
Each function returns bytes per token (multiply by batch*seq) unless it says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

from estimator.model import ModelSpec
from estimator.spec import Workload
from estimator.units import dtype_bytes

# Default activation constant for the seeds' form, per family: what the detailed model gives per layer in units
# of h*bytes for a typical config (see docs/seed-errata.md). The calibration issue replaces these with fits.
DEFAULT_K = {"llama": 24.0, "gemma": 30.0, "moe": 24.0, "deepseek": 40.0, "gpt2": 34.0, "gpt_neox": 24.0,
             "falcon": 22.0, "opt": 22.0, "bert": 30.0}
SEED_K = 12.0  # seed 000's flat constant

# Activation functions that save more than their input (transformers `ACT2FN`): GPT-2's default "gelu_new" is the
# Python tanh formula (NewGELUActivation), which saves x, tanh(..), 0.5*x and (1 + tanh(..)).
_ACT_SAVED = {"gelu_new": 4, "gelu_pytorch_tanh": 1, "gelu": 1, "relu": 0, "silu": 1}


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes of activations for one micro-batch on one GPU, split by when they are alive."""

    per_layer_bytes: int        # saved for backward by one transformer layer (whole micro-batch)
    layers: int                 # layers held on this GPU
    head_bytes: int             # saved outside the layers: final norm, lm_head input, fp32 log-softmax, embeddings
    forward_transient_bytes: int  # extra live at the forward peak (logits + their fp32 copy during the loss)
    backward_transient_bytes: int  # extra live at the backward peak (gradients of the logits, one layer recomputed)
    logits_saved_bytes: int = 0   # part of head_bytes: log_softmax's fp32 output, freed once its backward ran
    logits_grad_bytes: int = 0    # the half-precision gradient of the logits that feeds lm_head's backward

    @property
    def saved_bytes(self) -> int:
        return self.per_layer_bytes * self.layers + self.head_bytes


def _trains(workload: Workload, module: str) -> bool:
    """Does this Linear's weight train (so that the Linear saves its input)?"""
    if workload.method == "full":
        return True
    return module in workload.lora_targets


def _residual_bytes(workload: Workload) -> int:
    """Residual-stream dtype: fp32 when the weights are fp32 (amp: linears emit half, the add promotes to fp32)."""
    return 4 if workload.recipe in ("amp", "fp32") else dtype_bytes(workload.precision)


def norm_saved_per_token(model: ModelSpec, workload: Workload, width: int) -> int:
    """Bytes one norm saves per token (excluding its output, which the consumer saves)."""
    r = _residual_bytes(workload)
    if model.norm_kind == "rms":
        trained = workload.method == "full"
        return 4 * width + 4 + (r * width if trained else 0)   # fp32 upcast, rsqrt, normalised (if weight trains)
    in_bytes = 4 if workload.recipe == "amp" else r  # autocast runs layer_norm in fp32
    return in_bytes * width + 8                       # input + fp32 mean and rstd


def attention_saved_per_token(model: ModelSpec, workload: Workload, seq: int, tp: int = 1) -> int:
    """Bytes the attention core saves per token (q/k/v after RoPE, output, softmax statistics)."""
    a = dtype_bytes(workload.precision)
    nh = model.heads // tp if model.heads >= tp else 1
    q = nh * model.head_dim
    kv_heads = max(1, model.kv_heads // tp)
    k = kv_heads * model.head_dim
    v = kv_heads * model.v_head_dim
    o = nh * model.v_head_dim
    if model.is_mla:  # latent path: q (and q_a), kv_a, normed latent, expanded k/v from kv_b_proj
        k, v = q, nh * model.v_head_dim
        extra = (4 + a) * (model.kv_lora_rank + model.qk_rope_head_dim)
    else:
        extra = 0
    if workload.attention == "eager" or (workload.mode == "train" and model.attn_dropout > 0 and model.model_type == "bert"):
        # eager_attention_forward: repeat_kv copies, fp32 softmax, its half copy, dropout, output transpose copy
        kv_rep = nh * (model.head_dim + model.v_head_dim)
        drop = (1 + a) if (workload.mode == "train" and model.attn_dropout > 0) else 0
        # the half copy is saved only when the matmul with V reads it; dropout reads it instead and saves just
        # its mask and output (measured with saved_tensors_hooks on GPTNeoXLayer eager: 7 B/score, not 9)
        probs = 4 + (a if a != 4 and not drop else 0)
        ctx = 0 if workload.checkpointing == "selective" else (probs + drop) * nh * seq
        # the output's transpose(1, 2).contiguous() copy is saved only by a training o_proj
        return a * (q + kv_rep + (o if workload.method == "full" else 0)) + ctx + extra
    lse = 0 if workload.checkpointing == "selective" else 4 * nh
    return a * (q + k + v + o) + lse + extra


def mlp_saved_per_token(model: ModelSpec, workload: Workload, tp: int = 1, act: str | None = None) -> int:
    """Bytes the MLP (or the routed experts + shared expert) saves per token."""
    a = dtype_bytes(workload.precision)
    if model.gated_mlp:
        down = "down_proj"
        if model.is_moe:
            width = _moe_width(model)
        else:
            width = model.intermediate
        width //= tp
        return a * width * (3 + (1 if _trains(workload, down) else 0))
    width = model.intermediate // tp
    act = act or {"gpt2": "gelu_new", "opt": "relu"}.get(model.model_type, "gelu")
    out_saved = 1 if (_trains(workload, "c_proj") or workload.method == "full") else 0
    if act == "relu":  # relu saves its output, which is also fc2's input
        return a * width
    return a * width * (_ACT_SAVED[act] + out_saved)


def _moe_width(model: ModelSpec) -> int:
    """Intermediate width a token passes through in an MoE layer: top-k routed experts + shared experts."""
    for _, ls in model.layer_groups:
        routed = [lin for lin in ls.linears if lin.role == "expert" and lin.name == "gate_proj"]
        shared = [lin for lin in ls.linears if lin.role == "shared" and lin.name == "gate_proj"]
        if routed:
            return model.experts_per_token * routed[0].out_features + sum(s.out_features for s in shared)
    return model.intermediate


_QKV_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "query", "key", "value",
              "q_a_proj", "kv_a_proj_with_mqa")
_UP_NAMES = ("gate_proj", "up_proj", "gate_up_proj", "c_fc", "fc1", "dense_h_to_4h", "intermediate.dense")


def _norm_consumer_inputs(model: ModelSpec, workload: Workload, names: tuple[str, ...]) -> int:
    """How many copies of a norm's output the Linears reading it save (full fine-tuning).

    In `pure` the consumers share one tensor. Under autocast (`amp`) the norm emits fp32 and *each* Linear call
    casts its own half copy (autocast caches only leaf weights, torch/csrc/autograd autocast_mode.cpp), so
    q, k and v save three copies and gate and up two."""
    if workload.method != "full":
        return 0
    if workload.recipe != "amp":
        return 1
    names_here = {lin.name for _, lin in model.linears()}
    return sum(1 for n in names if n in names_here) or 1


def lora_saved_per_token(model: ModelSpec, workload: Workload, tp: int = 1) -> int:
    """What the LoRA adapters of one layer save per token. PEFT casts the input to the fp32 adapter dtype
    (`LoraLayer._cast_input_dtype`) and lora_A saves that copy, lora_B saves lora_A's fp32 output (r wide).
    When compute is already fp32 the cast is a no-op and the shared input is counted by the norm's consumers."""
    if workload.method == "full":
        return 0
    a = dtype_bytes(workload.precision)
    seen, total = set(), 0
    for _, lin in model.linears():
        if lin.role == "expert" or lin.name in seen or lin.name.split(".")[-1] not in workload.lora_targets:
            continue
        seen.add(lin.name)
        if workload.recipe == "amp":  # autocast runs lora_A/lora_B in half: a half copy of the input, r-wide output
            total += a * lin.in_features // tp + a * workload.lora_rank
        else:
            total += (4 * lin.in_features // tp if a != 4 else 0) + 4 * workload.lora_rank
    if a == 4:  # fp32 compute: adapters read the (shared) norm output; count it once per norm
        total += 4 * model.hidden * (any(n in workload.lora_targets for n in _QKV_NAMES)
                                     + any(n in workload.lora_targets for n in _UP_NAMES))
    return total


def layer_saved_per_token(model: ModelSpec, workload: Workload, seq: int, tp: int = 1, sp: bool = False) -> int:
    """Bytes one transformer layer saves for backward, per token (Korthikanti Table 2, tensor by tensor)."""
    a = dtype_bytes(workload.precision)
    h = model.hidden
    shard = tp if sp else 1  # sequence parallelism shards the norm/residual part over tp too
    norms = 1 if model.parallel_residual and model.model_type == "falcon" else 2
    qkv_in = _norm_consumer_inputs(model, workload, _QKV_NAMES)
    mlp_in = _norm_consumer_inputs(model, workload, _UP_NAMES) if not model.parallel_residual else 0
    saved = norms * norm_saved_per_token(model, workload, h) // shard
    saved += (a * h // shard) * (qkv_in + mlp_in)
    saved += attention_saved_per_token(model, workload, seq, tp)
    saved += mlp_saved_per_token(model, workload, tp)
    saved += lora_saved_per_token(model, workload, tp)
    if model.is_moe:  # router logits (half) and fp32 softmax over experts
        saved += (a + 4) * model.n_experts
    if workload.mode == "train" and model.hidden_dropout > 0:  # residual dropouts: bool mask only, x2 (the
        saved += 2 * h // shard                                  # output feeds an add, which saves nothing)
    return saved


def head_saved_per_token(model: ModelSpec, workload: Workload, tp: int = 1) -> int:
    """Bytes saved outside the layers: final norm, lm_head input, the loss's fp32 log-softmax output."""
    a = dtype_bytes(workload.precision)
    v = model.vocab // tp
    lm_trains = workload.method == "full"
    saved = norm_saved_per_token(model, workload, model.hidden) + (a * model.hidden if lm_trains else 0)
    if model.causal:
        saved += 4 * v  # log_softmax output (fp32)
    else:
        saved += 4 * v + (a + 4 + 8) * model.hidden  # MLM head: dense + gelu + LayerNorm, then log_softmax
    return saved


def activation_profile(model: ModelSpec, workload: Workload, layers: int | None = None, tp: int = 1,
                       sp: bool = False, in_flight: int = 1) -> ActivationProfile:
    """Training activations of one micro-batch on one GPU (`layers` on this pipeline stage; `in_flight`
    micro-batches held by a 1F1B first stage: Megatron `theoretical_memory_usage.py` compute_activation_memory)."""
    tokens = workload.batch * workload.seq
    L = model.layers if layers is None else layers
    a = dtype_bytes(workload.precision)
    layer = layer_saved_per_token(model, workload, workload.seq, tp, sp) * tokens
    v = model.vocab // tp
    head = head_saved_per_token(model, workload, tp) * tokens
    fwd_transient = (a + (4 if a != 4 else 0)) * v * tokens   # logits and their fp32 copy during log_softmax
    bwd_transient = 8 * v * tokens                            # grads of nll and of log_softmax, both fp32
    logits_saved = 4 * v * tokens if model.causal else 0
    logits_grad = a * v * tokens                              # ToCopyBackward: fp32 grad cast back to half
    if workload.checkpointing == "full":
        # HF gradient checkpointing: each layer keeps only its input; backward recomputes one layer at a time.
        kept = _residual_bytes(workload) * model.hidden * tokens // (tp if sp else 1)
        return ActivationProfile(kept * in_flight, L, head, fwd_transient, max(bwd_transient, layer),
                                 logits_saved, logits_grad)
    return ActivationProfile(layer * in_flight, L, head, fwd_transient, bwd_transient, logits_saved, logits_grad)


def activation_bytes(model: ModelSpec, workload: Workload) -> int:
    """Saved activations of one training micro-batch on one GPU (detailed model, no parallelism)."""
    return activation_profile(model, workload).saved_bytes


def activation_bytes_k(model: ModelSpec, workload: Workload, k: float) -> int:
    """The seeds' form: k * b * s * h * L * bytes (seed 000 `will_it_fit`, seed 002). k=12 in seed 000."""
    return int(k * workload.batch * workload.seq * model.hidden * model.layers * dtype_bytes(workload.precision))


def implied_k(model: ModelSpec, workload: Workload) -> float:
    """The k that makes the seeds' form equal the detailed model for this config."""
    denom = workload.batch * workload.seq * model.hidden * model.layers * dtype_bytes(workload.precision)
    return activation_bytes(model, workload) / denom


def prefill_transient_bytes(model: ModelSpec, workload: Workload, tp: int = 1) -> int:
    """Peak working set of a no-grad forward over the prompt (HF generate prefill), beyond weights and cache:
    the residual stream, one layer's attention or MLP intermediates, and the last position's logits
    (generate passes logits_to_keep=1 and upcasts them to fp32)."""
    a = dtype_bytes(workload.precision)
    b, s, h = workload.batch, workload.seq, model.hidden
    nh = max(1, model.heads // tp)
    resid = 2 * a * h + 4 * h                                  # residual, norm output, fp32 upcast
    attn = a * (nh * model.head_dim * 2 + 2 * max(1, model.kv_heads // tp) * model.head_dim)
    if workload.attention == "eager":
        attn += (a + 4) * nh * s                               # scores and their fp32 softmax
    width = (_moe_width(model) if model.is_moe else model.intermediate) // tp
    mlp = 3 * a * width
    logits = (a + 4) * (model.vocab // tp) * b
    return b * s * (resid + max(attn, mlp)) + logits
