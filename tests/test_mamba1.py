"""Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba), priced as a GPU runs them: mamba_ssm's selective scan and fused
mamba_inner_fn with causal_conv1d (tracer.kernels_mamba1), whose chunk states x are (b, d, ceil(s / 2048), 2 x state):
a profile fit in q = 2048 * ceil(s / 2048) on seqs that span chunks (1024-3072), checked at sizes on either side of a
chunk boundary.

The tiny configs (tests/data/tiny/t-mamba.json, t-falcon_mamba.json: 3 layers of width 64, expand 2, state 16;
t-jamba.json: 4 layers, attention at layer 2, MoE every other layer) build in a second.

    WILLITFIT_SLOW=1 python -m pytest tests/test_mamba1.py -q -p no:cacheprovider
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator.spec import Workload
from tracecheck import check_tiny

TINY = Path(__file__).parent / "data" / "tiny"


def _check(name: str, w: Workload, sizes) -> list:
    from tracer import kernels_mamba1

    return check_tiny(name, w, sizes, kernels_mamba1.scan_calls, "Mamba-1 mixers on mamba_ssm's selective scan")


def test_training_on_the_fused_kernel_equals_the_full_depth_trace():
    """Mamba, full fine-tuning: mamba_inner_fn ran in every layer (3, two steps); exact below and past 2048."""
    runs = _check("mamba", Workload(mode="train", attention="eager"), ((2, 100), (1, 3000)))
    assert [calls for _, calls in runs] == [6, 6]


def test_jamba_inference_keeps_conv_and_ssm_states():
    """Jamba prefill on the selective scan, decoding on selective_state_update: exact past a chunk boundary."""
    (est, calls), = _check("jamba", Workload(mode="infer", gen_tokens=3, attention="sdpa"), ((1, 3000),))
    assert calls == 3          # three Mamba layers, one prefill each


def test_the_selective_scan_saves_its_chunk_states():
    """SelectiveScanFn keeps u, delta, A, B, C, D, z, delta_bias, the chunk states x (b, d, chunks, 2 x state) in A's
    dtype and the ungated output; a seq of 2049 is two chunks."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer import kernels_mamba1

    b, d, n, s = 2, 32, 4, 2049
    with FakeTensorMode():
        bf = dict(dtype=torch.bfloat16)
        u = torch.empty(b, d, s, requires_grad=True, **bf)
        delta, z = torch.empty(b, d, s, **bf), torch.empty(b, d, s, **bf)
        A = torch.empty(d, n, dtype=torch.float32)
        B, C = torch.empty(b, n, s, **bf), torch.empty(b, n, s, **bf)
        out = kernels_mamba1.selective_scan_fn(u, delta, A, B, C, torch.empty(d), z=z, delta_softplus=True)
        x = out.grad_fn.saved_tensors[8]
        assert x.shape == (b, d, 2, 2 * n) and x.dtype == torch.float32
        assert out.shape == (b, d, s) and out.dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("name, method, recipe, attention, targets", [
    ("falcon_mamba", "full", "amp", "eager", None),     # b, c and dt RMS norms inside mamba_inner_fn
    ("jamba", "lora", "pure", "sdpa", None),            # selective_scan_fn in training, attention and MoE layers
    ("mamba", "lora", "mixed", "eager", ("in_proj", "x_proj")),
])
def test_training_knobs_equal_the_full_depth_trace(name, method, recipe, attention, targets):
    w = Workload(mode="train", method=method, recipe=recipe, attention=attention)
    _check(name, Workload(**{**w.__dict__, "lora_targets": targets}) if targets else w,
           ((2, 100), (2, 3000), (3, 2049)))


def test_layers_that_share_a_block_are_traced_whole():
    """Zamba reuses one attention block in several layers: a model cut to fewer layers still holds it once, so the
    reduced-depth extension would count it per layer (59% off on the default config); such a model is traced whole.
    Layers that share nothing (Jamba) are cut as usual."""
    from tracer.derive import _signatures

    zamba = json.loads((TINY / "t-zamba.json").read_text())
    jamba = json.loads((TINY / "t-jamba.json").read_text())
    assert _signatures(zamba, Workload())[3] and not _signatures(jamba, Workload())[3]


@pytest.mark.slow
def test_zamba_equals_the_full_depth_trace():
    (est, _), = _check("zamba", Workload(mode="train", attention="eager"), ((2, 100),))
    assert est.profile["traced_whole"].startswith("its decoder layers share parameters")
