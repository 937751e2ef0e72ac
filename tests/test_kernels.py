"""The tracer's kernels: `cpu` is the plain training loop to the byte (torch's MemTracker counts that loop), and
each `cuda` override keeps what CUDA keeps (tracer.kernels).

The full comparison over the shipped presets is scripts/plain_loop.py (docs/activations.md); here a sample:
tiny configs of three families and llama-3.2-1b's real widths (tied 128k-vocab embeddings) cut to two layers.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from estimator.presets import load_config  # noqa: E402
from estimator.spec import Parallel, Workload  # noqa: E402
from tracer import kernels, kernels_autocast, kernels_sdpa  # noqa: E402
from tracer.session import run_traced  # noqa: E402
from scripts.plain_loop import plain_loop_peak, tracer_peak  # noqa: E402

TINY = Path(__file__).parent / "data" / "tiny"
BF16 = torch.bfloat16


def tiny(family: str, **overrides) -> dict:
    return {**json.loads((TINY / f"t-{family}.json").read_text()), **overrides}


# ------------------------------------------------------------------------------------ cpu = the plain loop


@pytest.mark.parametrize("config, batch, seq, loop", [
    (tiny("llama"), 2, 64, "loss-only"),
    (tiny("gpt2"), 2, 64, "loss-only"),          # dropout 0.1 everywhere: the CPU's math SDPA, 2-byte masks
    (tiny("bert"), 2, 64, "keep-output"),        # masked LM
    ({**load_config("llama-3.2-1b")[1], "num_hidden_layers": 2}, 1, 64, "loss-only"),
    ({**load_config("llama-3.2-1b")[1], "num_hidden_layers": 2}, 1, 64, "keep-output"),
], ids=["llama-loss", "gpt2-loss", "bert-keep", "llama3.2-1b-loss", "llama3.2-1b-keep"])
def test_cpu_kernels_equal_the_plain_loop_to_the_byte(config, batch, seq, loop):
    assert tracer_peak(config, "t", batch, seq, loop, "cpu") == plain_loop_peak(config, batch, seq, loop)


def test_keep_output_holds_the_previous_logits_into_the_next_forward():
    """keep-output minus loss-only, at the forward peak of step 2: the previous step's bf16 logits (b, s, V)."""
    cfg = tiny("llama")  # V = 512
    stage = {}
    for loop in ("loss-only", "keep-output"):
        t = run_traced(cfg, Workload(batch=2, seq=64, loop=loop), kernels="cpu")
        stage[loop] = {s.stage: s.peak_bytes for s in t.log.stages}
    # the output also holds the loss (a 4-byte fp32 scalar)
    assert stage["keep-output"]["forward"] - stage["loss-only"]["forward"] == 2 * 64 * 512 * 2 + 4


# ------------------------------------------------------------------------------------ each cuda override


def forward_peaks_over_seq(config: dict, kind: str, seqs=(64, 128, 256)) -> list[int]:
    """The forward stage's peak (the step's activation peak; the overall one is the optimizer step here)."""
    out = []
    for s in seqs:
        stages = run_traced(config, Workload(batch=1, seq=s), kernels=kind).log.stages
        out.append(next(st.peak_bytes for st in stages if st.stage == "forward"))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cuda_sdpa_training_keeps_nothing_quadratic_in_seq(family):
    """Training peak at s, 2s, 4s: linear in s with CUDA's kernels (flash, no packed-sequence mask); not on the
    CPU (Llama: the (b, 1, s, s) packed-sequence mask; GPT-2, attention dropout: the math kernel's s x s)."""
    cfg = tiny(family)
    a, b, c = forward_peaks_over_seq(cfg, "cuda")
    assert c - b == 2 * (b - a)
    a, b, c = forward_peaks_over_seq(cfg, "cpu")
    assert c - b > 2 * (b - a)


def test_cuda_dropout_keeps_a_one_byte_mask():
    def saved(kind):
        with kernels.emulate(kind), FakeTensorMode():
            x = torch.randn(4, 8, dtype=BF16, requires_grad=True)
            y = torch.nn.functional.dropout(x, 0.1, True)
            return {n: getattr(y.grad_fn, n).dtype for n in dir(y.grad_fn)
                    if n.startswith("_saved") and isinstance(getattr(y.grad_fn, n), torch.Tensor)}

    assert saved("cuda") == {"_saved_result1": torch.bool}        # native_dropout's mask, 1 byte per element
    assert saved("cpu") == {"_saved_other": BF16}                 # the CPU's noise tensor in the input dtype


def test_cuda_autocast_runs_cudas_fp32_ops_in_fp32_and_keeps_lower_precision_matmuls():
    def dtypes(kind):
        with kernels.emulate(kind), FakeTensorMode():
            x = torch.randn(4, 8, dtype=BF16, requires_grad=True)
            w = torch.randn(8, requires_grad=True)
            with torch.autocast("cpu", dtype=BF16):
                ln = torch.nn.functional.layer_norm(x, (8,), w, w)
                return (torch.pow(x, 3.0).dtype, torch.softmax(x, -1).dtype, ln.dtype,
                        ln.grad_fn._saved_result1.dtype, torch.mm(x.float(), x.float().T).dtype,
                        torch.cat([x, x.float()]).dtype)

    assert dtypes("cuda") == (torch.float32,) * 4 + (BF16, torch.float32)
    assert dtypes("cpu") == (BF16, BF16, BF16, BF16, BF16, torch.float32)  # and the overrides are gone again


def test_cuda_layer_norm_statistics_are_fp32_without_autocast():
    def stats(kind):
        with kernels.emulate(kind), FakeTensorMode():
            x = torch.randn(4, 8, dtype=BF16, requires_grad=True)
            out = torch.nn.functional.layer_norm(x, (8,))
            return out.grad_fn._saved_result1.dtype, out.grad_fn._saved_result2.dtype

    assert stats("cuda") == (torch.float32, torch.float32)   # layer_norm_kernel.cu: acc_type
    assert stats("cpu") == (BF16, BF16)
    assert stats("cuda") == (torch.float32, torch.float32)   # FakeTensorMode's cache does not bypass the swap


def test_autocast_table_is_the_installed_cuda_registration():
    """The policy table copied from autocast_mode.h names exactly the ops the installed torch registers on
    AutocastCUDA (less the three special kernels), so a torch upgrade that changes the lists fails here."""
    table = set(kernels_autocast.cuda_table())
    assert table == kernels_autocast.registered("AutocastCUDA") - set(kernels_autocast.CUDA_SPECIAL)


@pytest.mark.parametrize("q, k, v, mask, dropout, gqa, expected", [
    ((2, 8, 64, 64), (2, 8, 64, 64), (2, 8, 64, 64), False, 0.1, False, "flash"),      # dropout runs in-kernel
    ((2, 8, 64, 64), (2, 2, 64, 64), (2, 2, 64, 64), False, 0.0, True, "flash"),       # GQA
    ((2, 8, 64, 64), (2, 8, 64, 64), (2, 8, 64, 64), True, 0.0, False, "efficient"),   # a mask: no flash
    ((2, 8, 64, 192), (2, 8, 64, 192), (2, 8, 64, 128), False, 0.0, False, "efficient"),  # MLA head dims
    ((2, 8, 64, 64), (2, 1, 64, 64), (2, 1, 64, 64), False, 0.0, False, "math"),       # MQA without enable_gqa
    ((2, 8, 64, 320), (2, 8, 64, 320), (2, 8, 64, 320), False, 0.0, False, "efficient"),  # head dim > 256
])
def test_sdpa_backend_choice_follows_cudas_checks(q, k, v, mask, dropout, gqa, expected):
    with FakeTensorMode():
        t = [torch.empty(s, dtype=BF16) for s in (q, k, v)]
        m = torch.ones(q[0], 1, q[2], k[2], dtype=torch.bool) if mask else None
        assert kernels_sdpa.select_backend(*t, m, dropout, False, gqa) == expected


def test_sdpa_fp32_gqa_runs_math_and_unaligned_head_dims_pad_for_flash():
    with kernels.emulate("cuda"), FakeTensorMode():
        q = torch.empty(2, 8, 64, 64, requires_grad=True)
        kv = torch.empty(2, 2, 64, 64, requires_grad=True)
        assert kernels_sdpa.select_backend(q, kv, kv, None, 0.0, True, True) == "math"  # fp32: no flash; no GQA
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        assert out.shape == q.shape and out.dtype == torch.float32
        q20 = torch.empty(2, 4, 64, 20, dtype=BF16, requires_grad=True)  # head dim 20: padded to 24, sliced back
        out = torch.nn.functional.scaled_dot_product_attention(q20, q20, q20, is_causal=True)
        assert out.shape == q20.shape
        assert "ScaledDotProductFlashAttention" in out.grad_fn.next_functions[0][0].name()


def test_kernels_name_the_field():
    with pytest.raises(ValueError, match="kernels: 'rocm' is not allowed"):
        with kernels.emulate("rocm"):
            pass
    with pytest.raises(ValueError, match="kernels: "):
        run_traced(tiny("llama"), Workload(batch=1, seq=8), kernels="gpu")


def test_trace_cli_kernels_cpu_row_has_its_own_run_id(tmp_path):
    from bench.trace import cases as trace

    cfg, w = tiny("llama"), Workload(batch=1, seq=8, loop="keep-output")
    cuda, cpu = trace.trace_case(cfg, "t", w), trace.trace_case(cfg, "t", w, kernels="cpu")
    assert (cuda["kernels"], cpu["kernels"]) == ("cuda", "cpu") and cuda["loop"] == "keep-output"
    assert cuda["run_id"] != cpu["run_id"] and cpu["run_id"] == trace.case_run_id(cfg, w, Parallel(), kernels="cpu")
    assert "kernels cpu" in cpu["notes"] and "kernels cuda" in cuda["notes"]
