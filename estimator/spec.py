"""Workload and parallelism specs: the one vocabulary shared by the estimator, bench and the app.

Every field name and allowed value here is also a CLI flag value (`python -m estimator`), a column of
the `runs` table (`bench/schema.sql`) and a widget in the app. Validation lives in `__post_init__` and
raises `ValueError` naming the field and the allowed values.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

MODES = ("train", "infer")
METHODS = ("full", "lora", "qlora")
# pure: everything in --precision; amp: fp32 weights/grads/states + autocast; mixed: half weights and grads +
# fp32 master and states (DeepSpeed, Megatron); fp32; fsdp-mp: FSDP2 MixedPrecisionPolicy(param_dtype=half,
# reduce_dtype=fp32): fp32 sharded weights, grads and states, half gathered weights for compute.
RECIPES = ("pure", "amp", "mixed", "fp32", "fsdp-mp")
PRECISIONS = ("bf16", "fp16", "fp32")
# Weight storage formats. "auto" = the recipe's weight dtype (training) or --precision (inference).
WEIGHT_FORMATS = (
    "auto", "fp32", "bf16", "fp16", "fp8", "int8",
    "nf4", "fp4",                      # bitsandbytes 4-bit
    "gptq-4bit", "gptq-8bit", "awq-4bit",  # group-wise integer
    "gguf-q8_0", "gguf-q6_k", "gguf-q5_k_m", "gguf-q4_k_m", "gguf-q4_0", "gguf-q3_k_m", "gguf-q2_k",
)
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor", "lion",
              "paged-adamw", "paged-adamw-8bit")  # paged: bitsandbytes PagedAdamW(8bit), states in CUDA unified memory
PAGED_OPTIMIZERS = ("paged-adamw", "paged-adamw-8bit")
OPTIMIZER_IMPLS = ("foreach", "fused", "forloop")
# full: every decoder layer (HF gradient_checkpointing_enable); selective: the attention core (Megatron,
# arXiv 2205.05198 sec. 4.2); op-sac: torchtitan's per-op policy (save matmul outputs every other mm, SDPA and
# collective outputs; torchtitan/distributed/activation_checkpoint.py `SelectiveAC`, formerly `_save_list`)
CHECKPOINTING = ("none", "full", "selective", "op-sac")
ATTENTION = ("sdpa", "flash", "eager")
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8")
STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp", "tp", "pp", "ep")
OFFLOADS = ("none", "optimizer", "optimizer+params")
# What the training loop keeps alive: HF Trainer and torchtune keep only the loss; seed 000's harness and
# litgpt's loops keep the model output (logits) through backward and the optimizer step.
LOOPS = ("loss-only", "keep-output")
# The loss: full cross-entropy on materialised logits (HF ForCausalLMLoss); chunked (torchtune
# CEWithChunkedOutputLoss, litgpt chunked_cross_entropy: the lm_head output and its fp32 upcast per chunk);
# fused-linear (Liger LigerFusedLinearCrossEntropyLoss: logits never materialised beyond one chunk).
LOSSES = ("full", "chunked", "fused-linear")
# Which Linears QLoRA stores in 4-bit: every Linear of the decoder blocks (bitsandbytes replace_with_bnb_linear,
# as litgpt and PEFT load them) or only the Linears that carry LoRA adapters (torchtune lora_*_qlora builders).
QUANTIZE_SCOPES = ("all", "adapted")
MAX_LOSS_CHUNKS = 4096

# Bounds keep sweeps and contributed rows sane; they are far above any real run.
MAX_BATCH = 1 << 20
MAX_SEQ = 1 << 24
MAX_GPUS = 1 << 16
MAX_LORA_RANK = 1 << 16


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is not allowed; choose one of {', '.join(allowed)}")


def _check_int(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: {value} is out of range; allowed {lo}..{hi}")


@dataclass(frozen=True)
class Workload:
    """What the user runs on the model. Defaults are a common single-GPU bf16 fine-tune."""

    mode: str = "train"                 # train: forward+backward+optimizer step; infer: prefill + decode
    method: str = "full"                # full fine-tune, LoRA adapters, or QLoRA (4-bit frozen base + LoRA)
    lora_rank: int = 8                  # r of every adapter; PEFT default is 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")  # PEFT's default for Llama-family models
    recipe: str = "pure"                # which tensors hold which dtype in training, see estimator.components
    precision: str = "bf16"             # compute / activation dtype (and weight dtype unless recipe says otherwise)
    weight_format: str = "auto"         # storage of the (frozen / inference) weights; "auto" = from recipe/precision
    optimizer: str = "adamw"            # PyTorch / bitsandbytes / transformers optimizer
    optimizer_impl: str = "foreach"     # PyTorch's default on CUDA is foreach (torch/optim/optimizer.py)
    batch: int = 1                      # micro-batch per GPU (sequences)
    seq: int = 2048                     # training sequence length, or prompt length for inference
    gen_tokens: int = 0                 # tokens generated after the prompt (inference only)
    grad_accum: int = 1                 # micro-batches accumulated per optimizer step
    checkpointing: str = "none"         # activation checkpointing: none, full (per layer) or selective (attention)
    attention: str = "sdpa"             # eager materialises the s x s scores; sdpa/flash do not
    kv_dtype: str = "auto"              # KV-cache dtype; "auto" = precision
    loop: str = "loss-only"             # what the training loop keeps alive through backward and the step
    loss: str = "full"                  # full | chunked | fused-linear cross-entropy (LOSSES)
    loss_chunks: int = 8                # chunks of the sequence for loss='chunked' (torchtune num_output_chunks=8)
    optimizer_in_backward: bool = False  # step each parameter in its post-accumulate-grad hook, free its grad
    activation_offload: bool = False    # saved activations moved to CPU (torchtune OffloadActivations)
    quantize_scope: str = "all"         # QLoRA: 4-bit on every block Linear (all) or the adapted ones only
    double_quant: bool = True           # QLoRA: quantize the 4-bit absmax scales again (arXiv 2305.14314 sec. 3)
    float8: bool = False                # torchao float8 training of the block Linears (tensorwise scaling)
    compile: bool = False               # torch.compile'd model: what AOTAutograd's partitioner saves (traced)

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        _check_choice("method", self.method, METHODS)
        _check_choice("recipe", self.recipe, RECIPES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("weight_format", self.weight_format, WEIGHT_FORMATS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _check_choice("attention", self.attention, ATTENTION)
        _check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _check_choice("loop", self.loop, LOOPS)
        _check_choice("loss", self.loss, LOSSES)
        _check_choice("quantize_scope", self.quantize_scope, QUANTIZE_SCOPES)
        _check_int("loss_chunks", self.loss_chunks, 1, MAX_LOSS_CHUNKS)
        for name in ("optimizer_in_backward", "activation_offload", "double_quant", "float8", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        _check_int("batch", self.batch, 1, MAX_BATCH)
        _check_int("seq", self.seq, 1, MAX_SEQ)
        _check_int("gen_tokens", self.gen_tokens, 0, MAX_SEQ)
        _check_int("grad_accum", self.grad_accum, 1, MAX_BATCH)
        _check_int("lora_rank", self.lora_rank, 1, MAX_LORA_RANK)
        if not isinstance(self.lora_targets, tuple) or not self.lora_targets:
            raise ValueError("lora_targets: must be a non-empty tuple of module names, e.g. ('q_proj', 'v_proj')")
        for t in self.lora_targets:
            if not isinstance(t, str) or not t.replace("_", "").replace(".", "").isalnum() or len(t) > 64:
                raise ValueError(f"lora_targets: {t!r} is not a module name (letters, digits, '_', '.')")
        if self.mode == "infer":
            if self.method != "full":
                raise ValueError(f"method: {self.method!r} needs mode='train'; inference uses method='full'")
            if self.grad_accum != 1:
                raise ValueError("grad_accum: gradient accumulation needs mode='train'")
            if self.checkpointing != "none":
                raise ValueError("checkpointing: activation checkpointing needs mode='train'")
            for name in ("optimizer_in_backward", "activation_offload", "float8"):
                if getattr(self, name):
                    raise ValueError(f"{name}: needs mode='train'")
            if self.loop != "loss-only" or self.loss != "full":
                raise ValueError("loop: the training loop and loss settings need mode='train'; inference uses "
                                 "loop='loss-only', loss='full'")
        else:
            if self.gen_tokens != 0:
                raise ValueError("gen_tokens: generated tokens need mode='infer'")
        if self.method == "qlora":
            if self.weight_format not in ("auto", "nf4", "fp4"):
                raise ValueError(f"weight_format: qlora stores the base in 4-bit; use nf4 or fp4, not {self.weight_format!r}")
            if self.recipe == "fp32" or self.precision == "fp32":
                raise ValueError("recipe: qlora computes in bf16/fp16; fp32 weights contradict a 4-bit base")
        if self.mode == "train" and self.method == "full" and self.weight_format not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(
                f"weight_format: {self.weight_format!r} weights cannot be fully fine-tuned; "
                "use method='lora'/'qlora' or a float format (fp32, bf16, fp16)")
        if self.recipe == "fp32" and self.precision != "fp32":
            raise ValueError("precision: recipe 'fp32' needs precision='fp32'")
        if self.recipe in ("amp", "mixed", "fsdp-mp") and self.precision == "fp32":
            raise ValueError(f"precision: recipe {self.recipe!r} needs a half precision (bf16 or fp16)")
        if self.optimizer in ("adamw-8bit", *PAGED_OPTIMIZERS) and self.optimizer_impl == "fused":
            raise ValueError(f"optimizer_impl: bitsandbytes {self.optimizer} has no 'fused' variant; use foreach or forloop")
        if self.loss_chunks != 8 and self.loss != "chunked":
            raise ValueError("loss_chunks: sets the chunks of loss='chunked'; leave it at 8 for other losses")
        if self.optimizer_in_backward and self.grad_accum != 1:
            raise ValueError("optimizer_in_backward: steps in backward, so it cannot accumulate gradients; "
                             "use grad_accum=1 (torchtune refuses the combination too)")
        if self.quantize_scope != "all" and self.method != "qlora":
            raise ValueError("quantize_scope: chooses which Linears QLoRA quantizes; needs method='qlora'")
        if self.float8 and self.method != "full":
            raise ValueError("float8: torchao float8 training converts trainable Linears; needs method='full'")
        if self.float8 and self.precision != "bf16":
            raise ValueError("float8: torchao float8 training computes in bf16; needs precision='bf16'")

    @property
    def training(self) -> bool:
        return self.mode == "train"


@dataclass(frozen=True)
class Parallel:
    """How the run is split over GPUs. `gpus` is the world size; tp*pp*ep must divide it."""

    strategy: str = "single"  # single GPU, or one of STRATEGIES
    gpus: int = 1             # world size
    tp: int = 1               # tensor-parallel degree (strategy 'tp' sets it to gpus if left at 1)
    pp: int = 1               # pipeline stages (strategy 'pp' sets it to gpus if left at 1)
    ep: int = 1               # expert-parallel degree for MoE (strategy 'ep')
    sequence_parallel: bool = False  # Megatron sequence parallelism (shards LayerNorm/dropout activations over tp)
    offload: str = "none"     # ZeRO-Offload / FSDP CPU offload of optimizer states (and params)
    hsdp_shard: int = 0       # HSDP shard-group size (0 = gpus // 2, i.e. 2 replicas); only for strategy 'hsdp'

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("offload", self.offload, OFFLOADS)
        _check_int("gpus", self.gpus, 1, MAX_GPUS)
        _check_int("tp", self.tp, 1, MAX_GPUS)
        _check_int("pp", self.pp, 1, MAX_GPUS)
        _check_int("ep", self.ep, 1, MAX_GPUS)
        _check_int("hsdp_shard", self.hsdp_shard, 0, MAX_GPUS)
        if self.strategy == "single" and self.gpus != 1:
            raise ValueError(f"strategy: 'single' runs on one GPU, got gpus={self.gpus}; pick ddp, zero1..3, fsdp, tp or pp")
        if self.tp * self.pp * self.ep > self.gpus or self.gpus % (self.tp * self.pp * self.ep):
            raise ValueError(f"gpus: tp*pp*ep = {self.tp * self.pp * self.ep} must divide gpus={self.gpus}")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("sequence_parallel: needs tensor parallelism (tp > 1 or strategy 'tp')")
        if self.offload != "none" and self.strategy not in ("zero1", "zero2", "zero3", "fsdp", "single"):
            raise ValueError(f"offload: CPU offload needs strategy zero1/zero2/zero3/fsdp, not {self.strategy!r}")
        if self.strategy == "hsdp" and self.hsdp_shard and self.gpus % self.hsdp_shard:
            raise ValueError(f"hsdp_shard: {self.hsdp_shard} must divide gpus={self.gpus}")

    @property
    def tp_size(self) -> int:
        return self.gpus if (self.strategy == "tp" and self.tp == 1) else self.tp

    @property
    def pp_size(self) -> int:
        return self.gpus if (self.strategy == "pp" and self.pp == 1) else self.pp

    @property
    def ep_size(self) -> int:
        return self.gpus if (self.strategy == "ep" and self.ep == 1) else self.ep

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas (the ZeRO/FSDP shard group spans these)."""
        return max(1, self.gpus // (self.tp_size * self.pp_size * (self.ep_size if self.strategy != "ep" else 1)))


def spec_dict(obj) -> dict:
    """A dataclass as a flat JSON-friendly dict (tuples become comma-joined strings for lora_targets)."""
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = ",".join(v) if isinstance(v, tuple) else v
    return out
