"""The recipe knobs of torchtune, torchtitan, litgpt and Liger, executed as their sources do (see docs/recipes.md).

`tracer.runner` calls four functions here and nothing else:

- ``check(workload, parallel)``: one line for a combination the frameworks do not run (from session.check_traceable)
- ``prepare(model, workload)``: torchao float8 training and torchtitan's per-op selective checkpointing (op-sac),
  applied to a built model before any sharding
- ``optimizer(params, make, workload)``: torchtune's optimizer-in-backward, or None for the usual optimizer
- ``forward(model, workload, inputs)``: one training forward with the workload's loss (tracer.losses) under
  torchtune's activation offloading (tracer.offload), or AOTAutograd-compiled (tracer.compiled);
  returns an object with ``.loss``

The FSDP2 mixed-precision policy of recipe 'fsdp-mp' is ``mp_policy`` (used by fsdp.fsdp_model).
"""
from __future__ import annotations

import contextlib

import torch

from estimator.parallel import compile_untraced
from estimator.spec import Parallel, Workload
from estimator.parallel import TRACED_SHARDING
from tracer import compiled, losses
from tracer.losses import causal_lm, head_and_body
from tracer.offload import offloading
from tracer.meta import DTYPES, is_masked_lm, is_vision_model

FSDP_STRATEGIES = TRACED_SHARDING  # FSDP2 fully_shard runs for each (estimator.parallel)


def check(w: Workload, p: Parallel) -> None:
    """Raise ValueError (one line naming the field) for a knob combination that cannot be traced as the source runs."""

    if w.recipe == "fsdp-mp" and p.strategy not in FSDP_STRATEGIES:
        raise ValueError(f"recipe: fsdp-mp is FSDP2's MixedPrecisionPolicy; it needs strategy fsdp, zero3 or "
                         f"fsdp-grad-op, not {p.strategy!r}")
    why = compile_untraced(w, p)
    if why:
        raise ValueError(why)
    if w.mode != "train":
        return
    if w.optimizer_in_backward and w.recipe == "mixed":
        raise ValueError("optimizer_in_backward: recipe 'mixed' steps fp32 master weights after backward; "
                         "torchtune's optimizer_in_bwd steps the model's own parameters (use pure, amp or fsdp-mp)")
    if w.optimizer_in_backward and p.strategy == "ddp":
        raise ValueError("optimizer_in_backward: ddp averages gradients in its buckets after the hooks would have "
                         "stepped; torchtune runs it on one GPU or FSDP")
    if w.loss == "fused-linear" and w.loop == "keep-output":
        raise ValueError("loop: keep-output keeps the logits, which loss='fused-linear' never materialises; "
                         "use loop='loss-only'")
    if w.float8 and w.recipe == "mixed":
        raise ValueError("float8: torchao float8 training keeps the model's bf16 (or fp32) weights; recipe 'mixed' "
                         "is not a torchtitan recipe (use pure or fsdp-mp)")
    if w.activation_offload and w.checkpointing == "selective":
        raise ValueError("activation_offload: torchtune offloads with full checkpointing or none; the Megatron-style "
                         "'selective' attention recompute is not a torchtune setting (use none, full or op-sac)")


def check_model(model: torch.nn.Module, w: Workload) -> None:
    """Refusals that need the built model."""

    if is_vision_model(model) and w.mode == "train":
        for name, on in (("loss", w.loss != "full"), ("activation_offload", w.activation_offload),
                         ("compile", w.compile)):
            if on:
                raise ValueError(f"{name}: not traced for vision encoders ({model.config.model_type}); their "
                                 "classification head is one small Linear, the step traced is the plain one")
    if w.mode == "train" and w.loss != "full":
        if is_masked_lm(model):
            raise ValueError(f"loss: {w.loss!r} chunks a causal LM's output head; {model.config.model_type} is a "
                             "masked LM (use loss='full')")
        head_and_body(causal_lm(model))


# ------------------------------------------------------------------------------------------------- model

def prepare(model: torch.nn.Module, w: Workload) -> torch.nn.Module:
    """float8 then op-sac, in torchtitan's order (parallelize_llama: float8 conversion, then AC, then FSDP)."""
    if w.mode != "train":
        return model
    check_model(model, w)
    if w.float8:
        convert_float8(model)
    if w.checkpointing == "op-sac":
        enable_op_sac(model)
    return model


def convert_float8(model: torch.nn.Module) -> None:
    """torchao ``convert_to_float8_training`` with the default (tensorwise, dynamic) Float8LinearConfig on the
    decoder layers' Linears whose dimensions are multiples of 16, the output head left in high precision
    (torchtitan components/quantization/float8.py ``Float8LinearConverter`` + utils.py ``module_filter_fn``,
    filter_fqns ["output"] in its llama configs). torchtitan's current default recipe is 'rowwise'; both save the
    same high-precision input and weight for backward (torchao/float8/float8_linear.py
    ``matmul_with_hp_or_float8_args.forward``: ``ctx.save_for_backward(input_hp, weight_hp_t)``)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ValueError("float8: needs torchao (pip install -r requirements.txt)") from None

    head = causal_lm(model).get_output_embeddings()

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        if module is head or not isinstance(module, torch.nn.Linear):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=keep)


def op_sac_save_ops() -> set:
    """torchtitan's default save set (torchtitan/distributed/activation_checkpoint.py ``_get_default_save_ops``):
    the partitioner's compute-intensive ops, the SDPA variants, aten.max (float8 amax), linear, topk and the
    reduce-scatter / all-to-all collectives. CPU SDPA runs ``_scaled_dot_product_flash_attention_for_cpu`` where a
    GPU runs ``_scaled_dot_product_flash_attention`` (in the compute-intensive list): it stands in for it here."""
    from torch._functorch.partitioners import get_default_op_list

    aten = torch.ops.aten
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
            aten._scaled_dot_product_fused_attention_overrideable.default, aten.max.default, aten.linear.default,
            aten.topk.default, torch._higher_order_ops.flex_attention,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    return ops


def op_sac_policy(save_ops: set, recompute_shapes: set):
    """A fresh policy per checkpointed call: SelectiveAC._wrap_block's ``_get_custom_policy`` (save the save-set
    ops' outputs, except every second mm/linear, counted separately in forward and recompute; router-shaped mms
    are always recomputed)."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    mm_ops = (aten.mm.default, aten.linear.default)
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func in mm_ops:
            shape = args[1].shape
            if func == aten.linear.default:
                shape = torch.Size((shape[1], shape[0]))
            if shape in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            meta[key] += 1
        if func in save_ops:
            if func in mm_ops and meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _router_shapes(model: torch.nn.Module) -> set:
    """(in, out) of MoE router Linears: torchtitan forces them to recompute (force_recompute_mm_shapes_by_fqns
    ["moe.router.gate"]); in transformers the router is the Linear named ``gate`` of an MoE block."""
    return {torch.Size((m.in_features, m.out_features)) for n, m in model.named_modules()
            if (n == "gate" or n.endswith(".gate")) and isinstance(m, torch.nn.Linear)}


def enable_op_sac(model: torch.nn.Module) -> None:
    """Checkpoint every decoder layer (transformers GradientCheckpointingLayer) with torchtitan's per-op policy:
    non-reentrant ``torch.utils.checkpoint`` with ``context_fn=create_selective_checkpoint_contexts(policy)`` and
    ``early_stop=False``, as ``ptd_checkpoint_wrapper`` calls it for SelectiveAC."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    save_ops, shapes = op_sac_save_ops(), _router_shapes(model)
    model_type = model.config.model_type

    def contexts():
        fwd, recompute = create_selective_checkpoint_contexts(op_sac_policy(save_ops, shapes))
        return fwd, _refusing(recompute, model_type)

    kwargs = {"use_reentrant": False, "early_stop": False, "preserve_rng_state": True, "context_fn": contexts}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@contextlib.contextmanager
def _refusing(recompute_context, model_type: str):
    """The recompute context, with torch's refusal of a model whose saved output is mutated in place later in the
    layer (torch/utils/checkpoint.py, _CachedTorchDispatchMode) turned into one line naming the field."""
    try:
        with recompute_context:
            yield
    except RuntimeError as e:
        if "selective activation checkpoint" not in str(e):
            raise
        raise ValueError(f"checkpointing: torch's selective checkpointing refuses {model_type} under op-sac: "
                         f"{str(e).splitlines()[0]}") from None


def mp_policy(w: Workload):
    """recipe 'fsdp-mp': FSDP2 ``MixedPrecisionPolicy(param_dtype=<precision>, reduce_dtype=float32)`` over fp32
    parameters (torchtitan's defaults: mixed_precision_param bfloat16, mixed_precision_reduce float32;
    torchtitan/distributed/utils.py / parallelize ``apply_fsdp``); None for every other recipe."""
    if w.recipe != "fsdp-mp":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy


    return MixedPrecisionPolicy(param_dtype=DTYPES[w.precision], reduce_dtype=torch.float32)


# ------------------------------------------------------------------------------------------------- optimizer

class OptimizerInBackward:
    """torchtune's ``OptimizerInBackward`` (torchtune/modules/optim.py): one optimizer per parameter, stepped and
    zeroed in the parameter's post-accumulate-grad hook, so a gradient lives from its accumulation to its step.
    step() is a no-op, as in torchtune. `observe(track)` lets a counter classify each gradient and state while it
    is alive (they die inside backward, before any stage boundary)."""

    def __init__(self, params: list[torch.Tensor], make):
        self._optimizers = {}
        self._track = None
        for p in params:
            if p.requires_grad:
                self._optimizers[p] = make([p])
                p.register_post_accumulate_grad_hook(self._step_and_clear)

    def observe(self, track) -> None:
        self._track = track

    def _step_and_clear(self, param) -> None:
        opt = self._optimizers[param]
        if self._track is not None:
            self._track([param.grad], "gradients")
        opt.step()
        if self._track is not None:
            self._track([v for v in opt.state[param].values() if isinstance(v, torch.Tensor)], "optimizer_states")
        opt.zero_grad()

    @property
    def state(self) -> dict:
        return {p: opt.state[p] for p, opt in self._optimizers.items() if p in opt.state}

    def step(self, closure=None) -> None:
        if closure is not None:
            raise RuntimeError("OptimizerInBackward does not support closures.")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self._optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)


def optimizer(params: list[torch.Tensor], make, w: Workload):
    """OptimizerInBackward for optimizer_in_backward, else None (the runner builds its usual optimizer)."""
    return OptimizerInBackward(params, make) if w.optimizer_in_backward else None


# ------------------------------------------------------------------------------------------------- forward

def forward(model: torch.nn.Module, w: Workload, inputs: dict):
    """One training forward with the workload's loss, under activation offloading when asked; `.loss` is the loss."""

    if w.loss == "chunked":
        patch = losses.lm_forward(model, losses.chunked_forward(w.loss_chunks))
    elif w.loss == "fused-linear":
        patch = losses.lm_forward(model, losses.fused_linear_forward())
    else:
        patch = contextlib.nullcontext()
    if w.activation_offload:

        offload = offloading(model, losses.head_and_body(losses.causal_lm(model))[1])
    else:
        offload = contextlib.nullcontext()
    if w.compile and not getattr(model, "_willitfit_units_compiled", False):   # one graph (one GPU), else per unit
        return losses.LossOutput(compiled.forward(model, inputs))
    try:
        with patch, offload:
            # use_cache=False: otherwise HF builds a DynamicCache that training never reads (a vision encoder has none)
            return model(**inputs) if is_vision_model(model) else model(**inputs, use_cache=False)
    except AssertionError as e:  # OffloadActivations' own check, as torchtune raises it
        raise ValueError(f"activation_offload: torchtune's OffloadActivations stops on "
                         f"{model.config.model_type}: {e} (the model saves tensors its backward never reads)") from None

