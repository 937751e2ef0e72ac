"""CUDA's autocast op lists, applied to CPU autocast (registered by `kernels.emulate("cuda")`).

torch.autocast casts an op's inputs in a kernel on the Autocast<device> dispatch key, above autograd, so what the
op saves for backward is in the cast dtype. The lists differ by device (aten/src/ATen/autocast_mode.cpp: the
TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m) block at line 181 and AutocastCPU at line 335 of the installed 2.13
build, as `torch._C._dispatch_dump(op)` reports). CUDA's lists are the macros of the installed header
include/ATen/autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE,
AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE, lines 820-957), copied below; the policies are that
header's WrapFunction_ specialisations (lines 460-585): cast every eligible tensor (floating point, not fp64,
on the device) to the lower precision / to fp32, set an unset dtype argument to fp32, append fp32 as dtype, or
cast to the widest floating dtype among the inputs. Each wrapper runs the op with the autocast key excluded.

On the CPU these lists are replaced: CUDA's fp32 / set-dtype / append-dtype / promote ops and CUDA-only
lower-precision ops get a Python kernel on AutocastCPU with CUDA's policy; ops only the CPU lists get a
pass-through kernel (CUDA does not autocast them); the lower-precision ops both lists share (linear, matmul, mm,
bmm, addmm, baddbmm, addbmm, convolutions, prelu, linalg_vecdot, scaled_dot_product_attention) keep the CPU's C++
kernel, whose policy is the same and whose weight-cast cache (autocast_mode.cpp `cached_cast`) is the one CUDA
uses. CUDA-only lower-precision ops (einsum, mv, addmv, addr, chain_matmul, linalg_multi_dot, RNN cells,
convolution) cast here without that cache, which Python cannot reach: a cast fp32 weight lives as long as what
saves it rather than to the autocast exit. No model in data/models runs them.
"""
from __future__ import annotations

import functools

import torch

LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
# Registered on AutocastCUDA outside the macros: binary_cross_entropy raises ("unsafe to autocast"); the cuDNN
# convolutions are CUDA-only ops.
CUDA_SPECIAL = ("binary_cross_entropy", "cudnn_convolution", "cudnn_convolution_transpose")
BCE_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast; use "
               "binary_cross_entropy_with_logits (CUDA's autocast refuses it, autocast_mode.cpp)")

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def cuda_table() -> dict[str, str]:
    """op name ("name" or "name.overload") -> CUDA's cast policy."""
    table = dict.fromkeys(LOWER_PRECISION_FP, "lower_precision_fp")
    table |= dict.fromkeys(FP32, "fp32") | dict.fromkeys(FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype")
    table |= dict.fromkeys(FP32_APPEND_DTYPE, "fp32_append_dtype") | dict.fromkeys(PROMOTE, "promote")
    return table


def registered(key: str) -> set[str]:
    """aten ops with a kernel on dispatch key `key` ("AutocastCPU", "AutocastCUDA"), as "name[.overload]"."""
    return {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _eligible(t) -> bool:
    """autocast_mode.h is_eligible / is_autocast_eligible for the device autocast runs on (here the CPU)."""
    return isinstance(t, torch.Tensor) and t.is_cpu and t.is_floating_point() and t.dtype != torch.float64


def _cast(x, dtype):
    """cached_cast without the cache: eligible tensors (also inside lists) to `dtype`, anything else as is."""
    if _eligible(x):
        return x if x.dtype == dtype else x.to(dtype)
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
        return type(x)(_cast(t, dtype) for t in x)
    return x


def _promote_type(args, kwargs) -> torch.dtype:
    """autocast_mode.h promote_type / prioritize: fp32 if any eligible input is fp32, else the lower precision."""
    lower = torch.get_autocast_dtype("cpu")
    current = lower
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if _eligible(t) and t.dtype == torch.float32:
                current = torch.float32
            elif _eligible(t) and t.dtype != lower:
                raise RuntimeError(f"Unexpected floating ScalarType {t.dtype} in at::autocast::prioritize")
    return current


def _kernel(name: str, policy: str):
    op = _overload(name)
    if policy == "lower_precision_fp":
        def run(args, kwargs):
            lower = torch.get_autocast_dtype("cpu")
            return op(*(_cast(a, lower) for a in args), **{k: _cast(v, lower) for k, v in kwargs.items()})
    elif policy == "fp32":
        def run(args, kwargs):
            return op(*(_cast(a, torch.float32) for a in args),
                      **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
    elif policy == "fp32_set_opt_dtype":
        index = [a.name for a in op._schema.arguments].index("dtype")

        def run(args, kwargs):
            if _eligible(args[0]):
                if len(args) > index:
                    if args[index] is None:
                        args = (*args[:index], torch.float32, *args[index + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    elif policy == "fp32_append_dtype":
        target = _overload(FP32_APPEND_DTYPE[name])

        def run(args, kwargs):
            out_type = torch.float32 if _eligible(args[0]) else args[0].dtype
            return target(*args, **kwargs, dtype=out_type)
    elif policy == "promote":
        def run(args, kwargs):
            to = _promote_type(args, kwargs)
            return op(*(_cast(a, to) for a in args), **{k: _cast(v, to) for k, v in kwargs.items()})
    elif policy == "refuse":
        def run(args, kwargs):
            raise RuntimeError(BCE_MESSAGE)
    else:
        raise ValueError(f"policy: {policy!r} is not an autocast cast policy")

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return run(args, kwargs)

    return kernel


@functools.lru_cache(maxsize=1)
def cpu_ops() -> frozenset[str]:
    """The CPU's own autocast list (read once, before any registration of ours)."""
    return frozenset(registered("AutocastCPU"))


def register(lib) -> dict[str, str]:
    """Put CUDA's policies on AutocastCPU through `lib` (a torch.library.Library("aten", "IMPL")); returns
    {op: policy} for every op given a kernel ("none": a fallthrough, as CUDA's autocast has for unlisted ops)."""
    table = cuda_table()
    cpu = cpu_ops()
    done = {}
    for name in sorted(set(table) | cpu):
        policy = table.get(name, "refuse" if name == "binary_cross_entropy" else "none")
        if policy == "lower_precision_fp" and name in cpu:
            continue  # the CPU's own C++ kernel already casts it to the lower precision, with the weight cache
        if policy == "none":  # autocast_mode.cpp: TORCH_LIBRARY_IMPL(_, AutocastCUDA, m) makeFallthrough()
            lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        else:
            lib.impl(name, _kernel(name, policy), "AutocastCPU")
        done[name] = policy
    return done
