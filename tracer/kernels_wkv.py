"""RWKV's WKV attention as a GPU runs it, on fake CPU tensors (installed by `kernels.emulate("cuda")` through
tracer.kernels_ssm).

transformers' RwkvSelfAttention calls `rwkv_linear_attention` (models/rwkv/modeling_rwkv.py, transformers 5.23): on a
GPU where transformers compiled its WKV CUDA kernel (`load_wkv_cuda_kernel`, when ninja is installed, at the config's
`context_length`) it runs `RwkvLinearAttention`, an autograd Function around the kernel, for prompts of two tokens
and more; otherwise, and for one token, `rwkv_linear_attention_cpu`, a Python loop over the sequence (on a GPU too).
Here every call of two tokens and more runs `_Wkv`, the Function's own allocations (the kernel fills tensors it is
handed and allocates nothing):

- forward: time_decay as `-exp(time_decay.float())` (fp32); fp16 inputs copied to fp32 (bf16 ones not); the output
  `empty_like(key)`; with a state (inference's cache) an fp32 (b, hidden, 3) state, handed back as three views;
  `save_for_backward(time_decay, time_first, key, value, output)`;
- backward: g_time_decay (bf16 for bf16 inputs, else fp32), g_time_first, g_key, g_value `empty_like` their inputs,
  g_output made contiguous (fp32 for fp16), each gradient cast back to the input dtype.

The CPU loop it replaces keeps per-position temporaries (and, under autograd, every position's saved tensors); a run
without the compiled kernel is not priced (docs/activations.md).
"""
from __future__ import annotations

import sys

import torch


def rwkv_linear_attention(time_decay, time_first, key, value, state=None, return_state=False):
    """transformers' router: the CUDA kernel's Function for two tokens and more, the CPU loop for one."""
    if key.size(1) == 1:
        cpu = sys.modules["transformers.models.rwkv.modeling_rwkv"].rwkv_linear_attention_cpu
        return cpu(time_decay, time_first, key, value, state=state, return_state=return_state)
    return _Wkv.apply(time_decay, time_first, key, value, state, return_state)


class _Wkv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, time_decay, time_first, key, value, state=None, return_state=False):
        batch_size, seq_len, hidden_size = key.size()
        if batch_size * hidden_size % min(hidden_size, 32) != 0:
            raise ValueError(f"batch: RWKV's CUDA kernel takes batch x hidden in multiples of {min(hidden_size, 32)}; "
                             f"got {batch_size} x {hidden_size}")
        ctx.input_dtype = key.dtype
        time_decay = -torch.exp(time_decay.float().contiguous())
        if key.dtype == torch.float16:
            time_first = time_first.float()
            key = key.float()
            value = value.float()
        time_first = time_first.contiguous()
        key = key.contiguous()
        value = value.contiguous()
        output = torch.empty_like(key, memory_format=torch.contiguous_format)
        if return_state or state is not None:
            if state is None:
                state = torch.zeros(batch_size, hidden_size, 3, dtype=torch.float32, device=key.device,
                                    memory_format=torch.contiguous_format)
                state[:, :, 2] -= 1e38
            else:
                state = torch.cat([s.unsqueeze(2) for s in state], dim=2).contiguous()
        ctx.save_for_backward(time_decay, time_first, key, value, output)
        if state is not None:
            state = [s.squeeze(2) for s in torch.chunk(state, 3, dim=2)]
        return output.to(ctx.input_dtype), state

    @staticmethod
    def backward(ctx, g_output, g_state=None):
        input_dtype = ctx.input_dtype
        time_decay, time_first, key, value, output = ctx.saved_tensors
        g_time_decay = torch.empty_like(time_decay, memory_format=torch.contiguous_format,
                                        dtype=torch.bfloat16 if input_dtype == torch.bfloat16 else torch.float32)
        g_time_first = torch.empty_like(time_first, memory_format=torch.contiguous_format)
        g_key = torch.empty_like(key, memory_format=torch.contiguous_format)
        g_value = torch.empty_like(value, memory_format=torch.contiguous_format)
        if input_dtype == torch.float16:
            g_output = g_output.float()
        g_output.contiguous()   # handed to the kernel (a copy where it is not contiguous, dropped after the call)
        return (g_time_decay.to(input_dtype), g_time_first.to(input_dtype), g_key.to(input_dtype),
                g_value.to(input_dtype), None, None)
