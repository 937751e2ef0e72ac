"""mamba_ssm's Mamba-2 (SSD) training step as a GPU runs it, on fake CPU tensors: every allocation of its Python
wrappers, in their order and with their lifetimes, the Triton and CUDA kernels (which only write into tensors the
wrappers allocated) left out.

Transcribed from state-spaces/mamba commit e9594ce1 (mamba_ssm/ops/triton/ssd_combined.py
`MambaSplitConv1dScanCombinedFn`, `_mamba_chunk_scan_combined_fwd` / `_bwd`, `_chunk_scan_chunk_state_bwd_dx`;
ssd_chunk_state.py, ssd_chunk_scan.py, ssd_state_passing.py, ssd_bmm.py, layernorm_gated.py;
utils/determinism.py `alloc_tile_workspace`) and Dao-AILab/causal-conv1d commit 0d2252d1
(causal_conv1d/cpp_functions.py `causal_conv1d_fwd_function` / `causal_conv1d_bwd_function`). Names and the order
of statements follow the source, so a temporary lives exactly as long as its Python name does there (the two
entry points drop the source's leading underscore; the fused function, with the causal_conv1d and gated-norm
wrappers it calls, is tracer.kernels_ssd_fused).

Two inputs of those wrappers are not the model's:
- **nsplits.** `_chunk_state_bwd_db`, `_chunk_scan_bwd_dC` and `_chunk_scan_bwd_dcb` write dB, dC and dCB as nsplits
  partial sums, nsplits = cdiv(heads / groups, max(min(ceil(b * chunks * heads / SMs), heads / groups), 1)). Here
  nsplits = 1 (`NSPLITS`): what the GPU runs once ceil(b * chunks * heads / SMs) >= heads / groups (on an H100's
  132 SMs, a Nemotron-H 8B layer, 128 heads in 8 groups: b x chunks >= 16, e.g. batch 1 x seq 2048 at chunk 128).
  Below that the GPU holds (nsplits - 1) more fp32 copies of dB and dC (b, s, groups, state) and dCB (b, chunks,
  groups, chunk, chunk) for the moment of each sum: the estimate is under by at most that (docs/activations.md).
- **SMs** in `_layer_norm_bwd`'s partial weight gradient, (ceil(SMs * ceil(4 / warps) / groups), d) fp32:
  `estimator.ssd.SM_COUNT` = 132 (H100 SXM, H200); a transient of d x 4 x ceil(SMs / groups) bytes (0.5 MiB at d = 8192, 8 groups).
Deterministic mode (MAMBA_DETERMINISTIC=1 or torch.use_deterministic_algorithms) is off: its tile workspaces are
not emulated.
"""
from __future__ import annotations

import math

import torch
NSPLITS = 1
F32 = torch.float32
_CHUNK_STATE_BWD_DB_MIN_BLOCK_N = 16       # not used for sizes without deterministic mode (tile workspaces)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ensure_stride(inp):
    """ssd_combined.ensure_stride: a (b, s, d) tensor whose stride(1) is not a multiple of 8 is made contiguous."""
    if inp.shape[2] % 8 != 0:
        raise ValueError(f"config: mamba_ssm needs the convolution's channels to be a multiple of 8, got "
                         f"{inp.shape[2]} (ssd_combined.ensure_stride)")
    return inp if inp.stride(1) % 8 == 0 else inp.contiguous()


# ------------------------------------------------------------------------------------ ssd_chunk_state


def _chunk_cumsum_fwd(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    batch, seqlen, nheads = dt.shape
    nchunks = math.ceil(seqlen / chunk_size)
    dt_out = torch.empty(batch, nheads, nchunks, chunk_size, device=dt.device, dtype=F32)
    dA_cumsum = torch.empty(batch, nheads, nchunks, chunk_size, device=dt.device, dtype=F32)
    return dA_cumsum, dt_out


def _chunk_cumsum_bwd(ddA, ddt_out, dt, A, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")), ddt=None):
    ddt_bias = torch.empty_like(dt_bias, dtype=F32) if dt_bias is not None else None
    if ddt is None:
        ddt = torch.empty_like(dt)
    dA = torch.empty_like(A, dtype=F32)
    return ddt, dA, ddt_bias


def _chunk_state_fwd(B, x, dt, dA_cumsum, seq_idx=None, states=None, states_in_fp32=True):
    batch, seqlen, nheads, headdim = x.shape
    _, _, nchunks, chunk_size = dt.shape
    _, _, ngroups, dstate = B.shape
    if states is None:
        states = torch.empty((batch, nchunks, nheads, headdim, dstate), device=x.device,
                             dtype=F32 if states_in_fp32 else B.dtype)
    return states


def _chunk_state_bwd_db(x, dt, dA_cumsum, dstates, seq_idx=None, B=None, ngroups=1):
    batch, seqlen, nheads, headdim = x.shape
    _, _, nchunks, chunk_size = dt.shape
    dstate = dstates.shape[-1]
    ddA_cumsum = torch.empty(batch, nheads, nchunks, chunk_size, device=x.device, dtype=F32) \
        if B is not None else None                              # alloc_tile_workspace, not deterministic
    dB = torch.empty(batch, seqlen, NSPLITS, ngroups, dstate, device=x.device, dtype=F32)
    dB = dB.sum(2)
    if ddA_cumsum is not None:
        torch.cumsum(ddA_cumsum, dim=-1, out=ddA_cumsum)
    return dB if B is None else (dB, ddA_cumsum)


# ------------------------------------------------------------------------------------ ssd_state_passing


def _state_passing_fwd(states, dA_chunk_cumsum, initial_states=None, seq_idx=None, chunk_size=None,
                       out_dtype=None):
    batch, nchunks, nheads, dim = states.shape
    out_dtype = states.dtype if out_dtype is None else out_dtype
    out = torch.empty((batch, nchunks, nheads, dim), device=states.device, dtype=out_dtype)
    final_states = torch.empty((batch, nheads, dim), device=states.device, dtype=F32)
    return out, final_states


def _state_passing_bwd(states, dA_chunk_cumsum, dout, dfinal_states=None, seq_idx=None, has_initial_states=None,
                       dstates_dtype=None, states_dtype=None, chunk_size=None):
    batch, nchunks, nheads, dim = states.shape
    dstates = torch.empty_like(dout, dtype=dstates_dtype if dstates_dtype is not None else dout.dtype)
    if states_dtype is not None and states_dtype != states.dtype:
        states_converted = torch.empty_like(states, dtype=dstates_dtype if dstates_dtype is not None else dout.dtype)
    else:
        states_converted = None
    dinitstates = torch.empty_like(dstates[:, 0]) if has_initial_states else None
    n_blocks = (dim + 64 - 1) // 64                               # BLOCK_SIZE_min = 64
    ddA_chunk_cumsum = torch.empty(batch, nheads, nchunks, n_blocks, dtype=F32, device=dA_chunk_cumsum.device)
    # [..., :n_valid_blocks]: the autotuned block size picks how many are summed, not any size
    ddA_chunk_cumsum = ddA_chunk_cumsum[..., :n_blocks].sum(dim=-1).to(dtype=dA_chunk_cumsum.dtype)
    if states_dtype is not None and states_dtype == states.dtype:
        states_converted = states
    return (dstates, ddA_chunk_cumsum, dinitstates) if states_dtype is None else \
        (dstates, ddA_chunk_cumsum, dinitstates, states_converted)


# ------------------------------------------------------------------------------------ ssd_bmm


def _bmm_chunk_fwd(a, b, chunk_size, seq_idx=None, causal=False, output_dtype=None):
    has_groups = a.dim() == 4
    if not has_groups:
        batch, seqlen, k = a.shape
    else:
        batch, seqlen, ngroups, k = a.shape
    if a.stride(-1) != 1 and a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1 and b.stride(1) != 1:
        b = b.contiguous()
    nchunks = math.ceil(seqlen / chunk_size)
    out_dtype = a.dtype if output_dtype is None else output_dtype
    shape = (batch, nchunks, chunk_size, chunk_size) if not has_groups else \
        (batch, nchunks, ngroups, chunk_size, chunk_size)
    return torch.empty(shape, device=a.device, dtype=out_dtype)


def _bmm_chunk_bwd(a, dout, residual=None, out=None):
    if a.stride(-1) != 1 and a.stride(-2) != 1:
        a = a.contiguous()
    if dout.stride(-1) != 1 and dout.stride(-2) != 1:
        dout = dout.contiguous()
    if residual is not None and residual.stride(-1) != 1 and residual.stride(1) != 1:
        residual = residual.contiguous()
    if out is None:
        out = torch.empty_like(a)
    return out


# ------------------------------------------------------------------------------------ ssd_chunk_scan


def _chunk_scan_fwd(cb, x, dt, dA_cumsum, C, states, D=None, z=None, seq_idx=None):
    batch, seqlen, nheads, headdim = x.shape
    out = torch.empty(batch, seqlen, nheads, headdim, device=x.device, dtype=x.dtype)
    out_x = torch.empty(batch, seqlen, nheads, headdim, device=x.device, dtype=x.dtype) if z is not None else None
    return out, out_x


def _chunk_scan_bwd_dz(x, z, out, dout, chunk_size, has_ddAcs=True, D=None, dz=None, recompute_output=False):
    batch, seqlen, nheads, headdim = x.shape
    nchunks = math.ceil(seqlen / chunk_size)
    ddA_cumsum = torch.empty(batch, nheads, nchunks, chunk_size, device=x.device, dtype=F32) if has_ddAcs else None
    if D is not None:
        dD = torch.empty(_cdiv(chunk_size, 32), batch, nchunks, nheads, headdim if D.dim() == 2 else 1,
                         device=D.device, dtype=F32)
    else:
        dD = None
    if dz is None:
        dz = torch.empty_like(z)
    outz = torch.empty_like(x) if recompute_output else None
    dout_x = torch.empty_like(dout)
    if D is not None:
        dD = dD.sum(dim=(0, 1, 2)).to(dtype=D.dtype)
        if D.dim() == 1:
            dD = dD.reshape(dD.shape[0])
    return_vals = (dz, dout_x, dD, ddA_cumsum) if has_ddAcs else (dz, dout_x, dD)
    return return_vals if not recompute_output else (*return_vals, outz)


def _chunk_scan_bwd_dstates(C, dA_cumsum, dout, seq_idx=None, dtype=None):
    batch, seqlen, nheads, headdim = dout.shape
    _, _, nchunks, chunk_size = dA_cumsum.shape
    _, _, ngroups, dstate = C.shape
    dtype = C.dtype if dtype is None else dtype
    return torch.empty(batch, nchunks, nheads, headdim, dstate, device=C.device, dtype=dtype)


def _chunk_scan_bwd_dC(prev_states, dA_cumsum, dout, seq_idx=None, C=None, ngroups=1):
    batch, nchunks, nheads, headdim, dstate = prev_states.shape
    _, seqlen, _, _ = dout.shape
    _, _, _, chunk_size = dA_cumsum.shape
    ddA_cumsum_prev = torch.empty(batch, nheads, nchunks, chunk_size, device=dout.device, dtype=F32) \
        if C is not None else None
    dC = torch.empty(batch, seqlen, NSPLITS, ngroups, dstate, device=dout.device, dtype=F32)
    dC = dC.sum(2)
    return dC if C is None else (dC, ddA_cumsum_prev)


def _chunk_scan_bwd_dcb(x, dt, dA_cumsum, dout, seq_idx=None, CB=None, ngroups=1):
    batch, seqlen, nheads, headdim = x.shape
    _, _, nchunks, chunk_size = dt.shape
    ddA_cumsum = torch.empty(batch, nheads, nchunks, _cdiv(chunk_size, 16), chunk_size, device=x.device,
                             dtype=F32) if CB is not None else None
    dcb = torch.empty(batch, nchunks, NSPLITS, ngroups, chunk_size, chunk_size, device=x.device, dtype=F32)
    dcb = dcb.sum(2)
    if ddA_cumsum is not None:
        ddA_cumsum = ddA_cumsum.sum(dim=3)
    return dcb if CB is None else (dcb, ddA_cumsum)


def _chunk_scan_bwd_ddAcs_stable(x, dt, dA_cumsum, dout, cb):
    batch, seqlen, nheads, headdim = x.shape
    _, _, nchunks, chunk_size = dt.shape
    ddA_cumsum = torch.empty(batch, nheads, nchunks, _cdiv(chunk_size, 32), chunk_size, device=x.device, dtype=F32)
    return ddA_cumsum.sum(dim=3)     # [:, :, :, :n_valid_blocks]: the sum's size is the same for any block size


# ------------------------------------------------------------------------------------ ssd_combined


def _chunk_scan_chunk_state_bwd_dx(x, dt, dA_cumsum, B, CB, dout, dstates, D=None, seq_idx=None, dx=None):
    batch, seqlen, nheads, headdim = x.shape
    _, _, nchunks, chunk_size = dt.shape
    if D is not None:
        dD_hdim = headdim if D.dim() == 2 else 1                  # not deterministic: one column per head
        dD = torch.zeros(_cdiv(chunk_size, 32), batch, nchunks, nheads, dD_hdim, device=D.device, dtype=F32)
    else:
        dD = None
    if dx is None:
        dx = torch.empty_like(x)
    ddt = torch.empty(batch, nheads, nchunks, chunk_size, device=dout.device, dtype=F32)   # alloc_tile_workspace
    if D is not None:
        dD = dD.sum(dim=(0, 1, 2))
        if D.dim() == 1:
            dD = dD.sum(dim=-1)
        dD = dD.to(dtype=D.dtype)
    return dx, ddt, dD


def mamba_chunk_scan_combined_fwd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                   seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")), state_dtype=None):
    _, _, _, dstate = B.shape
    if B.stride(-1) != 1:
        B = B.contiguous()
    if C.stride(-1) != 1:
        C = C.contiguous()
    if x.stride(-1) != 1 and x.stride(1) != 1:
        x = x.contiguous()
    if z is not None and z.stride(-1) != 1 and z.stride(1) != 1:
        z = z.contiguous()
    if D is not None and D.stride(-1) != 1:
        D = D.contiguous()
    dA_cumsum, dt = _chunk_cumsum_fwd(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    states = _chunk_state_fwd(B, x, dt, dA_cumsum, seq_idx=seq_idx, states_in_fp32=True)
    states, final_states = _state_passing_fwd(_pn(states), dA_cumsum[:, :, :, -1], initial_states=None,
                                              seq_idx=seq_idx, chunk_size=chunk_size,
                                              out_dtype=state_dtype if state_dtype is not None else C.dtype)
    states, final_states = [_unpn(t, dstate) for t in [states, final_states]]
    CB = _bmm_chunk_fwd(C, B, chunk_size, seq_idx=seq_idx, output_dtype=F32)
    out, out_x = _chunk_scan_fwd(CB, x, dt, dA_cumsum, C, states, D=D, z=z, seq_idx=seq_idx)
    return out, out_x, dt, dA_cumsum, states, final_states


def mamba_chunk_scan_combined_bwd(dout, x, dt, A, B, C, out, chunk_size, D=None, z=None, dt_bias=None,
                                   initial_states=None, dfinal_states=None, seq_idx=None, dt_softplus=False,
                                   dt_limit=(0.0, float("inf")), dx=None, ddt=None, dB=None, dC=None, dz=None,
                                   recompute_output=False, state_dtype=None):
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    batch, seqlen, nheads, headdim = x.shape
    _, _, ngroups, dstate = B.shape
    dB_given = dB if dB is not None else torch.empty_like(B)
    dC_given = dC if dC is not None else torch.empty_like(C)
    ddt_given = ddt if ddt is not None else torch.empty_like(dt)
    dt_in = dt.clone()
    dA_cumsum, dt = _chunk_cumsum_fwd(dt_in, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                      dt_limit=dt_limit)
    CB = _bmm_chunk_fwd(C, B, chunk_size, seq_idx=seq_idx, output_dtype=F32)
    states = _chunk_state_fwd(B, x, dt, dA_cumsum, seq_idx=seq_idx, states_in_fp32=True)
    states, _ = _state_passing_fwd(_pn(states), dA_cumsum[:, :, :, -1], initial_states=None, seq_idx=seq_idx,
                                   chunk_size=chunk_size)
    states = _unpn(states, dstate)
    if z is not None:
        dz, dout, dD, *rest = _chunk_scan_bwd_dz(x, z, out, dout, chunk_size=chunk_size, has_ddAcs=False, D=D, dz=dz,
                                                 recompute_output=recompute_output)
        outz = rest[0] if recompute_output else out
    else:
        dz = None
        outz = out
    dstates = _chunk_scan_bwd_dstates(C, dA_cumsum, dout, seq_idx=seq_idx, dtype=states.dtype)
    dstates, ddA_chunk_cumsum, dinitial_states, states = _state_passing_bwd(
        _pn(states), dA_cumsum[:, :, :, -1], _pn(dstates), dfinal_states=None, seq_idx=seq_idx,
        has_initial_states=initial_states is not None,
        dstates_dtype=state_dtype if state_dtype is not None else x.dtype,
        states_dtype=state_dtype if state_dtype is not None else x.dtype, chunk_size=chunk_size)
    states = _unpn(states, dstate)
    dstates = _unpn(dstates, dstate)
    dx, ddt, dD_from_x = _chunk_scan_chunk_state_bwd_dx(x, dt, dA_cumsum, B, CB, dout, dstates, D=D, seq_idx=seq_idx,
                                                        dx=dx)
    dB, ddA_next = _chunk_state_bwd_db(x, dt, dA_cumsum, dstates, seq_idx=seq_idx, B=B, ngroups=ngroups)
    dC, ddA_cumsum_prev = _chunk_scan_bwd_dC(states.to(state_dtype if state_dtype is not None else x.dtype),
                                             dA_cumsum, dout, seq_idx=seq_idx, C=C, ngroups=ngroups)
    dCB = _chunk_scan_bwd_dcb(x, dt, dA_cumsum, dout, seq_idx=seq_idx, ngroups=ngroups)
    dCB = dCB.to(CB.dtype)
    _bmm_chunk_bwd(C, dCB, residual=dB, out=dB_given)
    _bmm_chunk_bwd(B, dCB.transpose(-1, -2), residual=dC, out=dC_given)
    if z is None:
        dD = dD_from_x
    ddA_cumsum_prev[..., -1] += ddA_chunk_cumsum
    ddA_prev = ddA_cumsum_prev.flip([-1]).cumsum(dim=-1).flip([-1])
    ddA = _chunk_scan_bwd_ddAcs_stable(x, dt, dA_cumsum, dout, CB)
    ddA += ddA_next + ddA_prev
    ddt_given, dA, ddt_bias = _chunk_cumsum_bwd(ddA, ddt, dt_in, A, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                                dt_limit=dt_limit, ddt=ddt_given)
    return_vals = (dx, ddt_given, dA, dB_given, dC_given, dD, dz, ddt_bias, dinitial_states)
    return return_vals if not recompute_output else (*return_vals, outz)


def _pn(t):
    """einops "... p n -> ... (p n)"."""
    return t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1])


def _unpn(t, n: int):
    """einops "... (p n) -> ... p n"."""
    return t.reshape(*t.shape[:-1], t.shape[-1] // n, n)
