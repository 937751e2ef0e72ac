"""Other people's memory estimates, reproduced as written, so `python -m bench accuracy` can score them.

Each `*_bytes` function is one published rule, transcribed with its constants and quirks (the docstring says
where it comes from and what is odd about it) and returning integer bytes. `peer_predictions` applies every
rule to one (model, workload, parallel) the way a user of that rule would: the seeds and accelerate take the
parameter count and the precision, DeepSpeed and the VRAM-estimator also the GPU count. None of the rules
knows LoRA, so a LoRA workload gets the rule's full fine-tuning answer (what its user would read); a rule
that does not cover a workload at all (an optimizer it has no constant for, inference for a training rule)
gives no prediction rather than a guess. No parameter formula of theirs is used: every rule gets the exact
parameter count of the model (`Model.params`, read from the model itself), which can only flatter it.
"""
from __future__ import annotations

from estimator.model import Model
from estimator.spec import Parallel, Workload

# ------------------------------------------------------------------------------------------ the rules

# seed 000 `will_it_fit`, line 354: bytes per parameter (weights, gradients, activations and KV alike)
SEED000_BPP = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}
SEED000_K = 12  # seed 000 line 378: act = 12 * hidden * seq * layers * bpp * batch


def seed000_will_it_fit_bytes(params: int, precision: str = "fp16", training: bool = True, optimizer: str = "adam",
                              batch_size: int = 1, seq_length: int = 2048, hidden_dim: int = 4096,
                              num_layers: int = 32) -> int:
    """Seed 000 (/work/shared/seeds/000_*.txt, lines 342-407) `will_it_fit`, its `total` in bytes.

    params * bpp weights; training: Adam "3 FP32 copies" (params * 4 * 3: master + momentum + variance; SGD
    params * 4), gradients params * bpp, activations 12 * hidden * seq * layers * bpp * batch; inference: a
    KV cache of 2 * layers * (hidden // 128) heads * 128 * bpp per token (every head its own K and V: GQA is
    ignored, docs/seed-errata.md) times batch * seq. Any other optimizer string gets no states, as written.
    """
    bpp = SEED000_BPP[precision]
    param_mem = params * bpp
    num_heads = hidden_dim // 128  # "Standard head_dim = 128"
    kv_per_token = 2 * num_layers * num_heads * 128 * bpp
    kv_cache = kv_per_token * batch_size * seq_length if not training else 0
    if training and optimizer == "adam":
        opt_mem = params * 4 * 3
    elif training and optimizer == "sgd":
        opt_mem = params * 4
    else:
        opt_mem = 0
    grad_mem = params * bpp if training else 0
    act_mem = SEED000_K * hidden_dim * seq_length * num_layers * bpp * batch_size if training else 0
    return round(param_mem + opt_mem + grad_mem + act_mem + kv_cache)


def seed002_training_bytes(params: int, precision_bytes: int = 2, optimizer: str = "adam") -> int:
    """Seed 002 (/work/shared/seeds/002_*.txt, "Quick Estimation Shortcut") `estimate_training_memory_gb`, in bytes.

    (params * pb + grads params * pb + optimizer params * {sgd: 4, adam: 8} + activations 1.5 * params * pb)
    * 1.15 "overhead buffer". The post's own example is wrong: for 7B in bf16 with Adam the function returns
    (14 + 14 + 56 + 21) * 1.15 = 120.75 GB, not the "~73.6 GB" printed beside it.
    """
    params_b = params * precision_bytes
    grads_b = params * precision_bytes
    opt_b = params * {"sgd": 4, "adam": 8}[optimizer]
    act_b = params_b * 1.5
    return round((params_b + grads_b + opt_b + act_b) * 1.15)


SEED003_BPP = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}  # seed 003's precision table


def seed003_inference_bytes(params: int, precision: str = "bf16") -> int:
    """Seed 003 (/work/shared/seeds/003_*.txt, "The Math of Memory Estimation"): inference
    Total VRAM = (Parameters * Bytes per Parameter) * 1.2, the 1.2 "for CUDA kernels and the KV cache"
    whatever the batch or the context length."""
    return round(params * SEED003_BPP[precision] * 1.2)


ACCELERATE_DTYPE_DIVISOR = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}  # estimate.py gather_data


def accelerate_estimate_memory_bytes(params: int, dtype: str = "float16", training: bool = False) -> int:
    """`accelerate estimate-memory` (huggingface/accelerate src/accelerate/commands/estimate.py, 1.15.0 and
    main at 00e4d264): the "Total Size" column, or with `training` the "Training using Adam" column.

    The model is built on the meta device in float32, so its size is 4 bytes * parameters (buffers aside; tied
    weights once). "Total Size" divides it by 2 / 4 / 8 for float16 / int8 / int4. "Training using Adam" is
    `max(estimate_training_usage(fp32 size, dtype).values())`, the components NOT summed: float32 gives
    max(model S, gradients S, optimizer 2S, step 4S) = 4S; float16 gives max(S, 1.5S, 2S, 2S) = 2S, i.e. 4x the
    float16 size. int8/int4 have no training figure ("N/A"): this returns -1 for them, as the source does.
    """
    fp32_size = 4 * params
    if not training:
        return fp32_size // ACCELERATE_DTYPE_DIVISOR[dtype]
    if dtype == "float32":
        return max(fp32_size, fp32_size, fp32_size * 2, fp32_size * 4)
    if dtype == "float16":
        return max(fp32_size, fp32_size + fp32_size // 2, fp32_size * 2, fp32_size * 2)
    return -1


def deepspeed_zero2_model_states_bytes(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1) -> int:
    """DeepSpeed `estimate_zero2_model_states_mem_needs(..., cpu_offload=False)` gpu_mem (deepspeedai/DeepSpeed
    deepspeed/runtime/zero/stage_1_and_2.py at 02aa38c3): 2 * P + int(18 * P / total_gpus), "2 = params_16bit,
    18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit". Model states only: no
    activations, no buffers. (Older releases wrote 4 * P + int(16 * P / total_gpus); equal on one GPU.)"""
    total_gpus = num_nodes * num_gpus_per_node
    return 2 * total_params + int(18 * total_params / total_gpus)


def deepspeed_zero3_model_states_bytes(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                       num_nodes: int = 1) -> int:
    """DeepSpeed `estimate_zero3_model_states_mem_needs(..., cpu_offload=False)` gpu_mem (deepspeedai/DeepSpeed
    deepspeed/runtime/zero/stage3.py at 007cca6a): 4 * largest_layer_params + int(18 * P / total_gpus).
    Model states only. largest_layer_params: the most parameters held directly by one module (model_to_params)."""
    total_gpus = num_nodes * num_gpus_per_node
    return 4 * largest_layer_params + int(18 * total_params / total_gpus)


def korthikanti_activation_bytes(seq: int, batch: int, hidden: int, heads: int, layers: int) -> int:
    """Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, no parallelism: s*b*h*(34 + 5*a*s/h) bytes per layer,
    i.e. 34*s*b*h + 5*a*s^2*b, times the layers. 16-bit activations, dropout, attention scores materialised."""
    return layers * (34 * seq * batch * hidden + 5 * heads * seq * seq * batch)


VRAM_ESTIMATOR_STATES = {"adam": 3, "adamw": 2, "sgd": 1}  # vram_estimator.py optimizer_memory, as written


def vram_estimator_training_bytes(params: int, seq: int, batch: int, hidden: int, heads: int, layers: int,
                                  optimizer: str = "adamw", mixed_precision: bool = False, zero_stage: int = 0,
                                  num_gpus: int = 1, gradient_checkpointing: bool = False) -> int:
    """Weights + gradients + optimizer states + Korthikanti activations, as tvosch/VRAM-estimator
    `vram_required` (vram_estimator.py at d861c9b4) completes the paper's activation formula into a total.

    Weights 2 bytes/param (bf16), or 4 + 2 with mixed precision; gradients 4 (fp32); states 4 bytes times
    {adam: 3, adamw: 2, sgd: 1}; ZeRO stage 1 divides the states by num_gpus, stage 2 states and gradients,
    stage 3 all three. Activations `korthikanti_activation_bytes`; with checkpointing the source takes the
    square root of the activation size in GB (dimensionally odd, kept as written). The source rounds the
    activations to 0.01 GB; this does not.
    """
    model_b = params * (4 + 2) if mixed_precision else params * 2
    grads_b = params * 4
    opt_b = VRAM_ESTIMATOR_STATES[optimizer] * params * 4
    if zero_stage == 0:
        states = model_b + grads_b + opt_b
    elif zero_stage == 1:
        states = model_b + grads_b + opt_b / num_gpus
    elif zero_stage == 2:
        states = model_b + (grads_b + opt_b) / num_gpus
    else:
        states = (model_b + grads_b + opt_b) / num_gpus
    act_b = korthikanti_activation_bytes(seq, batch, hidden, heads, layers)
    if gradient_checkpointing:
        act_b = (act_b / 10**9) ** 0.5 * 10**9
    return round(states + act_b)


# ------------------------------------------------------------------------------------------ applying them

# Precision names of the seeds' tables for our weight formats (inference) or compute precision (training).
_PEER_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "int8": "int8", "gptq-8bit": "int8",
               "nf4": "int4", "fp4": "int4", "gptq-4bit": "int4", "awq-4bit": "int4"}
_SEED_OPTIMIZER = {"adamw": "adam", "adam": "adam", "sgd": "sgd", "sgd-momentum": "sgd"}
_ACCELERATE_DTYPE = {"fp32": "float32", "bf16": "float16", "fp16": "float16", "int8": "int8", "int4": "int4"}
_ZERO_STAGE = {"zero1": 1, "zero2": 2, "fsdp-grad-op": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}


def _dtype(w: Workload) -> str | None:
    """The precision a user would give a peer rule: the compute precision for training, the stored weight
    format for inference (auto = the precision); None for formats the rules have no entry for (fp8, GGUF)."""
    if w.mode == "train" or w.weight_format == "auto":
        return w.precision
    return _PEER_DTYPE.get(w.weight_format)


def largest_module_params(model: Model) -> int:
    """DeepSpeed stage3 `model_to_params`' largest_layer_params: the most parameters one module holds itself.
    The token embedding or lm_head (V * h), or one Linear, or a layer's fused experts (transformers 5 keeps all
    E experts' gate/up/down matrices in one module)."""
    inv = model.inventory
    biggest = max([model.vocab * model.hidden] + [fi * fo for _, fi, fo, *_ in inv.linears])
    experts = [(shape, n) for role, shape, _, n in inv.param_groups if role == "expert"]
    if experts:
        moe_layers = max(n for _, n in experts)  # one fused tensor of each kind per MoE layer
        biggest = max(biggest, inv.params_by_role["expert"] // moe_layers)
    return biggest


def _seed000(m: Model, w: Workload, p: Parallel) -> int | None:
    dtype, opt = _dtype(w), _SEED_OPTIMIZER.get(w.optimizer)
    if dtype is None or (w.mode == "train" and opt is None):
        return None
    # inference: the cache holds prompt + generated tokens at the end, the length a user would enter
    seq = w.seq if w.mode == "train" else w.seq + w.gen_tokens
    return seed000_will_it_fit_bytes(m.params, dtype, w.mode == "train", opt or "adam", w.batch, seq,
                                     m.hidden, m.layers)


def _seed002(m: Model, w: Workload, p: Parallel) -> int | None:
    opt = _SEED_OPTIMIZER.get(w.optimizer)
    if w.mode != "train" or opt is None:
        return None
    return seed002_training_bytes(m.params, {"fp32": 4, "bf16": 2, "fp16": 2}[w.precision], opt)


def _seed003(m: Model, w: Workload, p: Parallel) -> int | None:
    dtype = _dtype(w)
    return seed003_inference_bytes(m.params, dtype) if w.mode == "infer" and dtype else None


def _accelerate(m: Model, w: Workload, p: Parallel) -> int | None:
    dtype = _ACCELERATE_DTYPE.get(_dtype(w) or "")
    if dtype is None or (w.mode == "train" and (w.optimizer not in ("adam", "adamw") or dtype not in
                                                ("float32", "float16"))):
        return None
    return accelerate_estimate_memory_bytes(m.params, dtype, w.mode == "train")


def _zero_gpus(p: Parallel) -> int:
    return p.dp_size if p.strategy in _ZERO_STAGE else 1


def _deepspeed_zero2(m: Model, w: Workload, p: Parallel) -> int | None:
    if w.mode != "train" or w.optimizer not in ("adam", "adamw"):
        return None
    return deepspeed_zero2_model_states_bytes(m.params, _zero_gpus(p))


def _deepspeed_zero3(m: Model, w: Workload, p: Parallel) -> int | None:
    if w.mode != "train" or w.optimizer not in ("adam", "adamw"):
        return None
    return deepspeed_zero3_model_states_bytes(m.params, largest_module_params(m), _zero_gpus(p))


def _vram_estimator(m: Model, w: Workload, p: Parallel) -> int | None:
    opt = w.optimizer if w.optimizer in VRAM_ESTIMATOR_STATES else None
    if w.mode != "train" or opt is None:
        return None
    return vram_estimator_training_bytes(m.params, w.seq, w.batch, m.hidden, m.heads, m.layers, opt,
                                         w.recipe in ("amp", "mixed"), _ZERO_STAGE.get(p.strategy, 0), p.gpus,
                                         w.checkpointing != "none")


# name -> (rule applied to one workload, the modes it covers, where it comes from)
PEERS = {
    "seed000": (_seed000, ("train", "infer"), "seed 000 will_it_fit (k=12, Adam as 3 fp32 copies, MHA KV)"),
    "seed002": (_seed002, ("train",), "seed 002 estimate_training_memory_gb (act 1.5x params, x1.15)"),
    "seed003": (_seed003, ("infer",), "seed 003 inference rule (params x bytes x 1.2)"),
    "accelerate": (_accelerate, ("train", "infer"), "accelerate estimate-memory (Total Size / Training using Adam)"),
    "deepspeed-zero2": (_deepspeed_zero2, ("train",), "DeepSpeed estimate_zero2_model_states_mem_needs, no offload"),
    "deepspeed-zero3": (_deepspeed_zero3, ("train",), "DeepSpeed estimate_zero3_model_states_mem_needs, no offload"),
    "korthikanti": (_vram_estimator, ("train",), "Korthikanti Table 2 activations + VRAM-estimator states"),
}


def peer_predictions(model: Model, workload: Workload, parallel: Parallel = Parallel()) -> tuple[tuple[str, int], ...]:
    """(peer name, predicted bytes per GPU) for every rule in PEERS that covers this workload, in PEERS order."""
    out = []
    for name, (rule, modes, _) in PEERS.items():
        if workload.mode in modes:
            value = rule(model, workload, parallel)
            if value is not None and value >= 0:
                out.append((name, int(value)))
    return tuple(out)
