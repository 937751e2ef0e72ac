"""Mamba-2 mixers (and Gated DeltaNet layers) as a GPU runs them, on fake CPU tensors (installed by
`kernels.emulate("cuda")`).

Gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Qwen4-exp) call `causal_conv1d_fn` / `_update` below and
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`, replaced by flash-linear-attention's kernels
(tracer.kernels_gdn); their training step runs causal_conv1d's own backward (`CausalConv1dFn.backward`). Mamba-1
mixers (Mamba, Falcon-Mamba, Jamba, Zamba) call `mamba_inner_fn`, `mamba_selective_scan` and `mamba_selective_state_update`,
replaced by mamba_ssm's selective scan (tracer.kernels_mamba1). Kimi Delta Attention layers (Kimi-Linear,
Bailing-Hybrid) call `chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention`, replaced by fla's KDA kernels
(tracer.kernels_kda).

transformers' Mamba-2 mixers (Mamba-2, Bamba, Nemotron-H, Granite-4 granitemoehybrid, Zamba2, Falcon-H1) call five
module-level functions, each wrapped by `integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`: where
`mamba_ssm` / `causal_conv1d` are importable (a CUDA install) the wrapper calls their kernels, otherwise a torch
reference that pads s to a multiple of the chunk and materialises (b, chunks, chunk, chunk, heads) decay and score
tensors. Here each function is replaced, in every loaded modeling module that has it, by one that allocates what
the CUDA kernel allocates (sources: state-spaces/mamba commit e9594ce1, Dao-AILab/causal-conv1d commit 0d2252d1):

- `causal_conv1d_fn` -> causal_conv1d `CausalConv1dFn.forward`: x made contiguous where neither of its last two
  strides is 1, then `causal_conv1d_fwd_function` (cpp_functions.py: `out = torch.empty_like(x)`);
  `save_for_backward(x, weight, bias, seq_idx, initial_states)`.
- `causal_conv1d_update` -> `causal_conv1d_update_function` (cpp_functions.py: `out = torch.empty_like(x)`;
  conv_state updated in place).
- `mamba2_selective_state_update` -> mamba_ssm ops/triton/selective_state_update.py `selective_state_update`:
  `out = torch.empty_like(x)`, the state updated in place.
- `mamba2_chunk_scan` -> ops/triton/ssd_combined.py `MambaChunkScanCombinedFn.forward` /
  `_mamba_chunk_scan_combined_fwd`: B, C (stride(-1) != 1) and x (neither stride(-1) nor stride(1) is 1) made
  contiguous; `_chunk_cumsum_fwd` (ssd_chunk_state.py): dt_out and dA_cumsum, fp32 (b, heads, chunks, chunk);
  `_chunk_state_fwd`: states fp32 (b, chunks, heads, head_dim, state); `_state_passing_fwd` (ssd_state_passing.py):
  out (b, chunks, heads, head_dim * state) in C's dtype and final_states fp32 (b, heads, head_dim * state), the fp32
  states dropped when the name is rebound; `_bmm_chunk_fwd` (ssd_bmm.py): CB fp32 (b, chunks, groups, chunk,
  chunk); `_chunk_scan_fwd` (ssd_chunk_scan.py): out like x (b, s, heads, head_dim), out_x too where z is given.
  ctx saves (out or out_x, x, dt, dA_cumsum, A, B, C, D, z, dt_bias, initial_states, seq_idx).
- `mamba2_split_conv1d_scan_combined` -> `MambaSplitConv1dScanCombinedFn`, the fused kernel a training step runs (in
  projection's output to out projection's output in one autograd node), forward and backward, transcribed
  allocation by allocation in tracer.kernels_ssd (one split of dB, dC and dCB: see there for when a GPU splits more).

What the CPU reference keeps instead (transformers `mamba2_chunk_scan`): s padded to the chunk (`pad_tensor_by_size`),
fp32 copies of x, B and C repeated to every head, the (b, heads, chunks, chunk, chunk) decay matrix L, the
(b, chunks, chunk, chunk, heads) scores G and M, and (b, chunks + 1, heads, head_dim, state) states.
Both are exact functions of b and q = chunk * ceil(s / chunk) (estimator.profile.poly).
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys

import torch

from tracer import kernels_gdn, kernels_kda, kernels_mamba1, kernels_ssd, kernels_ssd_fused, kernels_wkv

# transformers modeling modules with Mamba-2 mixers; one that the installed transformers lacks is skipped
MIXER_MODULES = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid", "zamba2", "falcon_h1",
                 # Gated DeltaNet layers: flash-linear-attention's kernels (tracer.kernels_gdn) and causal_conv1d's
                 "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "qwen4_exp",
                 # Mamba-1 mixers: mamba_ssm's selective scan (tracer.kernels_mamba1)
                 "mamba", "falcon_mamba", "jamba", "zamba",
                 # Kimi Delta Attention layers: flash-linear-attention's KDA kernels (tracer.kernels_kda)
                 "kimi_linear", "bailing_hybrid",
                 # RWKV's WKV attention: transformers' CUDA kernel's autograd Function (tracer.kernels_wkv)
                 "rwkv")
FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_selective_state_update", "mamba2_chunk_scan",
             "mamba2_split_conv1d_scan_combined", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
             "mamba_inner_fn", "mamba_selective_scan", "mamba_selective_state_update",
             "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "rwkv_linear_attention")
_CALLS = {"scan": 0}


def scan_calls() -> int:
    """Chunked scans emulated by this process so far (the derivation asks whether a step ran one)."""
    return _CALLS["scan"]


@contextlib.contextmanager
def cuda_mixers():
    """Replace the five functions in every Mamba-2 modeling module for the duration (restored on exit): in those
    already imported, and in those the enclosed code imports (building the model does), through a finder on
    sys.meta_path; importing all six up front would cost seconds in every trace of any model."""
    saved: list = []
    finder = _PatchOnImport(saved)
    sys.meta_path.insert(0, finder)
    try:
        for name in _TARGETS:
            if name in sys.modules:
                _patch(sys.modules[name], saved)
        yield
    finally:
        sys.meta_path.remove(finder)
        for mod, fn, orig in reversed(saved):
            setattr(mod, fn, orig)


_TARGETS = tuple(f"transformers.models.{n}.modeling_{n}" for n in MIXER_MODULES)


def _patch(mod, saved: list) -> None:
    for fn in FUNCTIONS:
        if hasattr(mod, fn) and getattr(mod, fn) is not _EMULATED[fn]:
            saved.append((mod, fn, getattr(mod, fn)))
            setattr(mod, fn, _EMULATED[fn])


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds a target module as the path finder does, and patches it once its code has run."""

    def __init__(self, saved: list):
        self.saved = saved

    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module, self.saved)

        spec.loader.exec_module = exec_module   # this spec's own loader object
        return spec


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    """causal_conv1d's CausalConv1dFn: out = empty_like(x) (x (b, d, s), made contiguous only where neither of
    its last two strides is 1); saves x, weight and bias for backward."""
    return _CausalConv1d.apply(hidden_states, weight, bias)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = torch.empty_like(x)                       # cpp_functions.causal_conv1d_fwd_function
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        # CausalConv1dFn.backward (a Gated DeltaNet layer's training step; Mamba-2 mixers train on the fused kernel)
        x, weight, bias = ctx.saved_tensors
        if dout.stride(2) != 1 and dout.stride(1) != 1:
            dout = dout.contiguous()
        dx, dweight, dbias, _ = kernels_ssd_fused.causal_conv1d_bwd_function(x, weight, bias, dout, None, None, None,
                                                                             None, False, True)
        return dx, dweight, dbias


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    """causal_conv1d_update_function: out = empty_like(x); conv_state updated in place."""
    return torch.empty_like(hidden_states)


def mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                                  z=None, **kwargs):
    """selective_state_update (triton): out = empty_like(x); the state updated in place."""
    return torch.empty_like(hidden_states)


def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                      dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
    """mamba_chunk_scan_combined (MambaChunkScanCombinedFn): (out, final_states) or out."""
    _CALLS["scan"] += 1
    out, final = _ChunkScanCombined.apply(hidden_states, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states)
    return (out, final) if return_final_states else out


class _ChunkScanCombined(torch.autograd.Function):
    """MambaChunkScanCombinedFn (prefill): `_mamba_chunk_scan_combined_fwd` as tracer.kernels_ssd transcribes it."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states):
        out, out_x, dt_out, dA_cumsum, states, final_states = kernels_ssd.mamba_chunk_scan_combined_fwd(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)
        ctx.save_for_backward(out if z is None else out_x, x, dt, dA_cumsum, A, B, C, D, z, dt_bias, initial_states)
        ctx.mark_non_differentiable(final_states)
        return out, final_states

    @staticmethod
    def backward(ctx, dout, dfinal):
        raise RuntimeError("kernels: mamba_chunk_scan_combined's backward is not emulated here (a training step runs "
                           "mamba_ssm's fused kernel, tracer.kernels_ssd, which this path does not reach)")


def mamba2_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                      initial_states=None, dt_limit=(0.0, float("inf")), return_final_states=False,
                                      activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                                      outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True,
                                      seq_idx=None, **kwargs):
    """mamba_ssm's mamba_split_conv1d_scan_combined (the fused training kernel: tracer.kernels_ssd)."""
    _CALLS["scan"] += 1
    return kernels_ssd_fused.mamba_split_conv1d_scan_combined(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx, dt_limit,
        return_final_states, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim,
        ngroups, norm_before_gate)


_EMULATED = {"rwkv_linear_attention": kernels_wkv.rwkv_linear_attention,
             "chunk_kimi_delta_attention": kernels_kda.chunk_kda,
             "recurrent_kimi_delta_attention": kernels_kda.fused_recurrent_kda,
             "mamba_inner_fn": kernels_mamba1.mamba_inner_fn, "mamba_selective_scan": kernels_mamba1.selective_scan_fn,
             "mamba_selective_state_update": kernels_mamba1.selective_state_update,
             "torch_chunk_gated_delta_rule": kernels_gdn.chunk_gated_delta_rule,
             "torch_recurrent_gated_delta_rule": kernels_gdn.fused_recurrent_gated_delta_rule,
             "causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update,
             "mamba2_selective_state_update": mamba2_selective_state_update, "mamba2_chunk_scan": mamba2_chunk_scan,
             "mamba2_split_conv1d_scan_combined": mamba2_split_conv1d_scan_combined}
