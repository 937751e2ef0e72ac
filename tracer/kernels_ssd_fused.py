"""mamba_ssm's fused Mamba-2 training function (`MambaSplitConv1dScanCombinedFn`) on fake CPU tensors, with the
causal_conv1d and gated-RMSNorm wrappers it calls; the scan's own wrappers are tracer.kernels_ssd (see there for the
sources, and for the two sizes that are not the model's: nsplits and the SM count).
"""
from __future__ import annotations

import math

import torch

from estimator.ssd import SM_COUNT
from tracer.kernels_ssd import (F32, mamba_chunk_scan_combined_bwd, mamba_chunk_scan_combined_fwd,
                                ensure_stride)


# ------------------------------------------------------------------------------------ causal_conv1d


def causal_conv1d_fwd_function(x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation):
    return torch.empty_like(x)


def causal_conv1d_bwd_function(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
                               return_dinitial_states, silu_activation):
    if dx is None:
        dx = torch.empty_like(x)
    dweight = torch.zeros_like(weight, dtype=F32)
    dbias = None
    if bias is not None:
        dbias = torch.zeros_like(bias, dtype=F32)
    dinitial_states = None
    if return_dinitial_states:
        batch_size, dim = x.size()[:2]
        width = weight.size(-1)
        dinitial_states = torch.empty(batch_size, width - 1, dim, device=x.device, dtype=x.dtype).transpose(1, 2)
    dweight = dweight.type_as(weight)
    if dbias is not None:
        dbias = dbias.type_as(bias)
    return dx, dweight, dbias, dinitial_states


# ------------------------------------------------------------------------------------ layernorm_gated


def _layer_norm_fwd(x, weight, bias, eps, z=None, out=None, group_size=None, norm_before_gate=True,
                    is_rms_norm=False):
    M, N = x.shape
    group_size = N if group_size is None else group_size
    ngroups = N // group_size
    if out is None:
        out = torch.empty_like(x)
    mean = torch.empty((ngroups * M,), dtype=F32, device=x.device) if not is_rms_norm else None
    rstd = torch.empty((ngroups * M,), dtype=F32, device=x.device)
    return out, mean, rstd


def _layer_norm_bwd(dy, x, weight, bias, eps, mean, rstd, z=None, group_size=None, norm_before_gate=True,
                    is_rms_norm=False, recompute_output=False, dz=None, out=None):
    M, N = x.shape
    group_size = N if group_size is None else group_size
    ngroups = N // group_size
    dx = torch.empty_like(x)
    if dz is None:
        dz = torch.empty_like(z) if z is not None else None
    if recompute_output and out is None:
        out = torch.empty_like(x)
    block_n = min(65536 // x.element_size(), 1 << max(group_size - 1, 0).bit_length())   # triton.next_power_of_2
    num_warps = min(max(block_n // 256, 1), 8)
    nrow_groups = math.ceil(SM_COUNT * math.ceil(4 / num_warps) / ngroups)
    _dw = torch.empty((nrow_groups, N), dtype=F32, device=weight.device)
    _db = torch.empty((nrow_groups, N), dtype=F32, device=bias.device) if bias is not None else None
    dw = _dw.sum(0).to(weight.dtype)
    db = _db.sum(0).to(bias.dtype) if bias is not None else None
    return (dx, dw, db, dz) if not recompute_output else (dx, dw, db, dz, out)


# ------------------------------------------------------------------------------------ the fused training function


class SplitConv1dScanCombined(torch.autograd.Function):
    """MambaSplitConv1dScanCombinedFn: in_proj's output (z, xBC, dt) to out_proj's output in one autograd node,
    saving (zxbcdt, conv weight and bias, out_x, A, D, dt_bias, rmsnorm weight, rstd, out_proj weight and bias);
    backward recomputes the convolution and the scan's forward tensors it needs. The autocast decorators are
    mamba_ssm's (`custom_fwd` / `custom_bwd` on "cuda"), on the CPU autocast that stands for CUDA's here
    (tracer.kernels_autocast)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                seq_idx=None, dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                ngroups=1, norm_before_gate=True, state_dtype=None):
        if D.dim() == 1:
            nheads, = D.shape
        else:
            nheads, headdim = D.shape
        batch, seqlen, _ = zxbcdt.shape
        dim = nheads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
        if d_nonssm > 0:
            raise ValueError("config: a Mamba-2 mixer with a gated MLP beside the SSM (d_nonssm > 0) is not emulated")
        if initial_states is not None or seq_idx is not None:
            raise ValueError("kernels: a Mamba-2 training step with initial states or packed sequences (seq_idx) is "
                             "not emulated")
        zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + ngroups * dstate * 2, nheads], dim=-1)
        xBC_conv = causal_conv1d_fwd_function(ensure_stride(xBC).transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx,
                                              None, None, activation in ["silu", "swish"]).transpose(1, 2)
        x, B, C = torch.split(xBC_conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        x = x.reshape(batch, seqlen, nheads, headdim)
        B = B.reshape(batch, seqlen, ngroups, dstate)
        C = C.reshape(batch, seqlen, ngroups, dstate)
        z = z.reshape(batch, seqlen, nheads, headdim) if z is not None else None
        if rmsnorm_weight is None:
            out, out_x, dt_out, dA_cumsum, states, final_states = mamba_chunk_scan_combined_fwd(
                x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit, state_dtype=state_dtype)
            out = out.reshape(batch, seqlen, dim)
            rstd = None
        else:
            out_x, _, dt_out, dA_cumsum, states, final_states = mamba_chunk_scan_combined_fwd(
                x, dt, A, B, C, chunk_size=chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=initial_states,
                seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit, state_dtype=state_dtype)
            x_rms = out_x.reshape(batch * seqlen, dim)
            z_rms = z.reshape(batch * seqlen, dim)
            rmsnorm_weight = rmsnorm_weight.contiguous()
            out, _, rstd = _layer_norm_fwd(x_rms, rmsnorm_weight, None, rmsnorm_eps, z_rms, out=None,
                                           group_size=dim // ngroups, norm_before_gate=norm_before_gate,
                                           is_rms_norm=True)
            out = out.reshape(batch, seqlen, dim)
        if outproj_weight is not None:
            if torch.is_autocast_enabled("cpu"):
                dtype = torch.get_autocast_dtype("cpu")
                out, outproj_weight = out.to(dtype), outproj_weight.to(dtype)
                outproj_bias = outproj_bias.to(dtype) if outproj_bias is not None else None
            out = torch.nn.functional.linear(out, outproj_weight, outproj_bias)
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, initial_states, seq_idx,
                              rmsnorm_weight, rstd, outproj_weight, outproj_bias)
        ctx.dt_limit, ctx.return_final_states, ctx.activation = dt_limit, return_final_states, activation
        ctx.rmsnorm_eps, ctx.norm_before_gate, ctx.chunk_size = rmsnorm_eps, norm_before_gate, chunk_size
        ctx.headdim, ctx.ngroups, ctx.state_dtype = headdim, ngroups, state_dtype
        return out if not return_final_states else (out, final_states)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, dout, *args):
        (zxbcdt, conv1d_weight, conv1d_bias, out, A, D, dt_bias, initial_states, seq_idx, rmsnorm_weight, rstd,
         outproj_weight, outproj_bias) = ctx.saved_tensors
        dfinal_states = args[0] if ctx.return_final_states else None
        headdim, ngroups = ctx.headdim, ctx.ngroups
        nheads = D.shape[0]
        dim = nheads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
        recompute_output = outproj_weight is not None
        if recompute_output:
            out_recompute = torch.empty(*out.shape[:2], d_nonssm + dim, device=out.device, dtype=out.dtype)
            out0_recompute, out1_recompute = out_recompute.split([d_nonssm, dim], dim=-1)
        zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        xBC_conv = causal_conv1d_fwd_function(ensure_stride(xBC).transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx,
                                              None, None, ctx.activation in ["silu", "swish"]).transpose(1, 2)
        x, B, C = torch.split(xBC_conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        batch, seqlen = x.shape[:2]
        x = x.reshape(batch, seqlen, nheads, headdim)
        B = B.reshape(batch, seqlen, ngroups, dstate)
        C = C.reshape(batch, seqlen, ngroups, dstate)
        dzxbcdt = torch.empty_like(zxbcdt)
        dzx0, dz, dxBC_given, ddt_given = torch.split(dzxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads],
                                                      dim=-1)
        dxBC = torch.empty_like(xBC)
        dx, dB, dC = torch.split(dxBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        z = z.reshape(batch, seqlen, nheads, headdim)
        dx = dx.reshape(batch, seqlen, nheads, headdim)
        dB = dB.reshape(batch, seqlen, ngroups, dstate)
        dC = dC.reshape(batch, seqlen, ngroups, dstate)
        if outproj_weight is not None:
            dout_og = dout
            dout = torch.nn.functional.linear(dout, outproj_weight.t())
        dout = dout.reshape(batch, seqlen, nheads, headdim)
        if rmsnorm_weight is None:
            dz = dz.reshape(batch, seqlen, nheads, headdim)
            dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states, *rest = mamba_chunk_scan_combined_bwd(
                dout, x, dt, A, B, C, out, ctx.chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                dfinal_states=dfinal_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=ctx.dt_limit, dx=dx,
                ddt=ddt_given, dB=dB, dC=dC, dz=dz, recompute_output=recompute_output, state_dtype=ctx.state_dtype)
            out_for_linear = rest[0].reshape(batch, seqlen, dim) if recompute_output else None
            drmsnorm_weight = None
        else:
            dy_rms = dout.reshape(batch * seqlen, dim)
            dz = dz.reshape(batch * seqlen, dim)
            x_rms = out.reshape(batch * seqlen, dim)
            z_rms = z.reshape(batch * seqlen, dim)
            out1_recompute = out1_recompute.reshape(batch * seqlen, dim) if recompute_output else None
            dout, drmsnorm_weight, _, dz, *rest = _layer_norm_bwd(
                dy_rms, x_rms, rmsnorm_weight, None, ctx.rmsnorm_eps, None, rstd, z_rms, group_size=dim // ngroups,
                norm_before_gate=ctx.norm_before_gate, is_rms_norm=True, recompute_output=recompute_output, dz=dz,
                out=out1_recompute if recompute_output else None)
            out_for_linear = out_recompute if recompute_output else None
            dout = dout.reshape(batch, seqlen, nheads, headdim)
            dx, ddt, dA, dB, dC, dD, _, ddt_bias, dinitial_states = mamba_chunk_scan_combined_bwd(
                dout, x, dt, A, B, C, out, ctx.chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=initial_states,
                dfinal_states=dfinal_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=ctx.dt_limit, dx=dx,
                ddt=ddt_given, dB=dB, dC=dC, state_dtype=ctx.state_dtype)
        if outproj_weight is not None:
            doutproj_weight = torch.einsum("bso,bsd->od", dout_og, out_for_linear)
            doutproj_bias = dout_og.sum(dim=(0, 1)) if outproj_bias is not None else None
        else:
            doutproj_weight, doutproj_bias = None, None
        dxBC_given_update, dweight, dbias, *_ = causal_conv1d_bwd_function(
            ensure_stride(xBC).transpose(1, 2), conv1d_weight, conv1d_bias, ensure_stride(dxBC).transpose(1, 2),
            seq_idx, None, None, ensure_stride(dxBC_given).transpose(1, 2), False, ctx.activation in ["silu", "swish"])
        dxBC_given_update = dxBC_given_update.transpose(1, 2)
        if dxBC_given.stride() != dxBC_given_update.stride():
            dxBC_given.copy_(dxBC_given_update)
        else:
            dxBC_given = dxBC_given_update
        return (dzxbcdt, dweight, dbias, ddt_bias, dA, dD, None, dinitial_states, None, None, None, None,
                drmsnorm_weight, None, doutproj_weight, doutproj_bias, None, None, None, None)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None):
    return SplitConv1dScanCombined.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                         initial_states, seq_idx, dt_limit, return_final_states, activation,
                                         rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups,
                                         norm_before_gate, state_dtype)
