"""flash-linear-attention's Kimi Delta Attention (KDA) kernels as a GPU runs them, on fake CPU tensors (installed with
the other sequence kernels by tracer.kernels_ssm for `kernels.emulate("cuda")`).

transformers' KDA layers (Kimi-Linear, Bailing-Hybrid) call `chunk_kimi_delta_attention` (prefill, training) and
`recurrent_kimi_delta_attention` (one-token decoding), wrapped by `use_kernel_func_from_hub_with_fallback(..., "fla")`:
with `fla` installed they run `fla.chunk_kda` / `fla.fused_recurrent_kda`, else a torch reference that loops over
chunks in Python. Here each is replaced by what fla's Python wrappers allocate, in their order, the Triton kernels
left out (as tracer.kernels_gdn, whose shared pieces it reuses). Source: fla-org/flash-linear-attention commit
bc3b101d: fla/ops/kda/chunk.py (`ChunkKDAFunction`: input_guard, l2norm of q and k, recompute on), chunk_fwd.py
(`chunk_kda_fwd`), chunk_intra.py (`chunk_kda_fwd_intra`: the token-parallel path, safe_gate off;
`chunk_kda_bwd_intra`), wy_fast.py (`recompute_w_u_fwd`), chunk_bwd.py (`chunk_kda_bwd`, `chunk_kda_bwd_dAv`,
`chunk_kda_bwd_wy_dqkg_fused`), fused_recurrent.py (`fused_recurrent_kda`); fla/ops/gla/chunk.py
(`chunk_gla_fwd_o_gk`); fla/ops/common/chunk_delta_h.py and fla/ops/utils/cumsum.py (the vector gate's cumsum).
"""
from __future__ import annotations

import torch

from tracer.kernels_gdn import (CHUNK, F32, chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h,
                                chunk_local_cumsum, contiguous_args, l2norm_qk, l2norm_qk_bwd, next_pow2)

SUB_CHUNK = 16
_CALLS = {"chunk": 0}


def chunk_calls() -> int:
    """Chunked KDA calls emulated by this process so far."""
    return _CALLS["chunk"]


def recompute_w_u_fwd(k, v, beta, A, q=None, gk=None):
    B, T, H, K = k.shape
    HV = v.shape[2]
    w = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype)
    u = torch.empty_like(v)
    qg = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype) if q is not None else None
    kg = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype)
    return w, u, qg, kg


def chunk_kda_fwd_intra(q, k, v, gk, beta, scale, chunk_size: int = CHUNK):
    B, T, H, K = k.shape
    HV = gk.shape[2]
    Aqk = torch.empty(B, T, HV, chunk_size, device=k.device, dtype=k.dtype)
    Akk = torch.zeros(B, T, HV, chunk_size, device=k.device, dtype=k.dtype)
    Akkd = torch.empty(B, T, HV, SUB_CHUNK, device=k.device, dtype=F32)      # token-parallel diagonal blocks
    w, u, qg, kg = recompute_w_u_fwd(k=k, v=v, beta=beta, A=Akk, q=None, gk=gk)
    del Akkd
    return w, u, qg, kg, Aqk, Akk


def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size: int = CHUNK):
    g = chunk_local_cumsum(g, chunk_size=chunk_size)                          # the vector gate: (B, T, HV, K) fp32
    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g, beta=beta, scale=scale, chunk_size=chunk_size)
    h, v_new, final_state = chunk_gated_delta_rule_fwd_h(kg, w, u, g, initial_state=initial_state,
                                                         output_final_state=output_final_state, chunk_size=chunk_size)
    o = torch.zeros_like(v_new)                                               # chunk_gla_fwd_o_gk
    del w, u, qg, kg, v_new, h                                               # recompute on: none of them is kept
    return o, final_state, g, Aqk, Akk, initial_state


def chunk_kda_bwd(q, k, v, beta, Aqk, Akk, scale, initial_state, do, dht, g, chunk_size: int = CHUNK):
    H, HV = q.shape[2], v.shape[2]
    G = HV // H
    w, u, qg, kg = recompute_w_u_fwd(k=k, v=v, beta=beta, A=Akk, q=q, gk=g)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(kg, w, u, g, initial_state=initial_state, output_final_state=False,
                                               chunk_size=chunk_size)
    dAqk = v_new.new_empty(*k.shape[:2], HV, chunk_size, dtype=F32)          # chunk_kda_bwd_dAv
    dv = torch.empty_like(do)
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(qg, kg, w, do, dv, g=g, h0=initial_state, dht=dht, scale=scale,
                                                 chunk_size=chunk_size)
    dq, dk, dv, db, dg, dAkk = _bwd_wy_dqkg_fused(k, v, g, beta, Akk)
    dq, dk, db, dg = _bwd_intra(k, g, beta, dAqk, dq, dk, db, dg)
    if HV > H:
        dq = dq.view(*dq.shape[:2], H, G, dq.shape[-1]).sum(dim=3)
        dk = dk.view(*dk.shape[:2], H, G, dk.shape[-1]).sum(dim=3)
    dg = chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True)
    return dq, dk, dv, db, dg, dh0


def _bwd_wy_dqkg_fused(k, v, g, beta, A):
    """chunk_kda_bwd_wy_dqkg_fused: fp32 dq, dk (B, T, HV, K), dv like v, fp32 dg, db, dA."""
    B, T, H, K = k.shape
    HV = v.shape[2]
    dq = g.new_empty(B, T, HV, K, dtype=F32)
    dk = g.new_empty(B, T, HV, K, dtype=F32)
    dv2 = torch.empty_like(v)
    dg = torch.empty_like(g, dtype=F32)
    db = torch.empty_like(beta, dtype=F32)
    dA = torch.empty_like(A, dtype=F32)
    dv = dv2
    return dq, dk, dv, db, dg, dA


def _bwd_intra(k, g, beta, dAqk, dq, dk, db, dg):
    """chunk_kda_bwd_intra: new dq, dk, dg; db summed over NK = cdiv(K, min(32, next_power_of_2(K))) partials."""
    K = k.shape[-1]
    NK = -(-K // min(32, next_pow2(K)))
    dq2 = torch.empty_like(dq)
    dk2 = torch.empty_like(dk)
    db2 = beta.new_empty(NK, *beta.shape, dtype=F32)
    dg2 = torch.empty_like(dg, dtype=F32)
    dq = dq2
    dk = dk2
    db = db2.sum(0).add_(db)
    dg = dg2
    return dq, dk, db, dg


class ChunkKDA(torch.autograd.Function):
    """fla's ChunkKDAFunction (recompute on): saves the l2-normalised q and k with their fp32 rstd, v, the gate's
    chunk-local cumsum (fp32, per key channel) and the gate as given, beta, Aqk and Akk (B, T, HV, 64)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunk_size):
        q, k, v, g, beta, initial_state = contiguous_args(q, k, v, g, beta, initial_state)
        q, q_rstd, k, k_rstd = l2norm_qk(q, k, use_qk_l2norm_in_kernel)
        beta_raw = beta
        g_input = g
        o, final_state, g_cumsum, Aqk, Akk, initial_state = chunk_kda_fwd(
            q=q, k=k, v=v, g=g_input, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, chunk_size=chunk_size)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g_cumsum, g_input, beta_raw, beta, Aqk, Akk, initial_state)
        ctx.scale, ctx.chunk_size, ctx.use_qk_l2norm_in_kernel = scale, chunk_size, use_qk_l2norm_in_kernel
        if final_state is not None:
            ctx.mark_non_differentiable(final_state)
        return o.type_as(q), final_state

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, do, dht):
        do, dht = contiguous_args(do, dht)
        q, q_rstd, k, k_rstd, v, g_cumsum, g_input, beta_raw, beta, Aqk, Akk, initial_state = ctx.saved_tensors
        dq, dk, dv, db, dg, dh0 = chunk_kda_bwd(q=q, k=k, v=v, beta=beta, Aqk=Aqk, Akk=Akk, scale=ctx.scale,
                                                initial_state=initial_state, do=do, dht=dht, g=g_cumsum,
                                                chunk_size=ctx.chunk_size)
        dq, dk = l2norm_qk_bwd(q, q_rstd, dq, k, k_rstd, dk, ctx.use_qk_l2norm_in_kernel)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g_input), db.to(beta_raw), None, dh0, None, None, None


def chunk_kda(query, key, value, g=None, beta=None, chunk_size=CHUNK, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, scale=None, cu_seqlens=None, **kwargs):
    """fla.chunk_kda, in place of transformers' `chunk_kimi_delta_attention`: (o, final state)."""
    if cu_seqlens is not None or kwargs.get("use_gate_in_kernel") or kwargs.get("safe_gate"):
        raise ValueError("kernels: KDA with packed sequences, the gate in the kernel or safe_gate is not emulated")
    if scale is None:
        scale = key.shape[-1] ** -0.5
    _CALLS["chunk"] += 1
    return ChunkKDA.apply(query, key, value, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, chunk_size)


def fused_recurrent_kda(query, key, value, g=None, beta=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, scale=None, cu_seqlens=None, **kwargs):
    """fla.fused_recurrent_kda (decoding; input_guard): inputs contiguous, out zeros like v, the final state
    (B, HV, K, V) fp32 when asked for."""
    q, k, v, g, beta, initial_state = contiguous_args(query, key, value, g, beta, initial_state)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[-1]
    out = torch.zeros_like(v)
    final_state = q.new_empty(B, HV, K, V, dtype=F32) if output_final_state else None
    return out, final_state
