"""One pure function per memory component. Every function returns integer bytes and cites what it mirrors.

Precision recipes (training), bytes per trainable parameter with AdamW:
    pure   weights, grads and Adam states all in `precision` (torchtune / litgpt "bf16-true"):   2+2+4   =  8
    amp    fp32 weights, grads, states; autocast computes in half (PyTorch AMP, HF Trainer bf16=True): 4+4+8 = 16
    mixed  half weights and grads + fp32 master copy + fp32 states (DeepSpeed, Megatron, apex O2): 2+2+4+8 = 16
    fp32   everything fp32:                                                                        4+4+8   = 16
Seed 002 says optimizer states "are always stored in fp32, regardless of your model precision". That is wrong
for `pure` training: torch.optim creates states with `torch.zeros_like(param)` (torch/optim/adam.py `_init_group`),
so a bf16 model has bf16 states.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from crosscheck.model import ModelSpec
from estimator.spec import Workload
from estimator.units import MiB, dtype_bytes

# ---------------------------------------------------------------- weights, by storage format

# bitsandbytes 4-bit (bitsandbytes/functional.py quantize_4bit): 64-element blocks, one fp32 absmax per block.
# With double quantization (QLoRA, arXiv 2305.14314 sec. 3) the absmaxes are themselves 8-bit quantized in blocks
# of 256 with one fp32 absmax per block, + an fp32 offset; 0.5 -> 0.127 bits/param of overhead.
BNB4_BLOCK = 64
BNB4_DQ_BLOCK = 256
BNB4_DOUBLE_QUANT = True  # QLoRA's recipe; HF BitsAndBytesConfig defaults to False (then 4 B per 64 weights)
# GPTQ / AWQ (AutoGPTQ / AutoAWQ QuantLinear): packed int weights, fp16 scale + packed zero per (group, column).
GPTQ_GROUP = 128
# GGUF bits per weight of each block type: ggml/src/ggml-common.h block structs (e.g. block_q4_K = 144 bytes per
# 256 weights = 4.5 bpw); *_K_M files mix types per tensor, so use llama.cpp's quantize table average for those.
GGUF_BPW = {"gguf-q8_0": 8.5, "gguf-q6_k": 6.5625, "gguf-q5_k_m": 5.67, "gguf-q4_k_m": 4.83,
            "gguf-q4_0": 4.5, "gguf-q3_k_m": 3.89, "gguf-q2_k": 2.625}


def quantized_matrix_bytes(rows: int, cols: int, fmt: str) -> int:
    """Bytes of one (rows=out_features, cols=in_features) weight matrix stored in `fmt`, incl. scales/zeros."""
    n = rows * cols
    if fmt in ("fp32", "bf16", "fp16", "fp8"):
        return n * dtype_bytes(fmt) + (4 if fmt == "fp8" else 0)  # fp8: one fp32 per-tensor scale
    if fmt == "int8":  # bitsandbytes LLM.int8 (Int8Params): int8 weights + one fp32 scale per output row (SCB)
        return n + 4 * rows
    if fmt in ("nf4", "fp4"):
        blocks = -(-n // BNB4_BLOCK)
        packed = -(-n // 2)
        if BNB4_DOUBLE_QUANT:
            return packed + blocks + 4 * -(-blocks // BNB4_DQ_BLOCK) + 4
        return packed + 4 * blocks
    if fmt.startswith(("gptq-", "awq-")):
        bits = int(fmt.split("-")[1].rstrip("bit"))
        groups = -(-cols // GPTQ_GROUP)
        body = n * bits // 8
        scales = groups * rows * 2            # fp16 scales
        zeros = groups * rows * bits // 8     # packed zero points
        g_idx = 4 * cols if fmt.startswith("gptq-") else 0  # GPTQ act-order index, int32 per input column
        return body + scales + zeros + g_idx
    if fmt in GGUF_BPW:
        return int(n * GGUF_BPW[fmt] / 8)
    raise ValueError(f"weight_format: {fmt!r} is not a known storage format")


def weight_format(workload: Workload) -> str:
    """The storage format of the (frozen or inference) weights that `auto` resolves to."""
    if workload.weight_format != "auto":
        return workload.weight_format
    if workload.method == "qlora":
        return "nf4"
    if workload.mode == "train" and workload.recipe in ("amp", "fp32"):
        return "fp32"
    return workload.precision


@lru_cache(maxsize=4096)  # pure in its hashable arguments; loops over every Linear of the model
def weights_bytes(model: ModelSpec, fmt: str, float_dtype: str) -> int:
    """Bytes of all model weights with the transformer-block Linear layers stored in `fmt`.

    What the quantizing libraries leave alone stays in `float_dtype`: embeddings, the lm_head and all 1-D
    parameters (norms, biases), as bitsandbytes' `replace_with_bnb_linear` skips `lm_head` and non-Linear
    modules, and AutoGPTQ/AutoAWQ convert only the decoder layers' Linear modules. GGUF quantizes the
    embedding and output matrices too (llama.cpp `llama_model_quantize`), keeping norms in fp32.
    """
    fb = dtype_bytes(float_dtype)
    total = 0
    for n, lin in model.linears():
        total += n * lin.count * quantized_matrix_bytes(lin.out_features, lin.in_features, fmt)
        if lin.bias:
            total += n * lin.count * lin.out_features * fb
    other = model.params - model.linear_params - sum(n * lin.count * lin.out_features
                                                     for n, lin in model.linears() if lin.bias)
    big = model.embedding_params + model.lm_head_params  # embedding-like matrices inside `other`
    if fmt in GGUF_BPW:
        total += quantized_matrix_bytes(1, big, "gguf-q6_k" if fmt != "gguf-q8_0" else fmt)
        total += (other - big) * 4
    else:
        total += other * fb
    return total


# ---------------------------------------------------------------- trainable parameters (full, LoRA)

def lora_target_names(model: ModelSpec) -> list[str]:
    """Module names a LoRA target can name in this model: its Linear modules except fused routed experts
    (PEFT matches the last component of the module name; experts in transformers 5 are 3-D Parameters)."""
    return sorted({lin.name.split(".")[-1] for _, lin in model.linears() if lin.role != "expert"})


def lora_target_shapes(model: ModelSpec, targets: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """(layers x count, in, out) of every Linear a LoRA target name matches (PEFT matches on the module name's
    last component, peft/tuners/tuners_utils.py `check_target_module_exists`). Routed experts stored as fused
    3-D Parameters in transformers 5 (Mixtral, Qwen-MoE, DeepSeek) are not nn.Linear and cannot be targeted."""
    return list(_lora_target_shapes(model, tuple(targets)))


@lru_cache(maxsize=4096)  # per (frozen model, targets): estimate() asks several times per call, sweeps thousands
def _lora_target_shapes(model: ModelSpec, targets: tuple[str, ...]) -> tuple[tuple[int, int, int], ...]:
    shapes = []
    for t in targets:
        hits = [(n * lin.count, lin.in_features, lin.out_features) for n, lin in model.linears()
                if lin.role != "expert" and (lin.name == t or lin.name.split(".")[-1] == t)]
        if not hits:
            raise ValueError(f"lora_targets: {t!r} matches no Linear module of {model.model_type}; "
                             f"available: {', '.join(lora_target_names(model))}")
        shapes += hits
    return tuple(shapes)


def lora_params(model: ModelSpec, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA adapter parameters: r*(in + out) per targeted Linear (A: r x in, B: out x r; PEFT LoraLayer).

    Llama-2-7B, r=8 on q_proj,v_proj: 32 layers * 2 * 8 * (4096 + 4096) = 4,194,304 (what PEFT prints)."""
    return sum(k * rank * (i + o) for k, i, o in lora_target_shapes(model, targets))


def trainable_params(model: ModelSpec, workload: Workload) -> int:
    if workload.mode == "infer":
        return 0
    if workload.method == "full":
        return model.params
    return lora_params(model, workload.lora_rank, workload.lora_targets)


def trainable_tensor_shapes(model: ModelSpec, workload: Workload) -> list[tuple[int, int, int]]:
    """(copies, rows, cols) of every trainable tensor; vectors have cols == 1. Drives per-tensor optimizer terms."""
    targets = workload.lora_targets if workload.method != "full" else ()
    return list(_trainable_tensor_shapes(model, workload.method != "full", targets, workload.lora_rank))


@lru_cache(maxsize=4096)
def _trainable_tensor_shapes(model: ModelSpec, lora: bool, targets: tuple[str, ...],
                             rank: int) -> tuple[tuple[int, int, int], ...]:
    if lora:
        shapes = []
        for k, i, o in _lora_target_shapes(model, targets):
            shapes += [(k, rank, i), (k, o, rank)]
        return tuple(shapes)
    shapes = [(n * lin.count, lin.out_features, lin.in_features) for n, lin in model.linears()]
    shapes += [(n * lin.count, lin.out_features, 1) for n, lin in model.linears() if lin.bias]
    shapes.append((1, model.vocab, model.hidden))
    if model.lm_head_params:
        shapes.append((1, model.vocab, model.hidden))
    rest = model.params - sum(c * r * k for c, r, k in shapes)
    shapes.append((max(rest // model.hidden, 0), model.hidden, 1))  # norms etc., as h-sized vectors
    return tuple(shapes)


# ---------------------------------------------------------------- dtypes per recipe

@dataclass(frozen=True)
class RecipeDtypes:
    weight: str    # dtype of the weights the model computes with (trainable ones, for LoRA: the adapters)
    grad: str
    state: str     # optimizer-state dtype
    master: str | None  # dtype of a separate master copy, or None


def recipe_dtypes(workload: Workload) -> RecipeDtypes:
    """Dtypes of the trainable weights, their grads, optimizer states and master copy.

    LoRA/QLoRA adapters are fp32 whatever the base dtype: PEFT's `get_peft_model(..., autocast_adapter_dtype=True)`
    (the default since PEFT 0.12) upcasts bf16/fp16 adapter weights to fp32, so their grads and Adam states are
    fp32 too (8 B/param of states, measured by the traced tier)."""
    p = workload.precision
    if workload.method != "full":
        return RecipeDtypes("fp32", "fp32", "fp32", None)
    if workload.recipe == "pure":
        return RecipeDtypes(p, p, p, None)
    if workload.recipe == "mixed":
        return RecipeDtypes(p, p, "fp32", "fp32")
    return RecipeDtypes("fp32", "fp32", "fp32", None)  # amp and fp32


def gradient_bytes(trainable: int, grad_dtype: str) -> int:
    """One gradient per trainable parameter in the gradient dtype (param.grad matches param.dtype)."""
    return trainable * dtype_bytes(grad_dtype)


def master_weight_bytes(trainable: int, recipe: str) -> int:
    """fp32 master copy of the trainable weights, only in the `mixed` recipe (DeepSpeed bf16/fp16 optimizer,
    Megatron `Float16OptimizerWithFloat16Params`): 4 bytes per trainable parameter."""
    return 4 * trainable if recipe == "mixed" else 0


# ---------------------------------------------------------------- optimizer states and step temporaries

BNB_8BIT_BLOCK = 2048      # bitsandbytes blockwise 8-bit optimizer block size (optimizer_update_8bit_blockwise)
BNB_MIN_8BIT_SIZE = 4096   # tensors smaller than this keep 32-bit states (bnb Optimizer8bit min_8bit_size)


def optimizer_state_bytes(shapes: list[tuple[int, int, int]], optimizer: str, state_dtype: str) -> int:
    """Persistent optimizer state for trainable tensors of the given (copies, rows, cols) shapes.

    sgd 0; sgd-momentum 1 buffer (torch SGD momentum_buffer); adam/adamw 2 (exp_avg, exp_avg_sq); lion 1
    (exp_avg, arXiv 2302.06675 Alg. 2); adafactor: row + column factors of the second moment for matrices and a
    full second moment for vectors, no first moment (torch.optim.Adafactor, beta1-free, arXiv 1804.04235);
    adamw-8bit: two uint8 states + one fp32 absmax per 2048-block each, 32-bit states for tensors < 4096
    elements (bitsandbytes/optim/optimizer.py Optimizer8bit.init_state).
    """
    sb = dtype_bytes(state_dtype)
    total = 0
    for copies, rows, cols in shapes:
        n = rows * cols
        if optimizer in ("adam", "adamw"):
            per = 2 * n * sb
        elif optimizer in ("sgd-momentum", "lion"):
            per = n * sb
        elif optimizer == "sgd":
            per = 0
        elif optimizer == "adafactor":
            per = (rows + cols) * sb if cols > 1 else n * sb
        elif optimizer == "adamw-8bit":
            per = 2 * (n + 4 * -(-n // BNB_8BIT_BLOCK)) if n >= BNB_MIN_8BIT_SIZE else 8 * n
        else:
            raise ValueError(f"optimizer: {optimizer!r} is not known")
        total += copies * per
    return total


def optimizer_step_temp_bytes(shapes: list[tuple[int, int, int]], optimizer: str, impl: str, state_dtype: str) -> int:
    """Transient bytes the optimizer step allocates on top of weights, grads and states.

    foreach Adam/AdamW (torch/optim/adam.py `_multi_tensor_adam`): `exp_avg_sq_sqrt = torch._foreach_sqrt(...)`
    materialises one state-sized tensor for every parameter at once. forloop (`_single_tensor_adam`): the same
    `denom` one parameter at a time, so the largest tensor. fused (`torch._fused_adamw_`): none.
    Adafactor: the reconstructed second moment (row x col outer product), per impl likewise. SGD without weight
    decay and Lion's sign update run in place; bitsandbytes 8-bit updates in its kernel.
    """
    if optimizer not in ("adam", "adamw", "adafactor") or impl == "fused":
        return 0
    sb = dtype_bytes(state_dtype)
    if impl == "foreach":
        return sum(c * r * k for c, r, k in shapes) * sb
    return max(r * k for _, r, k in shapes) * sb


# ---------------------------------------------------------------- KV cache

def kv_dtype(workload: Workload) -> str:
    return workload.precision if workload.kv_dtype == "auto" else workload.kv_dtype


def kv_cache_bytes(model: ModelSpec, batch: int, tokens: int, dtype: str) -> int:
    """K and V for every layer, KV head and cached token: 2 * L * kv_heads * head_dim * bytes per token
    (GQA/MQA use kv_heads, not heads: seeds 000-002 use hidden_size and overstate Llama-3-8B's cache 4x).
    MLA (DeepSeek-V2/V3, arXiv 2405.04434 eq. 10) caches the compressed latent (kv_lora_rank) plus the
    decoupled RoPE key (qk_rope_head_dim) per layer instead. HF DynamicCache stores exactly these tensors
    (for MLA in transformers 5 the cache holds the expanded per-head K/V; vLLM/SGLang cache the latent)."""
    return batch * tokens * model.kv_bytes_per_token_per_elem * dtype_bytes(dtype)


# ---------------------------------------------------------------- runtime overhead

@dataclass(frozen=True)
class Overhead:
    """Memory outside PyTorch tensors. Defaults are typical for CUDA 12 on Hopper; the calibration issue fits
    the context constant from measured rows (NVML used minus torch reserved)."""

    cuda_context_bytes: int = 500 * MiB     # driver context + kernel images with CUDA lazy loading (CUDA 11.7+)
    cublas_workspace_bytes: int = 32 * MiB  # PyTorch's cuBLAS(Lt) workspace on sm90 (aten CublasHandlePool.cpp)
    nccl_bytes_per_gpu: int = 512 * MiB     # NCCL channels/buffers (NCCL_BUFFSIZE 4 MiB x channels x peers)

    def __post_init__(self) -> None:
        for name in ("cuda_context_bytes", "cublas_workspace_bytes", "nccl_bytes_per_gpu"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: must be a non-negative integer number of bytes, got {v!r}")


def overhead_bytes(gpus: int, overhead: Overhead = Overhead()) -> int:
    """CUDA context + cuBLAS workspace, + NCCL buffers when more than one GPU communicates."""
    return overhead.cuda_context_bytes + overhead.cublas_workspace_bytes + (overhead.nccl_bytes_per_gpu if gpus > 1 else 0)
