"""scaled_dot_product_attention as CUDA runs it, on fake CPU tensors (registered by `kernels.emulate("cuda")`).

CUDA picks one backend per call and runs its aten op; autograd then saves what that op's backward needs
(derivatives.yaml): flash and memory-efficient attention keep q, k, v, the output, an fp32 logsumexp and the
philox RNG state, and apply attention-probability dropout inside the kernel (no mask); the math composite keeps
fp32 copies of q, k, v, the fp32 s x s softmax and, with dropout, its mask. On a CPU tensor SDPA takes the CPU's
own choice (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp, `select_sdp_backend_cpp`): its flash kernel
refuses dropout and unequal head sizes, so those run the math composite.

Sources (pytorch/pytorch):
- aten/src/ATen/native/transformers/attention.cpp `scaled_dot_product_attention` (the enable_gqa version, 2.5 on;
  the wheel ships no .cpp, so no exact 2.13 line numbers): the CUDA flash branch pads head dims to a multiple of
  8 (`pad_last_dim<8, false>`) with the scale of the original size and slices the output back (`post_process_flash_output`); the efficient branch
  computes logsumexp only when an input requires grad (`should_compute_logsumexp`) and expands/pads/copies the mask
  (`preprocess_mask`, alignment 16); every branch but cuDNN turns a bool mask into an additive one
  (`convert_boolean_attn_mask`); math is `_scaled_dot_product_attention_math(..., enable_gqa)`.
- aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (commit 001f694a) `select_sdp_backend` and
  `can_use_flash_attention` / `can_use_mem_efficient_attention`, with the checks of the installed 2.13 header
  include/ATen/native/transformers/sdp_utils_cpp.h (check_tensor_shapes, check_for_attn_mask,
  check_batch_size_and_num_heads_dense<supports_gqa>, check_nonzero_sequence_lengths_dense,
  check_last_dim_stride_equals_1_dense). Priority: the installed include/ATen/Context.h `sdp_priority_order`
  {flash, efficient, math, cudnn}. The 2.13 docstring of F.scaled_dot_product_attention: GQA "works only for
  Flash_attention and math kernel on CUDA tensor", so memory-efficient attention takes no enable_gqa.

The GPU assumed is sm80-sm90 (A100, H100): flash takes fp16/bf16, memory-efficient fp32/fp16/bf16 with head dims
a multiple of 8 (half) or 4 (fp32) (`minimum_gemm_alignment`). Not modelled: cuDNN attention, which sdp_utils.cpp
puts first on sm90/sm100 only with a cuDNN runtime newer than 9.15 (`check_prefer_cudnn_attention`); for the
unmasked calls transformers makes it saves the same bytes as flash (output + (b, h, s, 1) fp32 stats + RNG
state; see its meta kernel). Nested tensors are not traced.
"""
from __future__ import annotations

import math

import torch

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
FLASH_MAX_HEAD_DIM = 256          # check_head_dim_size_flash: "less than or equal to 256"
EFFICIENT_MASK_ALIGNMENT = 16     # attention.cpp preprocess_mask: mem_eff_alignment = 16
HALF = (torch.float16, torch.bfloat16)
# Calls of the memory-efficient kernel, counted: its memory is no polynomial in s alone (estimator.profile.poly:
# a logsumexp of 32 * ceil(s / 32) rows, a mask copied only where s % 16 != 0), so the derivation fits such a
# step in (b, s, m, l) and traces s of every alignment it needs.
_CALLS = {"lse": 0, "mask": 0}


def efficient_calls() -> dict[str, int]:
    """{"lse": calls that computed a logsumexp, "mask": calls with a mask} traced by this process so far."""
    return dict(_CALLS)


def select_backend(q, k, v, attn_mask, dropout_p: float, is_causal: bool, enable_gqa: bool) -> str:
    """The backend CUDA's select_sdp_backend returns for these inputs on an sm80/sm90 GPU."""
    if _flash_ok(q, k, v, attn_mask, is_causal, enable_gqa):
        return FLASH
    if _efficient_ok(q, k, v):
        return EFFICIENT
    return MATH


def _dense_common_ok(q, k, v) -> bool:
    """check_tensor_shapes (4-D), check_nonzero_sequence_lengths_dense, equal batch sizes."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return False
    return q.shape[0] == k.shape[0] == v.shape[0]


def _heads_ok(q, k, v, gqa_supported: bool, enable_gqa: bool) -> bool:
    """check_batch_size_and_num_heads_dense<supports_gqa>: equal head counts, or with enable_gqa (where the
    backend supports it) equal k/v heads dividing the query heads (check_grouped_query_attention)."""
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa and gqa_supported:
        return hk == hv and hq % hk == 0
    return hq == hk == hv


def _flash_ok(q, k, v, attn_mask, is_causal, enable_gqa) -> bool:
    """can_use_flash_attention: no mask, equal head dims <= 256, fp16/bf16, causal only for square
    attention, GQA allowed, last dims of stride 1 (a head dim of 1 excepted)."""
    if not _dense_common_ok(q, k, v) or attn_mask is not None:
        return False
    d = q.shape[-1]
    if not (d == k.shape[-1] == v.shape[-1] and d <= FLASH_MAX_HEAD_DIM):
        return False
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False                        # check_flash_causal_non_square_seqlens
    if not (q.dtype == k.dtype == v.dtype and q.dtype in HALF):
        return False                        # check_dtypes_low_precision (sm80+)
    if not _heads_ok(q, k, v, gqa_supported=True, enable_gqa=enable_gqa):
        return False
    return d == 1 or (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


def _efficient_ok(q, k, v) -> bool:
    """can_use_mem_efficient_attention: q/k head dims equal, q and v head dims a multiple of the gemm alignment
    (8 for fp16/bf16, 4 for fp32 on sm80+), storage offsets aligned to it, no GQA, masks allowed, last dims of
    stride 1, fp32/fp16/bf16."""
    if not _dense_common_ok(q, k, v):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, *HALF)):
        return False
    align = 8 if q.dtype in HALF else 4     # minimum_gemm_alignment on sm80+: max(4, 128 / bits)
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if not (dq == dk and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False                        # check_head_dim_size_mem_efficient
    if any(t.storage_offset() % align for t in (q, k, v)):
        return False                        # check_data_ptr_alignment_mem_efficient (offset * size % align * size)
    if not _heads_ok(q, k, v, gqa_supported=False, enable_gqa=False):
        return False
    return q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1


def _additive_mask(attn_mask, dtype):
    """convert_boolean_attn_mask: a bool mask becomes 0 / -inf in the query's dtype; others pass through."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=attn_mask.device))


def _preprocess_mask(mask, q, k):
    """preprocess_mask: expand to (b, h, L, S); pad the last dim to a multiple of 16 (then slice); otherwise
    make it contiguous when a stride is not a multiple of 16."""
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    last = mask.shape[-1]
    if last % EFFICIENT_MASK_ALIGNMENT:
        pad = EFFICIENT_MASK_ALIGNMENT - last % EFFICIENT_MASK_ALIGNMENT
        return torch.nn.functional.pad(mask, (0, pad))[..., :last]
    if any(st % EFFICIENT_MASK_ALIGNMENT for st in mask.stride()[:3]):
        return mask.contiguous()
    return mask


def _pad_last_dim(t, alignment: int = 8):
    """pad_last_dim<8, false>: zero-pad the head dim to a multiple of 8 (a new tensor, saved by flash)."""
    d = t.shape[-1]
    if d % alignment == 0:
        return t
    return torch.nn.functional.pad(t, (0, alignment - d % alignment))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """aten::scaled_dot_product_attention with CUDA's backend choice, registered on AutogradCPU."""
    backend = select_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    mask = _additive_mask(attn_mask, query.dtype)
    if backend == FLASH:
        d = query.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
        out = torch.ops.aten._scaled_dot_product_flash_attention.default(
            _pad_last_dim(query), _pad_last_dim(key), _pad_last_dim(value), dropout_p, is_causal, False,
            scale=og_scale)[0]
        return out if d % 8 == 0 else out[..., :d]
    if backend == EFFICIENT:
        compute_logsumexp = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or
                                                         value.requires_grad)
        _CALLS["lse"] += bool(compute_logsumexp)
        if mask is not None:
            _CALLS["mask"] += 1
            mask = _preprocess_mask(mask, query, key)
        return torch.ops.aten._scaled_dot_product_efficient_attention.default(
            query, key, value, mask, compute_logsumexp, dropout_p, is_causal, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_attention_math.default(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
