"""The analytic components: what a traced profile cannot see, each in one function returning integer bytes.

A profile (estimator.profile) is traced with float weights, torch optimizers and the model's own KV cache
dtype. Everything a fake-tensor trace cannot run is priced here from the model's inventory and swapped into the
traced categories by estimator.estimate:
- stored weight formats: bitsandbytes LLM.int8 / NF4 / FP4 (with or without double quantization, on every block
  Linear or only the adapted ones), GPTQ / AWQ, GGUF, fp8;
- optimizers the trace cannot run (bitsandbytes 8-bit and paged AdamW, Adafactor, Lion) and their step;
- the fp32 master copy of the `mixed` recipe, the KV-cache dtype, the CUDA context and communication buffers.

Training recipes, bytes per trainable parameter with AdamW (weights + grads + states + master):
    pure     everything in --precision (torchtune, litgpt "bf16-true"):                       2+2+4     = 8
    amp      fp32 weights/grads/states, autocast copies (HF Trainer bf16=True):                4+4+8     = 16
    mixed    half weights and grads, fp32 master and states (DeepSpeed, Megatron):             2+2+8+4   = 16
    fp32     everything fp32:                                                                  4+4+8     = 16
    fsdp-mp  FSDP2 MixedPrecisionPolicy: fp32 sharded weights/grads/states, half gathered copy: 4+4+8 (+2 gathered)
Seed 002 says optimizer states "are always stored in fp32, regardless of your model precision". That is wrong
for `pure` training: torch.optim creates states with `torch.zeros_like(param)` (torch/optim/adam.py `_init_group`),
so a bf16 model has bf16 states.
"""
from __future__ import annotations

from dataclasses import dataclass

from estimator.inventory import Inventory
from estimator.spec import PAGED_OPTIMIZERS, Workload
from estimator.units import MiB, dtype_bytes

# bitsandbytes 4-bit (bitsandbytes/functional.py quantize_4bit): 64-element blocks, one fp32 absmax per block.
# With double quantization (QLoRA, arXiv 2305.14314 sec. 3) the absmaxes are themselves 8-bit quantized in blocks
# of 256 with one fp32 absmax per block, + an fp32 offset: 0.5 -> 0.127 bits/param of overhead.
BNB4_BLOCK = 64
BNB4_DQ_BLOCK = 256
# GPTQ / AWQ (AutoGPTQ / AutoAWQ QuantLinear): packed int weights, fp16 scale + packed zero per (group, column).
GPTQ_GROUP = 128
# GGUF bits per weight of each block type: ggml/src/ggml-common.h block structs (e.g. block_q4_K = 144 bytes per
# 256 weights = 4.5 bpw); *_K_M files mix types per tensor, so use llama.cpp's quantize table average for those.
GGUF_BPW = {"gguf-q8_0": 8.5, "gguf-q6_k": 6.5625, "gguf-q5_k_m": 5.67, "gguf-q4_k_m": 4.83,
            "gguf-q4_0": 4.5, "gguf-q3_k_m": 3.89, "gguf-q2_k": 2.625}
FLOAT_FORMATS = ("fp32", "bf16", "fp16")


def quantized_matrix_bytes(rows: int, cols: int, fmt: str, double_quant: bool = True) -> int:
    """Bytes of one (rows=out_features, cols=in_features) weight matrix stored in `fmt`, incl. scales/zeros."""
    n = rows * cols
    if fmt in ("fp32", "bf16", "fp16", "fp8"):
        return n * dtype_bytes(fmt) + (4 if fmt == "fp8" else 0)  # fp8: one fp32 per-tensor scale
    if fmt == "int8":  # bitsandbytes LLM.int8 (Int8Params): int8 weights + one fp32 scale per output row (SCB)
        return n + 4 * rows
    if fmt in ("nf4", "fp4"):
        blocks = -(-n // BNB4_BLOCK)
        packed = -(-n // 2)
        if double_quant:
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
    if workload.mode == "train" and workload.recipe in ("amp", "fp32", "fsdp-mp"):
        return "fp32"
    return workload.precision


def float_dtype(workload: Workload) -> str:
    """The dtype the float parts of the model (and the traced profile's weights) are held in."""
    fmt = weight_format(workload)
    return fmt if fmt in FLOAT_FORMATS else workload.precision


BNB_FORMATS = ("nf4", "fp4", "int8")   # bitsandbytes (transformers' BitsAndBytesConfig)


def base_weight_bytes(inv: Inventory, w: Workload) -> int:
    """Bytes of the model's own parameters as stored (adapters excluded), every format.

    bitsandbytes (`replace_with_bnb_linear`) and AutoGPTQ/AutoAWQ convert the nn.Linear modules of the decoder
    layers; embeddings, the lm_head, norms, biases, routers and transformers 5's fused experts (3-D parameters, not
    nn.Linear) stay in the float dtype. QLoRA with `quantize_scope='adapted'` (torchtune's lora_*_qlora builders)
    converts only the Linears that carry adapters. A vision-language model (its inventory's `vlm`) loaded by
    transformers with a BitsAndBytesConfig has every nn.Linear converted but the output embedding and the last module
    (transformers.quantizers.base `get_keys_to_not_convert`): its vision tower's and projector's too (GPTQ and AWQ
    quantize the language model's blocks only). GGUF (llama.cpp `llama_model_quantize`) quantizes every matrix, the
    embedding and output ones as Q6_K (Q8_0 files: Q8_0), and keeps 1-D tensors in fp32."""
    fmt = weight_format(w)
    fb = dtype_bytes(float_dtype(w))
    if fmt in FLOAT_FORMATS:
        return inv.params * dtype_bytes(fmt)
    if fmt in GGUF_BPW:
        big = sum(n * _numel(shape) for role, shape, _, n in inv.param_groups if len(shape) >= 2)
        emb = inv.embedding_params + inv.lm_head_params
        small = inv.params - big
        head_fmt = fmt if fmt == "gguf-q8_0" else "gguf-q6_k"
        return (quantized_matrix_bytes(1, big - emb, fmt) + quantized_matrix_bytes(1, emb, head_fmt) + small * 4)
    scope = set(w.lora_targets) if (w.method == "qlora" and w.quantize_scope == "adapted") else None
    anywhere = inv.takes_images and fmt in BNB_FORMATS   # a VLM loaded with a BitsAndBytesConfig: all its Linears
    total, quantized = 0, 0
    for name, fi, fo, _bias, role, in_layer, n in inv.linears:
        if role == "linear" and (in_layer or anywhere) and (scope is None or name in scope):
            total += n * quantized_matrix_bytes(fo, fi, fmt, w.double_quant)
            quantized += n * fi * fo
    return total + (inv.params - quantized) * fb


def gathered_layer_ratio(inv: Inventory, w: Workload, tw: Workload) -> float | None:
    """Stored over traced bytes of what FSDP all-gathers for a decoder layer, the layers' mean, where the stored
    base differs from the traced float one (QLoRA, a LoRA base in int8): an FSDP-family rank shards and gathers the
    base as stored (torchtune's NF4Tensor under FSDP2; bitsandbytes with `bnb_4bit_quant_storage`), so a gathered
    layer holds its stored bytes, its adapters (fp32) beside them. 1.0 where nothing differs; None where quantized
    Linears lie outside the decoder layers too (a VLM loaded with a BitsAndBytesConfig: the root unit changes)."""
    fb = dtype_bytes(float_dtype(tw))
    delta = base_weight_bytes(inv, w) - inv.params * fb
    if not delta:
        return 1.0
    if inv.takes_images and weight_format(w) in BNB_FORMATS:
        return None
    rd = recipe_dtypes(w)
    adapters = inv.trainable_params(w) * dtype_bytes(rd.weight) if w.method != "full" and w.mode == "train" else 0
    traced = sum(inv.layer_params) * fb + adapters
    return (traced + delta) / traced if traced else 1.0


def dequant_temp_bytes(inv: Inventory, w: Workload) -> int:
    """A 4-bit or 8-bit Linear dequantizes its weight to the compute dtype for every matmul (bitsandbytes
    `MatMul4Bit` -> `dequantize_4bit`; `MatMul8bitLt` for int8): one layer's largest quantized matrix, live
    during its matmul and, in backward, again for the input's gradient."""
    fmt = weight_format(w)
    if fmt not in BNB_FORMATS:
        return 0
    a = dtype_bytes(w.precision)
    sizes = [fi * fo for _, fi, fo, _, role, in_layer, _ in inv.linears
             if role == "linear" and (in_layer or inv.takes_images)]   # bitsandbytes formats only, here
    return max(sizes, default=0) * a


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
    return RecipeDtypes("fp32", "fp32", "fp32", None)  # amp, fp32, fsdp-mp (fp32 sharded parameters)


def master_weight_bytes(trainable: int, recipe: str) -> int:
    """fp32 master copy of the trainable weights, only in the `mixed` recipe (DeepSpeed bf16/fp16 optimizer,
    Megatron `Float16OptimizerWithFloat16Params`): 4 bytes per trainable parameter."""
    return 4 * trainable if recipe == "mixed" else 0


# ---------------------------------------------------------------- optimizer states and step temporaries

BNB_8BIT_BLOCK = 2048      # bitsandbytes blockwise 8-bit optimizer block size (optimizer_update_8bit_blockwise)
BNB_MIN_8BIT_SIZE = 4096   # tensors smaller than this keep 32-bit states (bnb Optimizer8bit min_8bit_size)


def optimizer_state_bytes(shapes, optimizer: str, state_dtype: str) -> int:
    """Persistent optimizer state for trainable tensors of the given (copies, rows, cols) shapes.

    sgd 0; sgd-momentum 1 buffer (torch SGD momentum_buffer); adam/adamw 2 (exp_avg, exp_avg_sq); lion 1
    (exp_avg, arXiv 2302.06675 Alg. 2); adafactor: row + column factors of the second moment for matrices and a
    full second moment for vectors, no first moment (torch.optim.Adafactor, beta1-free, arXiv 1804.04235);
    adamw-8bit / paged-adamw-8bit: two uint8 states + one fp32 absmax per 2048-block each, 32-bit states for
    tensors < 4096 elements (bitsandbytes/optim/optimizer.py Optimizer8bit.init_state); paged-adamw: two fp32
    states (bitsandbytes PagedAdamW is a 32-bit Optimizer2State) — paged states live in CUDA unified memory
    (`is_paged`: `cudaMallocManaged`), outside torch's allocator (estimate.py reports them apart).
    """
    sb = dtype_bytes(state_dtype)
    total = 0
    for copies, rows, cols in shapes:
        n = rows * cols
        if optimizer in ("adam", "adamw"):
            per = 2 * n * sb
        elif optimizer == "paged-adamw":
            per = 2 * n * 4
        elif optimizer in ("sgd-momentum", "lion"):
            per = n * sb
        elif optimizer == "sgd":
            per = 0
        elif optimizer == "adafactor":
            per = (rows + cols) * sb if cols > 1 else n * sb
        elif optimizer in ("adamw-8bit", "paged-adamw-8bit"):
            per = 2 * (n + 4 * -(-n // BNB_8BIT_BLOCK)) if n >= BNB_MIN_8BIT_SIZE else 8 * n
        else:
            raise ValueError(f"optimizer: {optimizer!r} is not known")
        total += copies * per
    return total


TORCH_STEP_COUNTER_BYTES = 4   # torch Adam/AdamW state["step"]: one float32 scalar tensor per parameter


def traced_step_counter_bytes(shapes, optimizer: str) -> int:
    """The per-parameter `step` tensors torch's Adam and AdamW keep beside their states (a float32 scalar each,
    torch/optim/adam.py `_init_group`), as a trace counts them: on fake CPU tensors it cannot tell that foreach and
    forloop AdamW keep them on the host ("Deliberately host `step` on CPU"), so it counts them with the states, 4
    bytes per trainable tensor (about 1 KiB for an 8B model; fused and capturable AdamW do keep them on the GPU).
    The optimizer swap (estimator.evaluate.Swap) scales the traced states with these counters included, so that an
    optimizer without them (SGD's momentum buffer: half of AdamW's states) keeps none: scaled with the states, they
    read 2 bytes per tensor high (found by tests/test_exact_random.py)."""
    if optimizer not in ("adam", "adamw"):
        return 0
    return TORCH_STEP_COUNTER_BYTES * sum(copies for copies, _, _ in shapes)


def optimizer_step_temp_bytes(shapes, optimizer: str, impl: str, state_dtype: str,
                              forloop_elems: int | None = None) -> int:
    """Transient bytes the optimizer step allocates on top of weights, grads and states.

    foreach Adam/AdamW (torch/optim/adam.py `_multi_tensor_adam`): `exp_avg_sq_sqrt = torch._foreach_sqrt(...)`
    materialises one state-sized tensor for every parameter at once. forloop (`_single_tensor_adam`): `denom =
    (exp_avg_sq.sqrt() / c).add_(eps)` one parameter at a time, while the previous parameter's denom is still
    bound: 2 n_i + n_{i-1} elements at parameter i, whose largest `forloop_elems` is (Inventory.forloop_elems, from
    the parameters' order); without it (an older inventory) twice the largest plus the largest, an upper bound.
    fused (`torch._fused_adamw_`): none.
    Adafactor: the reconstructed second moment (row x col outer product), per impl likewise. SGD without weight
    decay and Lion's sign update run in place; bitsandbytes updates in its kernel (8-bit and paged)."""
    if optimizer not in ("adam", "adamw", "adafactor") or impl == "fused":
        return 0
    sb = dtype_bytes(state_dtype)
    if impl == "foreach":
        return sum(c * r * k for c, r, k in shapes) * sb
    largest = max((r * k for _, r, k in shapes), default=0)
    if optimizer == "adafactor":
        return largest * sb
    return (3 * largest if forloop_elems is None else forloop_elems) * sb


# torchtune's OffloadActivations(min_offload_size=1024): a saved tensor under 1024 bytes stays on the GPU. A profile is
# fit where every per-token saved tensor is offloaded; below this many tokens per micro-batch (1 byte per token: a
# bool mask) one may stay, which no polynomial follows: the estimate says so (docs/recipes.md, activation_offload)
OFFLOAD_EXACT_TOKENS = 1024


def offload_notes(w: Workload) -> tuple[str, ...]:
    """The note of an activation-offloaded step at fewer tokens per micro-batch than its profile is exact for."""
    if not (w.activation_offload and w.training) or w.batch * w.seq >= OFFLOAD_EXACT_TOKENS:
        return ()
    return (f"activation_offload: at {w.batch * w.seq} tokens per micro-batch (under {OFFLOAD_EXACT_TOKENS}) saved "
            "tensors under 1 KiB (torchtune's min_offload_size: position ids, per-token statistics) may stay on the "
            "GPU; the profile, fit where they leave it, can be off by up to about 1 KiB per such tensor, either way",)


def paged(optimizer: str) -> bool:
    return optimizer in PAGED_OPTIMIZERS


# ---------------------------------------------------------------- KV cache

def kv_dtype(workload: Workload) -> str:
    return workload.precision if workload.kv_dtype == "auto" else workload.kv_dtype


# ---------------------------------------------------------------- runtime overhead

@dataclass(frozen=True)
class Overhead:
    """Memory outside PyTorch tensors. Defaults are typical for CUDA 12 on Hopper; measured rows refine them."""

    cuda_context_bytes: int = 500 * MiB     # driver context + kernel images with CUDA lazy loading (CUDA 11.7+)
    cublas_workspace_bytes: int = 32 * MiB  # one cuBLAS(Lt) workspace on sm90 (aten CublasHandlePool.cpp)
    nccl_bytes_per_gpu: int = 512 * MiB     # NCCL channels/buffers (NCCL_BUFFSIZE 4 MiB x channels x peers)

    def __post_init__(self) -> None:
        for name in ("cuda_context_bytes", "cublas_workspace_bytes", "nccl_bytes_per_gpu"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: must be a non-negative integer number of bytes, got {v!r}")


def cublas_workspaces(mode: str, stage: str) -> int:
    """How many cuBLAS workspaces torch's allocator holds during `stage` of a step in `mode`, once a step has run.

    PyTorch keeps one workspace per (cuBLAS handle, stream) (aten/src/ATen/cuda/CublasHandlePool.cpp,
    `cublas_handle_stream_to_workspace`, allocated through the caching allocator at a handle's first matmul on a
    stream), and a handle per thread (DeviceThreadHandlePool). Autograd runs a CUDA device's backward on that
    device's own worker thread (torch/csrc/autograd/engine.cpp), so training holds two: the forward's and the
    backward's, both kept until the process clears them; inference one. Before the first matmul (the load stage)
    none. Measured on an H200 (2026-11-28, docs/measuring.md): every training stage after load at least 32 MiB - 140 B
    above the one-workspace estimate, inference stages 1 KiB to 1 MiB above it, the load stage 32 MiB below it."""
    if stage == "load":
        return 0
    return 2 if mode == "train" else 1


def overhead_bytes(gpus: int, overhead: Overhead = Overhead(), workspaces: int = 1) -> int:
    """CUDA context + `workspaces` cuBLAS workspaces (cublas_workspaces), + NCCL buffers when more than one GPU
    communicates."""
    return (overhead.cuda_context_bytes + workspaces * overhead.cublas_workspace_bytes
            + (overhead.nccl_bytes_per_gpu if gpus > 1 else 0))


def model_state_bytes(inv: Inventory, w: Workload) -> dict[str, int]:
    """What the model itself holds on one GPU before any sharding, from the inventory alone (no profile): the
    stored weights (base_weight_bytes, plus fp32 adapters for LoRA/QLoRA), the gradients and optimizer states of the
    trainable parameters and the `mixed` recipe's master copy. Paged optimizers' states live in unified memory and
    are left out, as in `Estimate`. What the first answer shows while a step's profile is being derived; the
    estimate itself prices these through the traced profile (estimator.evaluate)."""
    rd = recipe_dtypes(w)
    trainable = inv.trainable_params(w) if w.mode == "train" else 0
    adapters = trainable * dtype_bytes(rd.weight) if w.method != "full" else 0
    out = {"weights": base_weight_bytes(inv, w) + adapters, "gradients": trainable * dtype_bytes(rd.grad),
           "optimizer_states": 0, "master_weights": master_weight_bytes(trainable, w.recipe)}
    if trainable and not paged(w.optimizer):
        out["optimizer_states"] = optimizer_state_bytes(inv.trainable_shapes(w), w.optimizer, rd.state)
    return out
