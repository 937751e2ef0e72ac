"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5), priced as a GPU runs them: flash-linear-attention's chunked and
recurrent kernels and causal_conv1d (tracer.kernels_gdn), whose chunk states are sized by q = 64 * ceil(s / 64).

The tiny configs (tests/data/tiny/t-qwen3_next.json: a MoE of 4 experts, t-qwen3_5_text.json: dense) have 4 layers
of width 64 (linear, linear, full attention, linear), 2 key heads and 4 value heads of 16 in the linear layers. The
estimate is checked against full-depth traces at seqs the fit did not use (100, 700: no multiples of the chunk).

    WILLITFIT_SLOW=1 python -m pytest tests/test_gdn.py -q -p no:cacheprovider
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator.spec import Workload
from tracecheck import check_tiny

TINY = Path(__file__).parent / "data" / "tiny"


def _config(name: str) -> dict:
    return json.loads((TINY / f"t-{name}.json").read_text())


def _check(name: str, w: Workload, sizes) -> list:
    from tracer import kernels_gdn

    return check_tiny(name, w, sizes, kernels_gdn.chunk_calls, "Gated DeltaNet / KDA layers on flash-linear-attention's")


@pytest.mark.slow   # the default tier has the 8-layer case below, which takes the same path and more
def test_training_equals_the_full_depth_trace():
    """Qwen3-Next (Gated DeltaNet + MoE), LoRA on its default targets: fla's chunked kernel ran in every linear
    layer (3 of them, two steps), forward and backward; every stage equals a full-depth trace."""
    runs = _check("qwen3_next", Workload(mode="train", method="lora", attention="sdpa"), ((2, 100), (1, 700)))
    assert [calls for _, calls in runs] == [6, 6]


def test_lora_layers_before_the_first_adapter_are_told_apart():
    """8 layers, three Gated DeltaNet layers before each attention layer; LoRA's default targets (q_proj, v_proj) are
    in the attention layers alone, so the first three layers save nothing for backward and the later linear layers
    do. The reduced depths cut the model (so the extension counts layers by type); the linear layers before the
    first adapter are a type of their own (tracer.derive._frozen_prefix), else the estimate was far low."""
    (est, _), = _check("qwen3_next_8", Workload(mode="train", method="lora", attention="sdpa"), ((2, 100),))
    assert len(est.profile["reduced_depths"][0]) < 8


def test_inference_caches_conv_and_recurrent_states():
    """Qwen3.5 (dense) prefill on the chunked kernel, decoding on the fused recurrent one: the decode step's cache is
    each linear layer's conv state and fp32 recurrent state (b, value heads, 16, 16) beside the attention layer's keys
    and values."""
    runs = _check("qwen3_5_text", Workload(mode="infer", gen_tokens=3, attention="sdpa"), ((2, 100),))
    (est, calls), = runs
    assert calls == 3                                    # one prefill per linear layer; decoding runs none
    b, conv_dim = 2, 2 * 2 * 16 + 4 * 16                 # q, k (2 heads of 16) and v (4 heads of 16)
    states = 3 * (b * conv_dim * 4 * 2 + b * 4 * 16 * 16 * 4)
    kv = dict(est.stages)["decode"].kv_cache - states
    per_token = 2 * b * 2 * 16 * 2                       # keys and values, 2 kv heads of 16, bf16, one layer
    assert kv % per_token == 0 and kv >= per_token * 101, kv


def test_the_chunked_function_saves_what_fla_saves():
    """ChunkGatedDeltaRuleFunction keeps the l2-normalised q and k with their fp32 rstd, v (its contiguous copy),
    the chunk-local cumulative gate in fp32, beta and A (b, s, value heads, 64); input_guard copies a non-contiguous
    input, as transformers hands it the conv output's slices."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer import kernels_gdn

    b, s, h, hv, k = 2, 100, 2, 4, 16
    with FakeTensorMode():
        bf = dict(dtype=torch.bfloat16)
        mixed = torch.empty(b, s, 2 * h * k + hv * k, requires_grad=True, **bf)
        q, kk, v = torch.split(mixed, [h * k, h * k, hv * k], dim=-1)
        q, kk, v = q.reshape(b, s, h, k), kk.reshape(b, s, h, k), v.reshape(b, s, hv, k)
        g = torch.empty(b, s, hv, dtype=torch.float32)
        beta = torch.empty(b, s, hv, **bf)
        o, final = kernels_gdn.chunk_gated_delta_rule(q, kk, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        saved = [t for t in o.grad_fn.saved_tensors if t is not None]
        shapes = [(tuple(t.shape), t.dtype) for t in saved]
        assert shapes == [((b, s, h, k), torch.bfloat16), ((b, s, h), torch.float32)] * 2 + [
            ((b, s, hv, k), torch.bfloat16), ((b, s, hv), torch.float32), ((b, s, hv), torch.bfloat16),
            ((b, s, hv), torch.bfloat16), ((b, s, hv, 64), torch.bfloat16)]
        assert saved[4].is_contiguous() and saved[4].untyped_storage() is not mixed.untyped_storage()
        assert o.shape == (b, s, hv, k) and final is None
        o.sum().backward()
        assert mixed.grad.shape == mixed.shape


@pytest.mark.slow
@pytest.mark.parametrize("name, method, recipe, checkpointing", [
    ("qwen3_next", "full", "pure", "full"),
    ("qwen3_5_text", "lora", "amp", "none"),
    ("qwen3_5_text", "full", "mixed", "selective"),
])
def test_training_knobs_equal_the_full_depth_trace(name, method, recipe, checkpointing):
    _check(name, Workload(mode="train", method=method, recipe=recipe, checkpointing=checkpointing,
                          attention="sdpa"), ((2, 100), (3, 64), (1, 700)))


def test_kda_training_equals_the_full_depth_trace():
    """Kimi-Linear (KDA layers: a gate per key channel, MLA attention, MoE) on fla's chunk_kda, trained."""
    from tracer import kernels_kda

    before = kernels_kda.chunk_calls()
    _check("kimi_linear", Workload(mode="train", attention="sdpa"), ((2, 100),))
    assert kernels_kda.chunk_calls() > before      # the KDA kernel ran (derivations and traces alike)


@pytest.mark.slow
def test_kda_inference_equals_the_full_depth_trace():
    """Kimi-Linear's prefill on chunk_kda and decoding on fused_recurrent_kda."""
    _check("kimi_linear", Workload(mode="infer", gen_tokens=3, attention="sdpa"), ((1, 700),))
