"""Activation memory: the detailed per-tensor model (default) and the seeds' k * b*s*h*L*bytes form.

The detailed model follows Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198, sec. 4 and Table 2: 34*s*b*h + 5*a*s^2*b per layer for GPT with fp16 and dropout),
rebuilt tensor by tensor for what PyTorch autograd saves in the transformers 5 modules of each family
(rules: tests/crosscheck/layer_saved.py; per family: tests/crosscheck/layer_families.py; op-by-op working sets without
saved tensors: tests/crosscheck/layer_forward.py; docs/activations.md has the per-family tables and the checks
against the traced tier):
- Layers: norms, the q/k/v/o copies each family's attention layout makes, SDPA's logsumexp or eager's softmax,
  the MLP or the routed experts, LoRA adapters, dropout masks. Under LoRA the first layer saves less, its
  input (the frozen embedding) needing no gradient.
- Outside the layers: the final norm, the LM head's input, the loss's fp32 log-softmax output (b*s*V*4 bytes,
  gigabytes for a 128k vocabulary; seeds 000-003 omit it), RoPE's cos/sin, index tensors of trainable
  position embeddings.
- Transients: the logits and their fp32 copy at the loss, the shifted labels, the last hidden state; in
  backward the fp32 gradients of the loss and log-softmax, then the half gradient of the logits; the MLP
  gradients of the first and last layers backward reaches (the other moments estimate() compares).
- Full checkpointing keeps each layer's input and recomputes one layer at a time; inference (prefill,
  decode) is the op-by-op working set of one layer's forward.
Bytes are for one micro-batch on one GPU; functions ending in _per_token return bytes per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from crosscheck import layer_forward as lf
from crosscheck import layer_families as fam
from crosscheck.model import ModelSpec
from estimator.spec import Workload
from estimator.units import dtype_bytes

# Default activation constant for the seeds' form, per family: implied_k of the detailed model at batch 1,
# seq 2048, full fine-tuning, recipe pure bf16, SDPA, on the family's shipped presets (the median where a
# family has several; docs/activations.md "DEFAULT_K" lists each). Falcon's is large because its multi-query
# SDPA runs the math kernel and keeps the fp32 s x s softmax. The calibration issue replaces these with fits.
DEFAULT_K = {"llama": 25.2, "gemma": 42.7, "moe": 46.3, "deepseek": 52.9, "gpt2": 40.2, "gpt_neox": 20.2,
             "falcon": 82.0, "opt": 15.2, "bert": 18.5}
SEED_K = 12.0  # seed 000's flat constant


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes of activations for one micro-batch on one GPU, split by when they are alive."""

    per_layer_bytes: int        # saved for backward by one transformer layer (whole micro-batch)
    layers: int                 # layers held on this GPU
    head_bytes: int             # saved after the layers (last pipeline stage): final norm, lm_head input, log-softmax
    forward_transient_bytes: int  # extra live at the forward peak (logits + their fp32 copy during the loss)
    backward_transient_bytes: int  # extra live inside log_softmax's backward: the loss's and its fp32 gradients
    logits_saved_bytes: int = 0   # part of head_bytes: log_softmax's output, freed once its backward ran
    logits_grad_bytes: int = 0    # the half-precision gradient of the logits that feeds lm_head's backward
    first_stage_bytes: int = 0    # saved before/instead of the layers on the first pipeline stage: RoPE cos/sin,
                                  # embedding-side tensors, and the (negative) LoRA first-layer difference
    last_layer_bytes: int = 0     # live during the first layer's MLP backward (the last layer backward reaches):
                                  # its saved tensors (recomputed under full checkpointing), the gradient coming
                                  # in, the MLP's gradient transients, RoPE cos/sin; no other layer's
    end_bytes: int = 0            # live at the embedding's backward: the gradient of the embedding output
    first_backward_bytes: int = 0  # live during the last layer's MLP backward (the first layer backward reaches):
                                   # every layer's saved set (kept inputs under full checkpointing, and the last
                                   # layer's recomputed set), the incoming gradient, the MLP's transients

    @property
    def saved_bytes(self) -> int:
        return self.per_layer_bytes * self.layers + self.head_bytes + self.first_stage_bytes


def _sum(items, tokens: int) -> int:
    return sum(s.per_token for s in items) * tokens + sum(s.fixed for s in items)


def layer_saved_per_token(model: ModelSpec, workload: Workload, seq: int, tp: int = 1, sp: bool = False) -> int:
    """Bytes one transformer layer saves for backward, per token, averaged over the model's layer types
    (dense and MoE layers differ; layer_families.layer_inventory lists the tensors)."""
    total = sum(n * sum(s.per_token for s in fam.layer_inventory(model, workload, seq, tp, sp, group=i))
                for i, (n, _) in enumerate(model.layer_groups))
    return total // model.layers


def _layer_fixed_bytes(model: ModelSpec, workload: Workload, tp: int) -> int:
    """Per-layer bytes that do not scale with tokens (Gemma's 1 + weight, MoE offsets), averaged over layers."""
    total = sum(n * sum(s.fixed for s in fam.layer_inventory(model, workload, workload.seq, tp, group=i))
                for i, (n, _) in enumerate(model.layer_groups))
    return total // model.layers


def _first_layer_delta(model: ModelSpec, workload: Workload, tp: int, sp: bool) -> int:
    """First layer minus an ordinary one: negative under LoRA (frozen embeddings: no gradient flows into the
    first layer's input, so its first norm and whatever only serves the input's gradient save nothing)."""
    if workload.method == "full":
        return 0
    tokens = workload.batch * workload.seq
    first = fam.layer_inventory(model, workload, workload.seq, tp, sp, first=True)
    other = fam.layer_inventory(model, workload, workload.seq, tp, sp)
    return _sum(first, tokens) - _sum(other, tokens)


def _checkpointed_forward(model: ModelSpec, workload: Workload, tp: int, layers: int, residual: int,
                          embed: int) -> int:
    """Activations at the last layer's forward under full checkpointing: every layer's kept input, RoPE and
    position ids, eager's causal mask(s), and the layer's own working set (layer_forward). Replayed for the
    Llama family in pure/fp32 recipes (autocast's per-op casts are not replayed): 0 elsewhere."""
    if workload.recipe == "amp":
        return 0
    f = lf.Fwd(a=dtype_bytes(workload.precision), b=workload.batch, q=workload.seq, kv=workload.seq,
               eager=workload.attention == "eager", tp=tp, cached=False)
    peak = lf.checkpointed_layer_peak(model, f)
    if not peak:
        return 0
    base = lf.model_base(model, f) - 2 * f.a * f.t * model.hidden  # less the inference embeds + layer input
    return residual * layers + embed + base + peak


def _last_layer_bytes(model: ModelSpec, workload: Workload, tp: int, sp: bool) -> int:
    """The first layer's saved tensors (its LoRA form) plus its MLP's backward transients, whole micro-batch."""
    tokens = workload.batch * workload.seq
    first = fam.layer_inventory(model, workload, workload.seq, tp, sp, first=True)
    return _sum(first, tokens) + fam.mlp_backward_extra(model, workload, tp) * tokens


def head_saved_per_token(model: ModelSpec, workload: Workload, tp: int = 1) -> int:
    """Bytes saved after the layers, per token: final norm, lm_head input, the loss's log-softmax output."""
    return sum(s.per_token for s in fam.head_inventory(model, workload, tp))


def _last_hidden_kept(model: ModelSpec, workload: Workload) -> bool:
    """Does the head save the last hidden state itself? (Else the model output still holds it at the loss.)"""
    return workload.method == "full" and workload.recipe != "amp"


def _transients(model: ModelSpec, workload: Workload, tp: int) -> tuple[int, int, int, int]:
    """(forward extra at the loss, backward extra at log_softmax's backward, log_softmax output, logits grad)."""
    a = dtype_bytes(workload.precision)
    tokens, v = workload.batch * workload.seq, model.vocab // tp
    lsm = 4 if model.causal or workload.recipe == "amp" else a  # MLM loss: no upcast except autocast's
    r = 4 if workload.recipe in ("amp", "fp32") else a
    fwd = a * v + (4 * v if lsm == 4 and a != 4 else 0)  # logits and their fp32 copy
    fwd += 0 if _last_hidden_kept(model, workload) else r * model.hidden
    fwd *= tokens
    if model.causal:  # ForCausalLMLoss: labels padded by one (b, s+1) and shifted into a contiguous copy (b, s)
        fwd += 8 * workload.batch * (2 * workload.seq + 1)
    return fwd, 2 * lsm * v * tokens, lsm * v * tokens, a * v * tokens


@lru_cache(maxsize=8192)  # pure in frozen specs; the app and search re-ask the same configs
def activation_profile(model: ModelSpec, workload: Workload, layers: int | None = None, tp: int = 1,
                       sp: bool = False, in_flight: int = 1) -> ActivationProfile:
    """Training activations of one micro-batch on one GPU (`layers` on this pipeline stage; `in_flight`
    micro-batches held by a 1F1B first stage: Megatron `theoretical_memory_usage.py` compute_activation_memory)."""
    tokens = workload.batch * workload.seq
    L = model.layers if layers is None else layers
    layer = layer_saved_per_token(model, workload, workload.seq, tp, sp) * tokens
    layer += _layer_fixed_bytes(model, workload, tp)
    head = _sum(fam.head_inventory(model, workload, tp), tokens)
    first = _sum(fam.embed_inventory(model, workload, tp), tokens) + _first_layer_delta(model, workload, tp, sp)
    fwd, bwd, logits_saved, logits_grad = _transients(model, workload, tp)
    r = 4 if workload.recipe in ("amp", "fp32") else dtype_bytes(workload.precision)
    residual = r * model.hidden * tokens // (tp if sp else 1)
    embed = _sum(fam.embed_inventory(model, workload, tp), tokens)
    last = _last_layer_bytes(model, workload, tp, sp) + embed + residual  # + the gradient of its output
    end = residual if workload.method == "full" else 0                  # LoRA: nothing flows into the embedding
    mlp_extra = fam.mlp_backward_extra(model, workload, tp) * tokens
    if workload.checkpointing == "full":
        # HF gradient checkpointing (non-reentrant): each layer keeps only its input; backward recomputes one
        # layer at a time, so the first layer's recomputed set sits beside its kept input (the same tensor
        # under amp, where RMSNorm/LayerNorm save the fp32 residual itself).
        kept_input = 0 if workload.recipe == "amp" else residual
        top = embed + residual * (L + 1) + layer - (residual if workload.recipe == "amp" else 0) + mlp_extra
        fwd = max(fwd, _checkpointed_forward(model, workload, tp, L, residual, embed) - residual * L - head - embed)
        return ActivationProfile(residual * in_flight, L, head, fwd, bwd, logits_saved, logits_grad,
                                 embed * in_flight, last + kept_input, end, top)
    top = first + layer * L + residual + mlp_extra
    return ActivationProfile(layer * in_flight, L, head, fwd, bwd, logits_saved, logits_grad, first * in_flight,
                             last, end, top)


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


def first_layer_trainable_params(model: ModelSpec, workload: Workload) -> tuple[int, int]:
    """(trainable parameters of the first layer, of which its MLP output projection's)."""
    return fam.first_layer_trainable(model, workload)


def autocast_weight_bytes(model: ModelSpec, workload: Workload) -> tuple[int, int, int]:
    """Half-precision weight copies autocast makes ('amp'): (live at the forward peak, at the start of
    backward, during the first layer's MLP backward).

    Autocast caches its cast of a leaf that requires grad until the autocast region exits (weight cache,
    aten/src/ATen/autocast_mode.cpp); a Linear keeps its weight cast for the input's gradient until its
    backward ran. Full fine-tuning: every Linear weight and bias (and the LM head, or the tied embedding it
    reads) is cached. LoRA: frozen weights are cast per call and kept only where the input needs a gradient
    (not the first layer's projections of the frozen embedding); adapters are cached. Routed experts are not
    cast: transformers' grouped_mm experts run in the weights' own dtype. Under full checkpointing the layers
    keep nothing, so only the LM head's cast outlives the forward; the first layer's recompute casts again."""
    if workload.recipe != "amp" or workload.mode != "train":
        return 0, 0, 0
    a = dtype_bytes(workload.precision)
    weights = bias = 0
    for n, lin in model.linears():
        if lin.role != "expert":
            weights += n * lin.count * lin.in_features * lin.out_features
            bias += n * lin.count * lin.out_features if lin.bias else 0
    head = model.lm_head_params + (model.embedding_params if model.tie_embeddings else 0)
    head += model.hidden * model.hidden if not model.causal else 0  # BERT's MLM transform.dense
    layer0, down0 = fam.first_layer_weights(model)
    ckpt = workload.checkpointing == "full"
    if workload.method == "full":
        return a * (weights + bias + head), a * (head if ckpt else weights + head), a * (layer0 - down0)
    adapters, first_a = fam.lora_adapter_params(model, workload)
    adapters0 = first_layer_trainable_params(model, workload)[0]
    skipped = fam.first_layer_frozen_inputs(model, workload)
    kept = a * (weights - skipped + head + adapters)
    last = a * (layer0 - skipped - down0 + adapters0 - first_a)
    if ckpt:
        return a * (head + adapters), a * head, last
    return kept, kept - a * first_a, last


def prefill_transient_bytes(model: ModelSpec, workload: Workload, tp: int = 1) -> int:
    """Peak working set of a no-grad forward over the prompt (HF generate prefill), beyond weights and KV cache:
    the largest op-by-op live set inside one layer plus what the model keeps beside it, or the end (final norm,
    the last position's logits and their fp32 copy). tests/crosscheck/layer_forward.py replays the op order."""
    f = lf.Fwd(a=dtype_bytes(workload.precision), b=workload.batch, q=workload.seq, kv=workload.seq,
               eager=workload.attention == "eager", tp=tp)
    return lf.inference_peak(model, f)


def decode_transient_bytes(model: ModelSpec, workload: Workload, tp: int = 1, cache_copy: int = 0) -> int:
    """The same for the last generated token, attending to seq + gen_tokens keys. `cache_copy`: bytes of one
    layer's old keys that DynamicCache.update's torch.cat keeps beside the new ones while it copies them; it
    is live only during the update, so it joins the peak there rather than being added on top."""
    f = lf.Fwd(a=dtype_bytes(workload.precision), b=workload.batch, q=1, kv=workload.seq + workload.gen_tokens,
               eager=workload.attention == "eager", tp=tp, cat=cache_copy)
    return lf.inference_peak(model, f)
