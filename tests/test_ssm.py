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


def test_the_torch_reference_is_refused_in_one_line():
    from tracer.derive import derive_profile
    from estimator.scans import chunked_scan

    cfg = _config("mamba2")
    assert chunked_scan(cfg) == ("chunk_size", 64) and chunked_scan(_config("bamba")) == ("mamba_chunk_size", 64)
    with pytest.raises(ValueError, match="^kernels: mamba2 runs a chunked state-space scan") as e:
        derive_profile(cfg, Workload(mode="infer", attention="eager"), kernels="cpu")
    assert "\n" not in str(e.value)


def test_the_fused_training_kernel_saves_what_mamba_ssm_saves():
    """MambaSplitConv1dScanCombinedFn keeps, between forward and backward, the in_proj output zxbcdt, the scan output
    out_x (b, s, heads, head_dim), the gated norm's fp32 rstd (groups x b x s) and, under autocast, the bf16 copy of
    the fp32 out_proj weight it casts; its forward's chunk tensors are freed on return."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer import kernels_ssd_fused as kernels_ssd

    b, s, heads, p, groups, n, chunk, hidden = 2, 100, 8, 16, 2, 16, 64, 64
    dim, conv_dim = heads * p, heads * p + 2 * groups * n
    with FakeTensorMode():
        bf = dict(dtype=torch.bfloat16)
        zxbcdt = torch.empty(b, s, dim + conv_dim + heads, requires_grad=True, **bf)
        conv_w, conv_b = torch.empty(conv_dim, 4, **bf), torch.empty(conv_dim, **bf)
        dt_bias, D, norm_w = torch.empty(heads, **bf), torch.empty(heads, **bf), torch.empty(dim, **bf)
        A = torch.empty(heads, dtype=torch.float32)
        for amp, out_w in ((False, torch.empty(hidden, dim, **bf)), (True, torch.empty(hidden, dim))):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = kernels_ssd.mamba_split_conv1d_scan_combined(
                    zxbcdt, conv_w, conv_b, dt_bias, A, D, chunk, rmsnorm_weight=norm_w, outproj_weight=out_w,
                    headdim=p, ngroups=groups, norm_before_gate=False)
                saved = out.grad_fn.saved_tensors
            held = {tuple(t.shape): t.dtype for t in saved if t is not None}
            assert held[(b, s, heads, p)] == torch.bfloat16 and held[(groups * b * s,)] == torch.float32
            assert held[(hidden, dim)] == torch.bfloat16          # the cast copy under autocast, the weight without
            assert out.shape == (b, s, hidden) and out.dtype == torch.bfloat16
            # zxbcdt, conv weight and bias, out_x, A, D, dt_bias, norm weight, rstd, out_proj weight (no initial
            # states, seq_idx or out_proj bias)
            assert sum(t is not None for t in saved) == 10 and saved[0] is zxbcdt


def test_training_equals_the_full_depth_trace():
    """A training step of a hybrid (Nemotron-H: Mamba-2 mixer, MLP, attention, mixer) on mamba_ssm's fused kernel,
    its backward included: the estimate equals a full-depth trace at sizes the fit did not use (100: no multiple of
    the chunk), and says when a GPU would split the backward sums more than the trace did."""
    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config
    from tracer import kernels_ssm

    cfg = _config("nemotron_h")
    for b, s in ((2, 100), (1, 700)):
        w = Workload(batch=b, seq=s, mode="train", method="lora", attention="sdpa")
        est = estimate(from_hf_config(cfg, "tiny"), w)
        before = kernels_ssm.scan_calls()
        row = trace_case(cfg, "tiny", w, steps=2)
        assert kernels_ssm.scan_calls() - before == 2 * 2          # two mixers, two steps: the fused kernel ran
        got = {n: st.tensor_bytes for n, st in est.stages}
        assert got == {n: row[f"{n}_peak_alloc_bytes"] for n in got}, (b, s, got)
        assert "fused mamba_split_conv1d_scan_combined" in est.profile["scan"]
        # 8 heads in 2 groups, 1 or 2 chunks of 64: ceil(b * chunks * 8 / 132) = 1 < 4, so a GPU splits 4 ways
        assert [n for n in est.notes if n.startswith("mamba_ssm: ")] == [
            f"mamba_ssm: at batch {b} x seq {s} a 132-SM GPU splits each Mamba-2 layer's dB, dC and dCB backward "
            f"sums 4 ways (traced with one): up to {3 * 4 * b * max(s * 2 * 16, -(-s // 64) * 2 * 64 * 64):,} B "
            "more for an instant (tracer.kernels_ssd)"]


def test_splits_follow_mamba_ssm():
    from estimator import ssd

    # Nemotron-H 8B's mixer: 128 heads in 8 groups, chunk 128, on 132 SMs: one split from b x chunks = 16 on
    assert [ssd.nsplits(1, s, 128, 8, 128) for s in (2048, 1920, 1024, 128)] == [1, 2, 2, 16]
    assert ssd.split_notes(_config("nemotron_h"), "t", "infer", 1, 64) == ()
    assert ssd.scan_params({"model_type": "llama", "hidden_size": 64}) is None


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


@pytest.mark.slow
@pytest.mark.parametrize("name, attention, method", [
    ("mamba2", "eager", "full"),
    ("bamba", "sdpa", "full"),
    ("granitemoehybrid", "sdpa", "lora"),
    ("falcon_h1", "sdpa", "full"),
    ("zamba2", "sdpa", "lora"),
])
def test_training_estimate_equals_the_full_depth_trace(name, attention, method):
    """The other five families' training steps (full fine-tuning or LoRA, pure bf16; mixed under Granite-4) on the
    fused kernel: every stage's tensor bytes equal a full-depth trace at sizes the fit did not use."""
    from bench.trace.cases import trace_case
    from estimator.estimate import estimate
    from estimator.model import from_hf_config

    cfg = _config(name)
    recipe = "mixed" if name == "granitemoehybrid" else "pure"
    for b, s in ((2, 100), (3, 64), (1, 700)):
        w = Workload(batch=b, seq=s, mode="train", method=method, recipe=recipe, attention=attention)
        est = estimate(from_hf_config(cfg, "tiny"), w)
        row = trace_case(cfg, "tiny", w, steps=2)
        got = {n: st.tensor_bytes for n, st in est.stages}
        assert got == {n: row[f"{n}_peak_alloc_bytes"] for n in got}, (b, s, got)


def test_the_full_size_check_script_lists_its_cases_and_refuses_an_unknown_one():
    import subprocess
    import sys

    script = str(Path(__file__).resolve().parent.parent / "scripts" / "hybrid_check.py")
    listed = subprocess.run([sys.executable, script, "--list"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "mamba2-full-b1-s4000" in listed.stdout.split()
    wrong = subprocess.run([sys.executable, script, "--case", "nope"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "--case: 'nope' is not a case" in wrong.stderr
