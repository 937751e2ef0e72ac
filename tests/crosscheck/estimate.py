"""estimate(): compose the components into per-stage breakdowns and the step's peak, per GPU.

A training step (steady state, after the first optimizer step has created the states) goes
    load -> forward -> backward -> optimizer step,
and the peak is the largest of those stages, as in seed 000's waterfall but with the states already there.
Inference goes load -> prefill -> decode. Each stage is a Breakdown whose total is the sum of its parts.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from crosscheck import activations as act
from crosscheck import components as comp
from crosscheck.model import ModelSpec
from crosscheck.parallel import SHARD_PARAMS, Share, shares
from estimator.spec import Parallel, Workload
from estimator.units import dtype_bytes

COMPONENTS = ("weights", "gradients", "optimizer_states", "master_weights", "activations", "kv_cache",
              "temporaries", "overhead")


@dataclass(frozen=True)
class Breakdown:
    """Bytes per component at one moment on one GPU."""

    weights: int = 0           # model weights (quantized where the format says so), this GPU's share
    gradients: int = 0         # .grad of trainable params (+ DDP buckets)
    optimizer_states: int = 0  # Adam moments etc.
    master_weights: int = 0    # fp32 master copy (recipe 'mixed')
    activations: int = 0       # tensors saved for backward, or the inference working set
    kv_cache: int = 0          # inference K/V cache
    temporaries: int = 0       # transient: logits' fp32 copies, optimizer foreach lists, gathered FSDP layers,
                               # autocast weight copies
    overhead: int = 0          # CUDA context, cuBLAS workspace, NCCL buffers

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_states + self.master_weights + self.activations
                + self.kv_cache + self.temporaries + self.overhead)  # every field (tests check it against fields())

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Estimate:
    model: ModelSpec
    workload: Workload
    parallel: Parallel
    params: int
    trainable_params: int
    stages: tuple[tuple[str, Breakdown], ...]
    peak_stage: str
    pipeline_stage: str         # which pipeline stage holds the peak ('only' without PP)
    cuda_context_bytes: int     # part of `overhead` that torch.cuda's allocator never sees
    allocator_overhead_bytes: int  # part of `overhead` allocated through torch (cuBLAS workspace)

    @property
    def components(self) -> Breakdown:
        return dict(self.stages)[self.peak_stage]

    @property
    def total_bytes(self) -> int:
        """Per-GPU peak of the step, everything included: compare with the GPU's total memory."""
        return self.components.total

    @property
    def allocated_bytes(self) -> int:
        """Peak as torch.cuda.max_memory_allocated would see it (no context, no NCCL)."""
        return self.total_bytes - self.components.overhead + self.allocator_overhead_bytes

    def stage(self, name: str) -> Breakdown:
        return dict(self.stages)[name]


@dataclass(frozen=True)
class Options:
    """Knobs that are not part of the workload: the overhead model and the activation model."""

    overhead: comp.Overhead = comp.Overhead()
    activation_k: float | None = None   # None: detailed model; a number: the seeds' k * b*s*h*L*bytes form


def _weights_full_bytes(model: ModelSpec, w: Workload) -> tuple[int, int]:
    """(frozen/inference weight bytes, trainable weight bytes) for the whole model."""
    rd = comp.recipe_dtypes(w)
    fmt = comp.weight_format(w)
    float_dtype = fmt if fmt in ("fp32", "bf16", "fp16") else w.precision
    if w.mode == "infer" or w.method != "full":
        frozen = comp.weights_bytes(model, fmt, float_dtype)
        trainable = comp.trainable_params(model, w) * dtype_bytes(rd.weight) if w.mode == "train" else 0
        return frozen, trainable
    return 0, model.params * dtype_bytes(rd.weight)


def _model_states(model: ModelSpec, w: Workload, par: Parallel, sh: Share) -> dict[str, int]:
    rd = comp.recipe_dtypes(w)
    local = sh.params_local / model.params
    frozen, train_w = _weights_full_bytes(model, w)
    trainable = comp.trainable_params(model, w)
    shapes = comp.trainable_tensor_shapes(model, w) if w.mode == "train" else []
    states = comp.optimizer_state_bytes(shapes, w.optimizer, rd.state) if shapes else 0
    offload_states = par.offload != "none"
    out = {
        "weights": int((frozen + train_w) * local * sh.weight_frac),
        "gradients": int(comp.gradient_bytes(trainable, rd.grad) * local * sh.grad_frac),
        "optimizer_states": 0 if offload_states else int(states * local * sh.state_frac),
        "master_weights": 0 if offload_states else int(comp.master_weight_bytes(trainable, w.recipe) * local * sh.state_frac),
        "opt_temp": 0 if offload_states else int(comp.optimizer_step_temp_bytes(shapes, w.optimizer, w.optimizer_impl, rd.state)
                                                 * local * sh.state_frac) if shapes else 0,
    }
    if par.offload == "optimizer+params" and par.strategy in SHARD_PARAMS:
        out["weights"] = 0
    if par.strategy == "ddp" and w.mode == "train":
        out["gradients"] *= 2  # reducer buckets
    return out


def _embedding_bytes_per_param(w: Workload) -> float:
    """Bytes per parameter of the embedding / lm_head as stored: the trained dtype in full fine-tuning; else the
    float dtype quantizers leave them in, or GGUF's Q6_K/Q8_0 (estimator.components.weights_bytes)."""
    if w.mode == "train" and w.method == "full":
        return dtype_bytes(comp.recipe_dtypes(w).weight)
    fmt = comp.weight_format(w)
    if fmt in comp.GGUF_BPW:
        return comp.GGUF_BPW["gguf-q8_0" if fmt == "gguf-q8_0" else "gguf-q6_k"] / 8
    return dtype_bytes(fmt if fmt in ("fp32", "bf16", "fp16") else w.precision)


def _working_set(model: ModelSpec, w: Workload, par: Parallel, sh: Share) -> int:
    """ZeRO-3/FSDP: what is gathered (unsharded) on top of this GPU's shards during forward and backward.

    - a layer being computed plus the next one prefetched (FSDP2 implicit prefetch on CUDA streams; DeepSpeed's
      `estimate_zero3_model_states_mem_needs` counts the largest layer's params + grads, 4 * largest_layer_params);
    - in backward, that layer's unsharded gradient before reduce-scatter;
    - FSDP2's root module (`fully_shard(model)`: embedding, final norm, untied lm_head): torch does not reshard the
      root after forward, so it stays gathered through forward and backward (traced: llama-3.1-8b at 8 GPUs holds
      sharded weights + 2 x 1002 MiB root + one 416 MiB layer in forward).
    """
    if par.strategy not in SHARD_PARAMS or sh.weight_frac == 1.0:
        return 0
    b = dtype_bytes(comp.recipe_dtypes(w).weight)
    root = 0
    if sh.stage == "only":
        root = int((model.embed_params + model.head_params) // par.tp_size * _embedding_bytes_per_param(w)
                   * (1 - sh.weight_frac))
    layers = 2 * sh.largest_layer_params * b
    return root + layers + (sh.largest_layer_params * b if w.mode == "train" else 0)


def _autocast_copies(model: ModelSpec, w: Workload, sh: Share) -> tuple[int, int, int]:
    """AMP: the half weight copies autocast caches and the matmuls keep for backward, (forward, backward
    start, the first layer's backward), this GPU's share (activations.autocast_weight_bytes says which)."""
    frac = sh.params_local / model.params
    return tuple(int(x * frac) for x in act.autocast_weight_bytes(model, w))


def _train_moments(model, w: Workload, par: Parallel, sh: Share, opts: Options, overhead: int):
    """load, forward, both candidates for the backward peak (start: all activations + logits' grads; end: all
    gradients + one layer's activations), optimizer. `_train_stages` keeps the larger backward one."""
    ms = _model_states(model, w, par, sh)
    tp, sp = par.tp_size, par.sequence_parallel
    in_flight = min(par.pp_size, w.grad_accum) if par.pp_size > 1 and sh.stage == "first" else 1
    prof = act.activation_profile(model, w, sh.layers_local, tp, sp, in_flight)
    saved = (prof.per_layer_bytes * prof.layers + (prof.head_bytes if sh.stage != "first" else 0)
             + (prof.first_stage_bytes if sh.stage != "last" else 0))
    if opts.activation_k is not None:
        saved = act.activation_bytes_k(model, w, opts.activation_k) * sh.layers_local // model.layers
    head_transients = sh.stage != "first"
    ws = _working_set(model, w, par, sh)
    cast, cast_bwd, cast_last = _autocast_copies(model, w, sh)
    base = dict(weights=ms["weights"], optimizer_states=ms["optimizer_states"],
                master_weights=ms["master_weights"], overhead=overhead)
    acc_grads = ms["gradients"] if w.grad_accum > 1 else 0
    # The first large gradient of backward is the lm_head's (or the tied embedding's).
    first_grad = 0
    if w.method == "full" and head_transients:
        first_grad = int(model.vocab * model.hidden // tp * dtype_bytes(comp.recipe_dtypes(w).grad) * sh.grad_frac)
    # FSDP/ZeRO-2/3: the root module's gradients (lm_head, then the embedding) stay unsharded until the root's
    # post-backward reduce-scatter at the very end of backward (torch FSDP2 `FSDPParamGroup.post_backward`).
    root_g = 0
    if w.method == "full" and sh.grad_frac < 1.0 and sh.stage == "only":
        root_g = int(model.vocab * model.hidden // tp * dtype_bytes(comp.recipe_dtypes(w).grad) * (1 - sh.grad_frac))
    fwd = Breakdown(**base, gradients=acc_grads, activations=saved,
                    temporaries=ws + cast + (prof.forward_transient_bytes if head_transients else 0))
    # Backward's first moment: every activation saved, plus the fp32 gradients of nll and log_softmax (the peak
    # is inside LogSoftmaxBackward, before lm_head's weight gradient exists).
    bwd_start = Breakdown(**base, gradients=acc_grads, activations=saved,
                          temporaries=ws + cast_bwd + (prof.backward_transient_bytes if head_transients else 0))
    # Then lm_head's backward: log_softmax's output is freed, the half logits-gradient and the V x h weight
    # gradient are live. Larger than the first moment only for few tokens (b*s below about h/5).
    bwd_head = Breakdown(**base, gradients=acc_grads + first_grad,
                         activations=saved - (prof.logits_saved_bytes if head_transients else 0),
                         temporaries=ws + root_g + cast_bwd + (prof.logits_grad_bytes if head_transients else 0))
    # The first layer's MLP backward (the last layer backward reaches): every other layer's gradients exist,
    # this layer's only for its MLP output projection (and an untied input embedding's not yet).
    gbytes = dtype_bytes(comp.recipe_dtypes(w).grad)
    layer0, layer0_out = act.first_layer_trainable_params(model, w)
    pending = 0 if w.grad_accum > 1 else int((layer0 - layer0_out) * gbytes * sh.params_local / model.params
                                             * sh.grad_frac)
    if w.method == "full" and w.grad_accum == 1 and sh.stage != "last":  # the input embeddings' come last (a tied
        embed = model.embed_params - (model.embedding_params if model.tie_embeddings else 0)  # one has lm_head's)
        pending += int(embed * gbytes * sh.grad_frac)
    # The last layer's MLP backward (the first layer backward reaches): only the head's gradients exist (and, in
    # full fine-tuning, that layer's MLP output projection's); every layer's activations are still there.
    top_grads = acc_grads
    if w.method == "full" and w.grad_accum == 1 and sh.stage != "first":
        head = model.head_params + (model.embedding_params if model.tie_embeddings else 0)
        top_grads = int((head * gbytes + layer0_out * gbytes * sh.params_local / model.params) * sh.grad_frac)
    bwd_top = Breakdown(**base, gradients=top_grads, activations=prof.first_backward_bytes if prof.layers else 0,
                        temporaries=ws + root_g + cast_last)
    bwd_layer = Breakdown(**base, gradients=ms["gradients"] - pending,
                          activations=prof.last_layer_bytes if prof.layers else 0, temporaries=ws + root_g + cast_last)
    # Tied embeddings: the autograd engine holds lm_head's and the embedding's gradient contributions and
    # their sum at once before AccumulateGrad (traced: 2 * V * h * grad bytes over the final gradients).
    tied = 0
    if w.method == "full" and model.tie_embeddings and sh.stage == "only":
        tied = int(2 * model.vocab * model.hidden // tp * dtype_bytes(comp.recipe_dtypes(w).grad) * sh.grad_frac)
    bwd_end = Breakdown(**base, gradients=ms["gradients"], activations=prof.end_bytes,
                        temporaries=ws + tied + (2 * root_g if not model.tie_embeddings else root_g))
    opt = Breakdown(**base, gradients=ms["gradients"], temporaries=ms["opt_temp"])
    load = Breakdown(weights=ms["weights"], overhead=overhead)
    return (("load", load), ("forward", fwd), ("backward_start", bwd_start), ("backward_head", bwd_head),
            ("backward_first_layer", bwd_top), ("backward_last_layer", bwd_layer), ("backward_end", bwd_end),
            ("optimizer", opt))


def _train_stages(model, w: Workload, par: Parallel, sh: Share, opts: Options, overhead: int):
    load, fwd, *backward, opt = _train_moments(model, w, par, sh, opts, overhead)
    return (load, fwd, ("backward", max((b for _, b in backward), key=lambda b: b.total)), opt)


def _infer_stages(model, w: Workload, par: Parallel, sh: Share, overhead: int):
    ms = _model_states(model, w, par, sh)
    tp = par.tp_size
    frac = sh.layers_local / model.layers / tp
    kvd = comp.kv_dtype(w)
    kv_prompt = int(comp.kv_cache_bytes(model, w.batch, w.seq, kvd) * frac) if model.causal else 0  # encoders keep none
    ws = _working_set(model, w, par, sh)
    load = Breakdown(weights=ms["weights"], overhead=overhead)
    prefill = Breakdown(weights=ms["weights"], overhead=overhead, kv_cache=kv_prompt,
                        activations=act.prefill_transient_bytes(model, w, tp), temporaries=ws)
    stages = [("load", load), ("prefill", prefill)]
    if w.gen_tokens:
        kv_full = int(comp.kv_cache_bytes(model, w.batch, w.seq + w.gen_tokens, kvd) * frac)
        # torch.cat in DynamicCache.update holds one layer's old keys (then values) beside the new ones
        old = comp.kv_cache_bytes(model, w.batch, w.seq + w.gen_tokens - 1, kvd) * frac / max(1, sh.layers_local)
        k_share = (model.kv_lora_rank / (model.kv_lora_rank + model.qk_rope_head_dim) if model.is_mla
                   else model.head_dim / (model.head_dim + model.v_head_dim))
        cat_copy = int(old * max(k_share, 1 - k_share))
        stages.append(("decode", Breakdown(weights=ms["weights"], overhead=overhead, kv_cache=kv_full,
                                           activations=act.decode_transient_bytes(model, w, tp, cat_copy),
                                           temporaries=ws)))
    return tuple(stages)


def estimate(model: ModelSpec, workload: Workload, parallel: Parallel = Parallel(), options: Options = Options()) -> Estimate:
    """Per-GPU memory of one step of `workload` on `model` under `parallel`. Pure; never raises for valid specs."""
    overhead = comp.overhead_bytes(parallel.gpus, options.overhead)
    best = None
    for sh in shares(model, parallel):
        if workload.mode == "train":
            stages = _train_stages(model, workload, parallel, sh, options, overhead)
        else:
            stages = _infer_stages(model, workload, parallel, sh, overhead)
        peak_name, peak = max(stages, key=lambda kv: kv[1].total)
        if best is None or peak.total > best[0]:
            best = (peak.total, sh.stage, stages, peak_name)
    _, pstage, stages, peak_name = best
    return Estimate(model=model, workload=workload, parallel=parallel, params=model.params,
                    trainable_params=comp.trainable_params(model, workload), stages=stages,
                    peak_stage=peak_name, pipeline_stage=pstage,
                    cuda_context_bytes=options.overhead.cuda_context_bytes,
                    allocator_overhead_bytes=options.overhead.cublas_workspace_bytes)


def moments(model: ModelSpec, workload: Workload, parallel: Parallel = Parallel(),
            options: Options = Options()) -> tuple[tuple[str, str, Breakdown], ...]:
    """Every (pipeline stage, moment, Breakdown) that `estimate` takes the maximum over, both backward
    candidates included, so that estimate(...).total_bytes == max(b.total for _, _, b in moments(...)).
    estimator.sweep fits each moment's polynomial in (batch, seq) apart: a max of polynomials is not one."""
    overhead = comp.overhead_bytes(parallel.gpus, options.overhead)
    out = []
    for sh in shares(model, parallel):
        if workload.mode == "train":
            stages = _train_moments(model, workload, parallel, sh, options, overhead)
        else:
            stages = _infer_stages(model, workload, parallel, sh, overhead)
        out += [(sh.stage, name, b) for name, b in stages]
    return tuple(out)


def clear_caches() -> None:
    """Empty every memo the estimator keeps per frozen spec (functools.lru_cache), e.g. to time a cold call."""
    import functools
    import sys

    for name, mod in list(sys.modules.items()):
        if not name.startswith("estimator") or mod is None:
            continue
        for obj in vars(mod).values():
            if isinstance(obj, functools._lru_cache_wrapper):
                obj.cache_clear()
