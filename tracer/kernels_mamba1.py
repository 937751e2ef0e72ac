"""Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba) as a GPU runs them, on fake CPU tensors (installed with the Mamba-2
ones by tracer.kernels_ssm for `kernels.emulate("cuda")`).

transformers' Mamba-1 mixers call `mamba_inner_fn` (Mamba and Falcon-Mamba in training: the fused in_proj-output to
out_proj-output function), `mamba_selective_scan` (prefill, and Jamba's training step) and
`mamba_selective_state_update` (one-token decoding), each wrapped by `use_kernel_func_from_hub_with_fallback(...,
"mamba_ssm")`: where mamba_ssm imports (a CUDA install) the wrapper calls its kernels, otherwise a torch reference that
loops over the sequence. Here each is replaced by one that allocates what mamba_ssm allocates, in its order, the CUDA
kernels (which only write into those tensors) left out. Source: state-spaces/mamba commit e9594ce1:
mamba_ssm/ops/selective_scan_interface.py (`SelectiveScanFn`, `MambaInnerFn`, `rms_norm_forward`),
csrc/selective_scan/selective_scan.cpp (`selective_scan_fwd` / `_bwd`: the scan's chunk states x are (b, d, ceil(s /
2048), 2 x state) in A's dtype), ops/triton/layer_norm.py (`_layer_norm_fwd`), ops/triton/selective_state_update.py;
causal_conv1d as in tracer.kernels_ssd_fused.
"""
from __future__ import annotations

import torch

from tracer.kernels_ssd_fused import causal_conv1d_bwd_function, causal_conv1d_fwd_function

CHUNK = 2048            # selective_scan.cpp: n_chunks = (seqlen + 2048 - 1) / 2048
F32 = torch.float32
_CALLS = {"scan": 0}


def scan_calls() -> int:
    """Selective scans (and fused Mamba-1 calls) emulated by this process so far."""
    return _CALLS["scan"]


# ------------------------------------------------------------------------------------ csrc/selective_scan


def selective_scan_cuda_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    batch_size, dim, seqlen = u.shape
    dstate = A.shape[1]
    out_z = torch.empty_like(z) if z is not None else None
    n_chunks = (seqlen + CHUNK - 1) // CHUNK
    out = torch.empty_like(delta)
    x = torch.empty((batch_size, dim, n_chunks, dstate * 2), device=u.device, dtype=A.dtype)
    return [out, x] + ([out_z] if z is not None else [])


def selective_scan_cuda_bwd(u, delta, A, B, C, D, z, delta_bias, dout, x, out, dz, delta_softplus, recompute_out_z):
    is_variable_B, is_variable_C = B.dim() >= 3, C.dim() >= 3
    out_z = None
    if z is not None:
        if dz is None:
            dz = torch.empty_like(z)
        if recompute_out_z:
            out_z = torch.empty_like(out)
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dA = torch.zeros_like(A)
    dB = torch.zeros_like(B) if not is_variable_B else torch.zeros_like(B, dtype=F32)
    dC = torch.zeros_like(C) if not is_variable_C else torch.zeros_like(C, dtype=F32)
    dD = torch.zeros_like(D) if D is not None else None
    ddelta_bias = torch.zeros_like(delta_bias) if delta_bias is not None else None
    result = [du, ddelta, dA, dB.to(B.dtype), dC.to(C.dtype), dD, ddelta_bias]
    if z is not None:
        result.append(dz)
    if recompute_out_z:
        result.append(out_z)
    return result


# ------------------------------------------------------------------------------------ selective_scan_interface


def _b1(t):
    """einops "b dstate l -> b 1 dstate l" (a view)."""
    return t.unsqueeze(1)


class SelectiveScan(torch.autograd.Function):
    """SelectiveScanFn: saves u, delta, A, B, C, D, delta_bias, the chunk states x (and z and out with a gate)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
        if u.stride(-1) != 1:
            u = u.contiguous()
        if delta.stride(-1) != 1:
            delta = delta.contiguous()
        if D is not None:
            D = D.contiguous()
        if B.stride(-1) != 1:
            B = B.contiguous()
        if C.stride(-1) != 1:
            C = C.contiguous()
        if z is not None and z.stride(-1) != 1:
            z = z.contiguous()
        ctx.squeeze_B, ctx.squeeze_C = B.dim() == 3, C.dim() == 3
        if B.dim() == 3:
            B = _b1(B)
        if C.dim() == 3:
            C = _b1(C)
        out, x, *rest = selective_scan_cuda_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
        ctx.delta_softplus = delta_softplus
        ctx.has_z = z is not None
        last_state = x[:, :, -1, 1::2]
        if not ctx.has_z:
            ctx.save_for_backward(u, delta, A, B, C, D, delta_bias, x)
            return out if not return_last_state else (out, last_state)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, x, out)
        out_z = rest[0]
        return out_z if not return_last_state else (out_z, last_state)

    @staticmethod
    def backward(ctx, dout, *args):
        if not ctx.has_z:
            u, delta, A, B, C, D, delta_bias, x = ctx.saved_tensors
            z, out = None, None
        else:
            u, delta, A, B, C, D, z, delta_bias, x, out = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        du, ddelta, dA, dB, dC, dD, ddelta_bias, *rest = selective_scan_cuda_bwd(
            u, delta, A, B, C, D, z, delta_bias, dout, x, out, None, ctx.delta_softplus, False)
        dz = rest[0] if ctx.has_z else None
        dB = dB.squeeze(1) if ctx.squeeze_B else dB
        dC = dC.squeeze(1) if ctx.squeeze_C else dC
        return (du, ddelta, dA, dB, dC, dD if D is not None else None, dz,
                ddelta_bias if delta_bias is not None else None, None, None)


def rms_norm_forward(x, weight, bias, eps=1e-6, is_rms_norm=True):
    """selective_scan_interface.rms_norm_forward -> ops/triton/layer_norm.py `_layer_norm_fwd`: y like x, an fp32
    rstd per row (freed: only y is returned)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty_like(x)
    rstd = torch.empty((x.shape[0],), dtype=F32, device=x.device)
    del rstd
    return y


def _bl_d(t):
    """einops "b 1 dstate l -> (b l) dstate" then .contiguous() (a copy)."""
    b, _, n, length = t.shape
    return t.squeeze(1).transpose(1, 2).reshape(b * length, n).contiguous()


def _b1_dl(t, length: int):
    """einops "(b l) dstate -> b 1 dstate l" then .contiguous() (a copy)."""
    return t.reshape(-1, length, t.shape[-1]).transpose(1, 2).unsqueeze(1).contiguous()


class MambaInner(torch.autograd.Function):
    """MambaInnerFn (checkpoint_lvl 1): keeps xz, x_dbl (b*s, dt_rank + 2 x state), B and C (b, 1, state, s), the
    chunk states and the scan output; the conv output and delta are recomputed in backward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias,
                A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None, delta_softplus=True,
                checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None, b_c_dt_rms_eps=1e-6):
        if B is not None or C is not None or B_proj_bias is not None or C_proj_bias is not None:
            raise ValueError("kernels: a Mamba-1 mixer with input-independent B or C is not emulated")
        L = xz.shape[-1]
        delta_rank = delta_proj_weight.shape[1]
        d_state = A.shape[-1]
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            x_proj_weight = x_proj_weight.to(dtype=dtype)
            delta_proj_weight = delta_proj_weight.to(dtype=dtype)
            out_proj_weight = out_proj_weight.to(dtype=dtype)
            out_proj_bias = out_proj_bias.to(dtype=dtype) if out_proj_bias is not None else None
        if xz.stride(-1) != 1:
            xz = xz.contiguous()
        conv1d_weight = conv1d_weight.squeeze(1)
        x, z = xz.chunk(2, dim=1)
        conv1d_bias = conv1d_bias.contiguous() if conv1d_bias is not None else None
        conv1d_out = causal_conv1d_fwd_function(x, conv1d_weight, conv1d_bias, None, None, None, True)
        x_dbl = torch.nn.functional.linear(conv1d_out.transpose(1, 2).reshape(-1, conv1d_out.shape[1]), x_proj_weight)
        delta = (delta_proj_weight @ x_dbl[:, :delta_rank].t()).reshape(-1, xz.shape[0], L).transpose(0, 1)
        B = _b1_dl(x_dbl[:, delta_rank:delta_rank + d_state], L)
        C = _b1_dl(x_dbl[:, -d_state:], L)
        if D is not None:
            D = D.contiguous()
        if b_rms_weight is not None:       # one statement per line, as the source: each name rebound frees the last
            B = _bl_d(B)
            B = rms_norm_forward(B, b_rms_weight, None, b_c_dt_rms_eps)
            B = _b1_dl(B, L)
        if c_rms_weight is not None:
            C = _bl_d(C)
            C = rms_norm_forward(C, c_rms_weight, None, b_c_dt_rms_eps)
            C = _b1_dl(C, L)
        if dt_rms_weight is not None:
            delta = delta.transpose(1, 2).reshape(-1, delta.shape[1]).contiguous()
            delta = rms_norm_forward(delta, dt_rms_weight, None, b_c_dt_rms_eps)
            delta = delta.reshape(xz.shape[0], L, -1).transpose(1, 2).contiguous()
        out, scan_intermediates, out_z = selective_scan_cuda_fwd(conv1d_out, delta, A, B, C, D, z, delta_bias,
                                                                 delta_softplus)
        ctx.delta_softplus, ctx.out_proj_bias_is_None = delta_softplus, out_proj_bias is None
        ctx.b_rms_weight, ctx.c_rms_weight, ctx.dt_rms_weight = b_rms_weight, c_rms_weight, dt_rms_weight
        ctx.b_c_dt_rms_eps = b_c_dt_rms_eps
        conv1d_out, delta = None, None            # checkpoint_lvl 1: recomputed in backward
        ctx.save_for_backward(xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_weight, delta_proj_weight,
                              out_proj_weight, conv1d_out, delta, A, B, C, D, delta_bias, scan_intermediates,
                              b_rms_weight, c_rms_weight, dt_rms_weight, out)
        return torch.nn.functional.linear(out_z.transpose(1, 2), out_proj_weight, out_proj_bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, dout):
        (xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_weight, delta_proj_weight, out_proj_weight, conv1d_out, delta,
         A, B, C, D, delta_bias, scan_intermediates, b_rms_weight, c_rms_weight, dt_rms_weight, out) = ctx.saved_tensors
        L = xz.shape[-1]
        delta_rank = delta_proj_weight.shape[1]
        d_state = A.shape[-1]
        x, z = xz.chunk(2, dim=1)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        conv1d_out = causal_conv1d_fwd_function(x, conv1d_weight, conv1d_bias, None, None, None, True)
        delta = (delta_proj_weight @ x_dbl[:, :delta_rank].t()).reshape(-1, xz.shape[0], L).transpose(0, 1)
        if dt_rms_weight is not None:
            delta = delta.transpose(1, 2).reshape(-1, delta.shape[1]).contiguous()
            delta = rms_norm_forward(delta, ctx.dt_rms_weight, None, ctx.b_c_dt_rms_eps)
            delta = delta.reshape(xz.shape[0], L, -1).transpose(1, 2).contiguous()
        if b_rms_weight is not None:
            B = _bl_d(B)
            B = rms_norm_forward(B, ctx.b_rms_weight, None, ctx.b_c_dt_rms_eps)
            B = _b1_dl(B, L)
        if c_rms_weight is not None:
            C = _bl_d(C)
            C = rms_norm_forward(C, ctx.c_rms_weight, None, ctx.b_c_dt_rms_eps)
            C = _b1_dl(C, L)
        dxz = torch.empty_like(xz)
        dx, dz = dxz.chunk(2, dim=1)
        dout = dout.reshape(-1, dout.shape[-1]).t()                               # "b l e -> e (b l)"
        dout_y = (out_proj_weight.t() @ dout).reshape(-1, xz.shape[0], L).transpose(0, 1)
        dconv1d_out, ddelta, dA, dB, dC, dD, ddelta_bias, dz, out_z = selective_scan_cuda_bwd(
            conv1d_out, delta, A, B, C, D, z, delta_bias, dout_y, scan_intermediates, out, dz, ctx.delta_softplus, True)
        dout_proj_weight = torch.einsum("eB,dB->ed", dout, out_z.transpose(0, 1).reshape(out_z.shape[1], -1))
        dout_proj_bias = dout.sum(dim=(0, 1)) if not ctx.out_proj_bias_is_None else None
        dx_dbl = torch.empty_like(x_dbl)
        dB = _bl_d(dB)
        dx_dbl[:, delta_rank:delta_rank + d_state] = dB
        dB = None
        dC = _bl_d(dC)
        dx_dbl[:, -d_state:] = dC
        dC = None
        ddelta = ddelta.transpose(0, 1).reshape(ddelta.shape[1], -1)             # "b d l -> d (b l)"
        ddelta_proj_weight = torch.einsum("dB,Br->dr", ddelta, x_dbl[:, :delta_rank])
        dx_dbl[:, :delta_rank] = torch.einsum("dB,dr->Br", ddelta, delta_proj_weight)
        dconv1d_out = dconv1d_out.transpose(0, 1).reshape(dconv1d_out.shape[1], -1)
        dx_proj_weight = torch.einsum("Br,Bd->rd", dx_dbl, conv1d_out.transpose(1, 2).reshape(-1, conv1d_out.shape[1]))
        dconv1d_out = torch.addmm(dconv1d_out, x_proj_weight.t(), dx_dbl.t(), out=dconv1d_out)
        dconv1d_out = dconv1d_out.reshape(-1, x.shape[0], x.shape[-1]).transpose(0, 1)
        dx, dconv1d_weight, dconv1d_bias, *_ = causal_conv1d_bwd_function(
            x, conv1d_weight, conv1d_bias, dconv1d_out, None, None, None, dx, False, True)
        dconv1d_bias = dconv1d_bias if conv1d_bias is not None else None
        dconv1d_weight = dconv1d_weight.unsqueeze(1)
        return (dxz, dconv1d_weight, dconv1d_bias, dx_proj_weight, ddelta_proj_weight, dout_proj_weight,
                dout_proj_bias, dA, None, None, dD, ddelta_bias if delta_bias is not None else None,
                None, None, None, None, None, None, None, None)


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias,
                   A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                   delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                   b_c_dt_rms_eps=1e-6, **kwargs):
    """mamba_ssm's mamba_inner_fn, in place of transformers' torch fallback (which returns None)."""
    _CALLS["scan"] += 1
    return MambaInner.apply(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                            out_proj_bias, A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, delta_softplus,
                            checkpoint_lvl, b_rms_weight, c_rms_weight, dt_rms_weight, b_c_dt_rms_eps)


def selective_scan_fn(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, **kwargs):
    """mamba_ssm's selective_scan_fn (transformers' `mamba_selective_scan`; its use_mambapy / use_associative_scan
    choose among torch references only)."""
    _CALLS["scan"] += 1
    return SelectiveScan.apply(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, **kwargs):
    """ops/triton/selective_state_update.py: out = empty_like(x), the state updated in place."""
    return torch.empty_like(x)

