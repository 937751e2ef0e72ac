"""flash-linear-attention's Gated DeltaNet kernels as a GPU runs them, on fake CPU tensors (installed with the
Mamba-2 ones by tracer.kernels_ssm for `kernels.emulate("cuda")`).

transformers' Gated DeltaNet layers (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, OLMo-Hybrid, Qwen4-exp) call
`torch_chunk_gated_delta_rule` (prefill, training) and `torch_recurrent_gated_delta_rule` (one-token decoding), each
wrapped by `use_kernel_func_from_hub_with_fallback(..., "fla")`: where `fla` imports (a CUDA install) the wrapper calls
`fla.chunk_gated_delta_rule` / `fla.fused_recurrent_gated_delta_rule`, otherwise a torch reference that loops over
64-token chunks in Python (its ops change with the sequence: a derivation on it is refused). Here each is replaced
by one that allocates what fla's Python wrappers allocate, in their order and with their lifetimes, the Triton
kernels (which only write into those tensors) left out. Source: fla-org/flash-linear-attention commit bc3b101d:
fla/ops/gated_delta_rule/chunk.py (`chunk_gated_delta_rule`, `ChunkGatedDeltaRuleFunction`,
`chunk_gated_delta_rule_fwd` / `_bwd`), chunk_fwd.py (`chunk_gated_delta_rule_fwd_intra`: chunk 64, the fused
kkt + solve_tril path), wy_fast.py (`recompute_w_u_fwd`, `prepare_wy_repr_bwd`), fused_recurrent.py
(`fused_recurrent_gated_delta_rule_fwd`); fla/ops/common/chunk_delta_h.py (`chunk_gated_delta_rule_fwd_h`,
`chunk_gated_delta_rule_bwd_dhu`), chunk_o.py (`chunk_fwd_o`, `chunk_bwd_dv_local`, `chunk_bwd_dqkwg`);
fla/modules/l2norm.py (`l2norm_fwd` / `_bwd`); fla/ops/utils/cumsum.py (`chunk_local_cumsum_scalar`);
fla/utils/_decorators.py (`input_guard`: every tensor argument made contiguous).

One size is the GPU's: `chunk_bwd_dqkwg` keeps dg as NK = cdiv(K, BK) fp32 partial sums (B, T, HV) with BK =
min(max(next_power_of_2(K), 16), 128) on Hopper (`HOPPER_TILING`; 64 on Ada-class shared memory, 32 below), summed at
once: one partial at K <= 128 on an H100 or H200. Chunk size 64 (transformers passes none; fla's default).
"""
from __future__ import annotations

import torch

CHUNK = 64
HOPPER_TILING = 128
F32 = torch.float32
_CALLS = {"chunk": 0}


def chunk_calls() -> int:
    """Chunked Gated DeltaNet calls emulated by this process so far."""
    return _CALLS["chunk"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def contiguous_args(*tensors):
    """fla.utils.input_guard: every tensor argument `.contiguous()` (a copy where it is not)."""
    return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in tensors)


# ------------------------------------------------------------------------------------ fla.modules.l2norm


def l2norm_fwd(x, eps: float = 1e-6, output_dtype=None):
    x_shape_og = x.shape
    x = x.view(-1, x.shape[-1])
    y = torch.empty_like(x) if output_dtype is None else torch.empty_like(x, dtype=output_dtype)
    rstd = torch.empty((x.shape[0],), dtype=F32, device=x.device)
    return y.view(x_shape_og), rstd.view(x_shape_og[:-1])


def l2norm_bwd(y, rstd, dy, eps: float = 1e-6):
    y_shape_og = y.shape
    y = y.view(-1, dy.shape[-1])
    dy = dy.view(-1, dy.shape[-1])
    dx = torch.empty_like(y)
    return dx.view(y_shape_og)


def l2norm_qk(q, k, on: bool):
    """(q, q_rstd, k, k_rstd): fla's `use_qk_l2norm_in_kernel` prologue, q then k (ChunkGatedDeltaRuleFunction and
    ChunkKDAFunction alike)."""
    if not on:
        return q, None, k, None
    q, q_rstd = l2norm_fwd(q)
    k, k_rstd = l2norm_fwd(k)
    return q, q_rstd, k, k_rstd


def l2norm_qk_bwd(q, q_rstd, dq, k, k_rstd, dk, on: bool):
    """(dq, dk) through the l2 norms of `l2norm_qk`, q then k."""
    if not on:
        return dq, dk
    dq = l2norm_bwd(q, q_rstd, dq)
    dk = l2norm_bwd(k, k_rstd, dk)
    return dq, dk


# ------------------------------------------------------------------------------------ the chunked ops


def chunk_local_cumsum(g, chunk_size: int, reverse: bool = False, scale=None, output_dtype=F32):
    return torch.empty_like(g, dtype=output_dtype or g.dtype)        # chunk_local_cumsum_scalar: (B, T, H) gates


def recompute_w_u_fwd(k, v, beta, A, g=None):
    B, T, H, K = k.shape
    HV = v.shape[2]
    w = k.new_empty(B, T, HV, K)
    u = torch.empty_like(v)
    return w, u


def chunk_gated_delta_rule_fwd_intra(k, v, g, beta, chunk_size: int = CHUNK):
    B, T, H, K = k.shape
    HV = beta.shape[2]
    A = torch.zeros(B, T, HV, chunk_size, device=k.device, dtype=k.dtype)    # chunk 64: fused kkt + solve_tril
    w, u = recompute_w_u_fwd(k, v, beta, A, g)
    return w, u, A


def chunk_gated_delta_rule_fwd_h(k, w, u, g=None, initial_state=None, output_final_state=False,
                                 chunk_size: int = CHUNK, save_new_value: bool = True):
    B, T, H, K = k.shape
    V, HV = u.shape[-1], u.shape[2]
    NT = _cdiv(T, chunk_size)
    h = k.new_empty(B, NT, HV, K, V)
    final_state = k.new_zeros(B, HV, K, V, dtype=F32) if output_final_state else None
    v_new = torch.empty_like(u) if save_new_value else None
    return h, v_new, final_state


def chunk_fwd_o(q, k, v, h, g, scale, chunk_size: int = CHUNK):
    return torch.empty_like(v)


def chunk_bwd_dv_local(q, k, g, do, scale, chunk_size: int = CHUNK):
    return torch.empty_like(do)


def chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, g=None, h0=None, dht=None, scale=None, chunk_size: int = CHUNK):
    B, T, H, K = q.shape
    V, HV = do.shape[-1], do.shape[2]
    NT = _cdiv(T, chunk_size)
    dh = q.new_empty(B, NT, HV, K, V)
    dh0 = torch.empty_like(h0, dtype=F32) if h0 is not None else None
    dv2 = torch.empty_like(dv)
    return dh, dh0, dv2


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, dv=None, scale=None, chunk_size: int = CHUNK):
    B, T, H, K = k.shape
    HV = v.shape[2]
    BK = min(max(next_pow2(K), 16), HOPPER_TILING)
    NK = _cdiv(K, BK)
    dq = q.new_empty(B, T, HV, K)
    dk = k.new_empty(B, T, HV, K)
    dg = torch.empty(NK, *g.shape, dtype=F32, device=g.device) if g is not None else None
    dw = torch.empty_like(w) if w is not None else None
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    if dg is not None:
        dg = dg.sum(0)
    return dq, dk, dw, dg


def prepare_wy_repr_bwd(k, v, beta, A, dw, du, g=None):
    B, T, H, K = k.shape
    HV = v.shape[2]
    dk = k.new_empty(B, T, HV, K)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g) if g is not None else None
    db = torch.empty_like(beta)
    if H != HV:
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dk, dv, db, dg


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size: int = CHUNK):
    g = chunk_local_cumsum(g, chunk_size=chunk_size)
    w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=chunk_size)
    h, v_new, final_state = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=initial_state,
                                                         output_final_state=output_final_state, chunk_size=chunk_size)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, chunk_size=chunk_size)
    return g, o, A, final_state, initial_state


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, scale, initial_state, do, dht, chunk_size: int = CHUNK):
    w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=initial_state,
                                               output_final_state=False, chunk_size=chunk_size)
    dv = chunk_bwd_dv_local(q=q, k=k, g=g, do=do, scale=scale, chunk_size=chunk_size)
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=initial_state, dht=dht, do=do, dv=dv,
                                                 scale=scale, chunk_size=chunk_size)
    dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=scale,
                                     chunk_size=chunk_size)
    dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=dv)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True)
    return dq, dk, dv, db, dg, dh0


class ChunkGatedDeltaRule(torch.autograd.Function):
    """fla's ChunkGatedDeltaRuleFunction (input_guard, autocast_custom_fwd / _bwd on the CPU autocast that stands
    for CUDA's here): saves the l2-normalised q and k with their fp32 rstd, v, the chunk-local cumulative gate (fp32),
    beta and A (B, T, HV, 64); w, u, the chunk states h (B, chunks, HV, K, V) and v_new are recomputed in backward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunk_size):
        q, k, v, g, beta, initial_state = contiguous_args(q, k, v, g, beta, initial_state)
        q, q_rstd, k, k_rstd = l2norm_qk(q, k, use_qk_l2norm_in_kernel)
        beta_raw = beta
        g, o, A, final_state, initial_state = chunk_gated_delta_rule_fwd(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, chunk_size=chunk_size)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta_raw, beta, A, initial_state)
        ctx.scale, ctx.chunk_size, ctx.use_qk_l2norm_in_kernel = scale, chunk_size, use_qk_l2norm_in_kernel
        if final_state is not None:
            ctx.mark_non_differentiable(final_state)
        return o.to(q.dtype), final_state

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, do, dht):
        do, dht = contiguous_args(do, dht)
        q, q_rstd, k, k_rstd, v, g, beta_raw, beta, A, initial_state = ctx.saved_tensors
        dq, dk, dv, db, dg, dh0 = chunk_gated_delta_rule_bwd(
            q=q, k=k, v=v, g=g, beta=beta, A=A, scale=ctx.scale, initial_state=initial_state, do=do, dht=dht,
            chunk_size=ctx.chunk_size)
        dq, dk = l2norm_qk_bwd(q, q_rstd, dq, k, k_rstd, dk, ctx.use_qk_l2norm_in_kernel)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta_raw), None, dh0, None, None, None


def chunk_gated_delta_rule(query, key, value, g=None, beta=None, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """fla.chunk_gated_delta_rule, in place of transformers' `torch_chunk_gated_delta_rule`: (o, final state)."""
    if cu_seqlens is not None:
        raise ValueError("kernels: packed sequences (cu_seqlens) in a Gated DeltaNet layer are not emulated")
    chunk_size = kwargs.pop("chunk_size", CHUNK)
    if scale is None:
        scale = key.shape[-1] ** -0.5
    _CALLS["chunk"] += 1
    return ChunkGatedDeltaRule.apply(query, key, value, g, beta, scale, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel, chunk_size)


def fused_recurrent_gated_delta_rule(query, key, value, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                     **kwargs):
    """fla.fused_recurrent_gated_delta_rule (decoding, no autograd): inputs made contiguous, o like v, the final
    state (B, HV, K, V) fp32 when asked for (the l2 norm happens inside the kernel)."""
    q, k, v, g, beta, initial_state = contiguous_args(query, key, value, g, beta, initial_state)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[-1]
    o = torch.empty_like(v)
    final_state = q.new_empty(B, HV, K, V, dtype=F32) if output_final_state else None
    return o, final_state
