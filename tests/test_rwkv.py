"""RWKV priced on transformers' WKV CUDA kernel (tracer.kernels_wkv: its autograd Function's own allocations; the
kernel allocates nothing), the tiny config tests/data/tiny/t-rwkv.json (3 layers of width 64). Its decoding mixes the
(b, 1, hidden) token with the (b, hidden) shifted state, a (b, b, hidden) tensor: a batch^2 term fit on three batches.

    python -m pytest tests/test_rwkv.py -q          # WILLITFIT_SLOW=1 adds LoRA, checkpointing and inference
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from estimator.spec import Workload
from traced import assert_equals_trace

pytest.importorskip("torch")

TINY = Path(__file__).parent / "data" / "tiny"
SLOW = pytest.mark.skipif(not os.environ.get("WILLITFIT_SLOW"), reason="slow tier: WILLITFIT_SLOW=1")


def _config() -> dict:
    return json.loads((TINY / "t-rwkv.json").read_text())


def test_training_on_the_wkv_kernel_equals_a_full_depth_trace():
    # without the kernel's emulation its step loops over every position in Python: other operations at every seq
    assert_equals_trace(_config(), "t-rwkv", Workload(attention="eager"), ((2, 100), (3, 203)))


def test_the_wkv_function_keeps_what_the_cuda_kernels_function_keeps():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer import kernels_wkv

    with FakeTensorMode():
        bf = dict(dtype=torch.bfloat16)
        decay, first = torch.empty(64, requires_grad=True, **bf), torch.empty(64, requires_grad=True, **bf)
        key, value = torch.empty(2, 10, 64, requires_grad=True, **bf), torch.empty(2, 10, 64, requires_grad=True, **bf)
        out, state = kernels_wkv.rwkv_linear_attention(decay, first, key, value)
        saved = out.grad_fn.saved_tensors
    assert state is None and out.dtype == torch.bfloat16 and out.shape == key.shape
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.float32, (64,)), (torch.bfloat16, (64,)),
                                                        (torch.bfloat16, (2, 10, 64)), (torch.bfloat16, (2, 10, 64)),
                                                        (torch.bfloat16, (2, 10, 64))]


@SLOW
@pytest.mark.parametrize("w, sizes", [
    (Workload(method="lora", lora_targets=("key", "value"), attention="eager"), ((2, 150),)),
    (Workload(checkpointing="full", attention="eager"), ((2, 90),)),
    (Workload(mode="infer", gen_tokens=6, attention="eager"), ((7, 300), (1, 60))),
], ids=["lora", "ckpt-full", "infer"])
def test_rwkv_equals_a_full_depth_trace(w, sizes):
    assert_equals_trace(_config(), "t-rwkv", w, sizes)
