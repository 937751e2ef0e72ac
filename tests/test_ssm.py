"""State-space and hybrid LMs (Mamba-2 mixers), priced as a GPU runs them: mamba_ssm's chunked scan and
causal_conv1d's kernels (tracer.kernels_ssm), whose chunk tensors are sized by q = chunk * ceil(s / chunk).

The tiny configs (tests/data/tiny/t-mamba2.json, t-bamba.json, t-nemotron_h.json, t-granitemoehybrid.json,
t-falcon_h1.json, t-zamba2.json) have 3-4 layers of width 64,
8 SSM heads of head_dim 16, 2 groups, state 16, conv kernel 4 and a scan chunk of 64. The profile is fit at seqs
near 256, 512, 768 and verified near 1016; the estimate is checked against a full-depth trace at seq 100 (not a
multiple of the chunk, not fitted) and 64.

    WILLITFIT_SLOW=1 python -m pytest tests/test_ssm.py -q -p no:cacheprovider
"""
from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from estimator.evaluate import monomial_matrix
from estimator.profile import poly
from estimator.profile.profile import Moment
from estimator.spec import Workload

TINY = Path(__file__).parent / "data" / "tiny"
B = 2


def _config(name: str) -> dict:
    return json.loads((TINY / f"t-{name}.json").read_text())


def _first(cfg: dict, *keys):
    return next(cfg[k] for k in keys if cfg.get(k))


def _states_bytes(cfg: dict, n_mamba: int, b: int) -> int:
    """Per Mamba layer, transformers' LinearAttentionLayer cache: the conv state (b, conv_dim, conv_kernel) in the
    model's dtype (bf16: 2 bytes) and the SSM state (b, heads, head_dim, state) in fp32 (4 bytes), the dtype of
    mamba_ssm's final_states that it is zeros_like of."""
    heads = _first(cfg, "num_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
    head_dim = _first(cfg, "head_dim") if cfg["model_type"] == "mamba2" else \
        _first(cfg, "mamba_d_head", "mamba_head_dim", "mamba_headdim")
    state = _first(cfg, "state_size", "mamba_d_state", "ssm_state_size")
    groups = _first(cfg, "n_groups", "mamba_n_groups", "mamba_ngroups")
    kernel = cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4
    conv_dim = heads * head_dim + 2 * groups * state
    return n_mamba * (b * conv_dim * kernel * 2 + b * heads * head_dim * state * 4)


def _kv_bytes(cfg: dict, n_attn: int, b: int, s: int) -> int:
    """Keys and values (b, kv_heads, s, head_dim) in bf16 per attention layer."""
    if not n_attn:
        return 0
    head_dim = cfg.get("attention_head_dim") or cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return n_attn * 2 * b * cfg["num_key_value_heads"] * s * head_dim * 2


def test_q_is_s_rounded_up_to_the_chunk():
    q, bq = poly.scan_monomials(64)
    # q = 64 * ceil(s / 64): 128 at s = 100, 64 at s = 64, 64 at s = 1
    assert [poly.s_factor(q, s) for s in (100, 64, 1)] == [128, 64, 64]
    assert poly.monomial_value(bq, (3, 100, 0, Fraction(1))) == 3 * 128
    assert poly.exponents(bq) == (1, 0, 0, 0, 0, 0, 1) and poly.seq_degree(bq) == 1
    assert poly.monomial_name(bq) == "b*q64"
    # the sweep's matrix and the single-point path agree: 5 + 7 b + 11 b q at (2, 100) = 5 + 14 + 2816
    moment = Moment("prefill", "t", (poly.ONE, poly.B, bq), 1, {"activations": (5, 7, 11)})
    assert moment.exact(2, 100)[3] == 2835
    m = monomial_matrix(moment.monomials, np.array([2, 2]), np.array([100, 128]), np.array([0, 0]), 1)
    assert m[:, 0].tolist() == [1, 2, 256] and m[:, 1].tolist() == [1, 2, 256]
    with pytest.raises(ValueError, match="^chunk: "):
        poly.scan_monomials(0)


def test_training_and_the_torch_reference_are_refused_in_one_line():
    from tracer.derive import chunked_scan, derive_profile

    cfg = _config("mamba2")
    assert chunked_scan(cfg) == ("chunk_size", 64) and chunked_scan(_config("bamba")) == ("mamba_chunk_size", 64)
    with pytest.raises(ValueError, match="^mode: mamba2 runs a chunked state-space scan") as e:
        derive_profile(cfg, Workload(method="full", recipe="pure", attention="eager"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^kernels: mamba2 runs a chunked state-space scan"):
        derive_profile(cfg, Workload(mode="infer", attention="eager"), kernels="cpu")


def test_inference_caches_conv_and_ssm_states_on_the_cuda_kernels():
    from bench.trace.cases import trace_case
    from tracer import kernels_ssm

    cfg = _config("mamba2")
    before = kernels_ssm.scan_calls()
    w = Workload(batch=B, seq=100, mode="infer", gen_tokens=2, attention="eager")
    row = trace_case(cfg, "tiny", w)
    # the prefill runs mamba_ssm's chunk scan once per layer (3), each decode step none (selective_state_update)
    assert kernels_ssm.scan_calls() - before == cfg["num_hidden_layers"]
    # the decode step holds the weights, the cache (3 x (2*192*4*2 + 2*8*16*16*4) = 58368 bytes) and its
    # temporaries; the prefill holds more (the chunk tensors, the logits of 100 positions)
    states = _states_bytes(cfg, 3, B)
    assert states == 58368
    assert row["load_peak_alloc_bytes"] + states < row["decode_peak_alloc_bytes"] < row["prefill_peak_alloc_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name, n_mamba, n_attn, attention", [
    ("mamba2", 3, 0, "eager"),
    ("bamba", 3, 1, "sdpa"),               # attention at layer 2
    ("nemotron_h", 2, 1, "sdpa"),          # mamba, mlp, attention, mamba blocks
    ("granitemoehybrid", 3, 1, "sdpa"),    # Granite-4: mamba, attention, mamba, mamba
    ("falcon_h1", 3, 3, "sdpa"),           # attention and a mixer side by side in every layer
    ("zamba2", 4, 1, "sdpa"),              # a mixer in every layer, the shared attention block at layer 2
])
def test_estimate_equals_the_full_depth_trace(name, n_mamba, n_attn, attention):
    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    cfg = _config(name)
    for s in (100, 64):
        w = Workload(batch=B, seq=s, mode="infer", gen_tokens=3, attention=attention)
        est = estimate(from_hf_config(cfg, "tiny"), w)
        row = trace_case(cfg, "tiny", w)
        got = {n: b.tensor_bytes for n, b in est.stages if n in ("load", "prefill", "decode")}
        assert got == {n: row[f"{n}_peak_alloc_bytes"] for n in got}, (s, got)
        assert not est.notes and est.profile["scan"].startswith("Mamba-2 mixers on mamba_ssm's chunk scan")
        # a decoding step holds the whole cache: conv + SSM states of every Mamba layer, and the attention layers'
        # keys and values for at least the s + 1 tokens seen (transformers grows them ahead: 154 token slots
        # at s = 100 on Bamba); the prefill's peak can come before the last layers have written theirs
        # (Falcon-H1: inside the last layer), so it holds at most that
        kv = dict(est.stages)["decode"].kv_cache - _states_bytes(cfg, n_mamba, B)
        per_token = _kv_bytes(cfg, n_attn, B, 1)
        assert kv == 0 if not n_attn else kv % per_token == 0 and kv >= per_token * (s + 1), (s, kv)
        assert dict(est.stages)["prefill"].kv_cache <= _states_bytes(cfg, n_mamba, B) + _kv_bytes(cfg, n_attn, B, s)
