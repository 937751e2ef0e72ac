"""Which kernels a trace on fake CPU tensors runs: the CPU's own, or what a CUDA GPU runs.

    with kernels.emulate("cuda"):     # the default everywhere (session.run_traced, profile derivation)
        ...build and run the model on fake CPU tensors...

The traced tier runs fake CPU tensors (fake CUDA tensors abort once autograd runs on this CPU-only torch build).
Where the CPU kernel keeps other tensors than the CUDA kernel, a plain CPU trace is not what a GPU keeps.
`emulate("cpu")` changes nothing: the model runs exactly as a plain training loop on fake CPU tensors runs it
(scripts/plain_loop.py checks that to the byte against torch's MemTracker). `emulate("cuda")` makes the trace
keep what CUDA keeps, each override following the CUDA source named in its docstring:

- scaled_dot_product_attention: CUDA's backend choice and the chosen CUDA aten op (`kernels_sdpa`);
- dropout: CUDA's fused `native_dropout`, which keeps a 1-byte mask (`_dropout`);
- autocast: CUDA's op lists on the AutocastCPU dispatch key (`kernels_autocast`);
- LayerNorm statistics: fp32 mean/rstd, as the CUDA kernel allocates them (`_layer_norm_stats`);
- transformers' packed-sequence detection, which fake tensors cannot answer (`_unpacked_sequences`);
- hybrid and state-space layers: mamba_ssm's (Mamba-2 and Mamba-1 mixers), flash-linear-attention's (Gated DeltaNet,
  KDA) and causal_conv1d's kernels instead of transformers' torch references (`kernels_ssm`, which installs
  `kernels_ssd`, `kernels_gdn`, `kernels_kda` and `kernels_mamba1`), and RWKV's WKV kernel (`kernels_wkv`).

Every override is a dispatcher registration (torch.library, removed on exit) or a fake-kernel swap, so a traced
op pays Python only where an override applies. docs/activations.md ("CPU and CUDA kernels") lists what each one
changes, in bytes, and what remains different.

PyTorch sources cited here are of the installed build (2.13.0; `torch._C._dispatch_dump(op)` names the file and
line each kernel is registered at) or, for .cpp/.cu files the wheel does not ship, the pytorch/pytorch file at the
commit named in the docstring (the stored snapshot nearest 2.13).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from tracer import kernels_autocast, kernels_sdpa, kernels_ssm

KINDS = ("cuda", "cpu")
# The overrides of "cuda", by name (emulate's `skip` leaves some out to measure what each one changes).
OVERRIDES = ("sdpa", "dropout", "autocast", "layer_norm", "packed_sequences", "ssm")
_ACTIVE: list[str] = []   # kinds entered, innermost last (emulate is re-entrant)


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kernels: {kind!r} is not allowed; choose one of {', '.join(KINDS)}")


def note(kind: str) -> str:
    """The row note saying which kernels the trace ran."""
    check_kind(kind)
    if kind == "cpu":
        return ("kernels cpu: the CPU's own kernels, as a plain training loop on fake CPU tensors runs them "
                "(labels are the input ids tensor itself)")
    return ("kernels cuda: CUDA's SDPA backend choice (flash / memory-efficient / math) and its aten ops, 1-byte "
            "native_dropout masks, CUDA's autocast op lists, fp32 LayerNorm statistics, transformers' "
            "packed-sequence check answered as on real tensors, and hybrid / state-space layers on mamba_ssm's, "
            "flash-linear-attention's and causal_conv1d's kernels")


@contextlib.contextmanager
def emulate(kind: str = "cuda", *, skip: tuple[str, ...] = ()):
    """Run the enclosed code with `kind`'s kernels (see the module docstring). Re-entrant (an inner emulate of
    the kind already active changes nothing). `skip` leaves out some of the cuda overrides (OVERRIDES), only to
    measure what each one changes (scripts/kernel_diffs.py)."""
    check_kind(kind)
    bad = [s for s in skip if s not in OVERRIDES]
    if bad:
        raise ValueError(f"skip: {bad[0]!r} is not an override; choose from {', '.join(OVERRIDES)}")
    if kind == "cpu" or (_ACTIVE and _ACTIVE[-1] == kind):
        _ACTIVE.append(kind)
        try:
            yield
        finally:
            _ACTIVE.pop()
        return

    lib = torch.library.Library("aten", "IMPL")  # every registration below is undone by lib._destroy()
    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": the AutocastCPU lists are replaced on purpose.
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            if "sdpa" not in skip:
                lib.impl("scaled_dot_product_attention", kernels_sdpa.scaled_dot_product_attention, "AutogradCPU")
            if "dropout" not in skip:
                lib.impl("dropout", _dropout, "AutogradCPU")
            if "autocast" not in skip:
                kernels_autocast.register(lib)
        _ACTIVE.append(kind)
        with contextlib.ExitStack() as stack:
            if "layer_norm" not in skip:
                stack.enter_context(_layer_norm_stats())
            if "packed_sequences" not in skip:
                stack.enter_context(_unpacked_sequences())
            if "ssm" not in skip:
                stack.enter_context(kernels_ssm.cuda_mixers())
            yield
    finally:
        if _ACTIVE and _ACTIVE[-1] == kind:
            _ACTIVE.pop()
        lib._destroy()


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """aten::dropout as CUDA runs it: the fused native_dropout, which keeps a bool (1-byte) mask for backward.

    aten/src/ATen/native/Dropout.cpp `dropout()`: `if (train && is_fused_kernel_acceptable(input, p)) return
    std::get<0>(at::native_dropout(input, p, train));` where is_fused_kernel_acceptable is `(input.is_cuda() ||
    ...) && p > 0 && p < 1 && input.sym_numel() > 0`; otherwise `_dropout_impl`, which returns the input itself when
    p == 0, !train or numel == 0, and input * 0 when p == 1. The CUDA kernel (aten/src/ATen/native/cuda/Dropout.cu,
    `dropout_cuda`: `Tensor mask = at::empty_like(self, self.options().dtype(c10::CppTypeToScalarType<bool>::value))`)
    returns (output, bool mask), and derivatives.yaml saves the mask (`native_dropout_backward(grad, result1,
    ...)`). On a CPU tensor the same `dropout()` takes `_dropout_impl`: a noise tensor in the input's dtype
    (empty_like + bernoulli_ + div_), saved by the multiply: 2 bytes per element in bf16 instead of 1.
    """
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)


@contextlib.contextmanager
def _layer_norm_stats():
    """native_layer_norm with fp32 mean and rstd for half-precision input, as the CUDA kernel allocates them.

    aten/src/ATen/native/cuda/layer_norm_kernel.cu `layer_norm_cuda`: `auto acc_type =
    at::toAccumulateType(input.scalar_type(), /*is_cuda=*/true); Tensor mean = at::empty({M},
    X->options().dtype(acc_type)); Tensor rstd = ...` (fp32 for fp16/bf16 input), viewed to the stat shape;
    autograd saves both. The fake kernel of this op (torch/_refs/__init__.py `native_layer_norm`, registered as
    the FakeTensor implementation) casts them back to the input dtype when the device is "cpu", as the CPU kernel
    does: 2 + 2 bytes per row instead of 4 + 4. The fake implementation is swapped for the duration.
    """
    from torch._refs import native_layer_norm as ref
    from torch._subclasses import fake_impls

    op = torch.ops.aten.native_layer_norm.default
    original = fake_impls.op_implementations_dict.get(op)

    def cuda_stats(fake_mode, func, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        out, mean, rstd = ref(input, normalized_shape, weight, bias, eps)
        acc = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
        return out, mean.to(acc), rstd.to(acc)

    _evict_fake_cache(op)  # FakeTensorMode caches outputs per op and input metadata, across instances
    fake_impls.op_implementations_dict[op] = cuda_stats
    try:
        yield
    finally:
        if original is None:
            fake_impls.op_implementations_dict.pop(op, None)
        else:
            fake_impls.op_implementations_dict[op] = original
        _evict_fake_cache(op)


def _evict_fake_cache(op) -> None:
    """Drop FakeTensorMode's cached outputs of `op` (torch/_subclasses/fake_tensor.py: the class-level dispatch
    cache is keyed by the op first), so a swapped fake implementation is not bypassed by an earlier result."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for key in [k for k in FakeTensorMode.cache if k.key and k.key[0] is op]:
        del FakeTensorMode.cache[key]


@contextlib.contextmanager
def _unpacked_sequences():
    """Answer transformers' packed-sequence check as a real run of these inputs does: one sequence per row.

    Without an attention mask, transformers reads position_ids to detect packed sequences
    (transformers/masking_utils.py, find_packed_sequence_indices: the diff of the positions, cumsum, then
    `if not is_tracing(packed_sequence_mask) and (packed_sequence_mask[:, -1] == 0).all(): return None`). A fake
    tensor counts as tracing, so the check assumes packing and builds a (batch, 1, seq, seq) mask, which also turns
    off SDPA's is_causal path and repeats K/V to every query head. The runner passes no position_ids; the model
    makes them with arange, on which a real run's check returns None. The check's own tensors are still made here,
    as on a GPU. This is a fake-tensor artefact, not a kernel: `emulate("cpu")` leaves it, as the plain loop has it.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def one_sequence_per_row(position_ids):
        from torch._subclasses.functional_tensor import FunctionalTensor

        if isinstance(position_ids, FunctionalTensor):
            # AOTAutograd tracing (tracer.compiled): the check's `.all()` is data-dependent control flow
            # there; the runner's inputs are one sequence per row (a collator's attention mask would skip the
            # check altogether), so the compiled step is traced without the packed mask, as the eager one.
            return
        mask = original(position_ids)           # what a real run computes, as fake tensors
        if mask is not None:
            (mask[:, -1] == 0).all()            # the real run reads this; on arange positions it is True
        return

    masking_utils.find_packed_sequence_indices = one_sequence_per_row
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
