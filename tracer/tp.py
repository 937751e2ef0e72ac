"""Tensor parallelism on one rank, as torchtitan applies it, to a transformers model in a fake world.

    with tp_model(config, workload, Parallel("tp", gpus=4)) as model: ...   # rank 0 of 4, parameters on meta

torchtitan (torchtitan/models/llama3/infra/parallelize.py `apply_tp`, before its move to sharding configs in
2026-02) parallelises a Llama with `torch.distributed.tensor.parallel.parallelize_module` on a 1-D "tp" mesh:

- the token embedding `RowwiseParallel(input_layouts=Replicate())`: its vocabulary rows sharded over tp
  (torch's RowwiseParallel on an nn.Embedding shards the weight's dim 0 and all-reduces the masked lookups);
- in every block q/k/v and the MLP's w1/w3 `ColwiseParallel()`, wo and w2 `RowwiseParallel()`: the heads and
  the MLP's columns sharded, the block's output all-reduced (here the names come from the model's own
  `config.base_model_tp_plan`, transformers' declaration of the same split: q/k/v_proj, gate/up_proj colwise,
  o_proj and down_proj rowwise);
- the output head `ColwiseParallel(input_layouts=Replicate())`: its vocabulary rows sharded; training keeps the
  logits sharded (`output_layouts=Shard(-1), use_local_output=False`) and computes the loss inside
  `loss_parallel()` (torchtitan's default: `disable_loss_parallel=False`); inference gathers them
  (`output_layouts=Replicate()`, transformers' "colwise_gather_output").
- Without sequence parallelism the norms are replicated: torchtitan's sharding configs say "norms stay
  Replicate" (torchtitan/models/llama3/sharding.py). Their weights are made replicated DTensors here
  (`ReplicateParallel`), as `SequenceParallel._replicate_module_fn` does, so that one optimizer (foreach) sees
  DTensors only: torch refuses a foreach op over a mix of DTensor and plain tensors.

The model is built on the meta device, parallelised, and materialised by the caller with `to_empty` inside
FakeTensorMode (DTensor's documented meta-device init); every rank holds the same shard sizes when tp divides
the heads, the KV heads, the MLP width and the vocabulary (checked: `check_divisible`), so rank 0 stands for all.
"""
from __future__ import annotations

import contextlib
from fnmatch import fnmatch

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from estimator.parallel import shard_group, tp_untraced
from estimator.spec import Parallel, Workload
from tracer import runner

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


class ReplicateParallel(ParallelStyle):
    """A module whose parameters every TP rank holds whole (a norm without sequence parallelism): its parameters
    become replicated DTensors, its input a replicated DTensor built from the local tensor, its output the local
    tensor again (torch's `SequenceParallel` with `Replicate()` in place of `Shard(1)`)."""

    @staticmethod
    def _replicate(name, module, mesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                module.register_parameter(p_name, torch.nn.Parameter(
                    DTensor.from_local(param, mesh, [Replicate()], run_check=False), requires_grad=param.requires_grad))

    @staticmethod
    def _input(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    @staticmethod
    def _output(mod, outputs, mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, self._replicate, self._input, self._output)


class GatherSequence(ParallelStyle):
    """torchtitan's `PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))` on a block's
    attention and MLP (an all-gather of the sequence-sharded input), for a module that takes `hidden_states` first
    or by name (transformers calls its attention with hidden_states=..., its MLP positionally)."""

    @staticmethod
    def _gather(x, mesh):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return x.redistribute(placements=[Replicate()])

    def _apply(self, module, device_mesh):
        def hook(mod, args, kwargs):
            if args:
                return (self._gather(args[0], device_mesh), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": self._gather(kwargs["hidden_states"], device_mesh)}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def check(workload: Workload, parallel: Parallel) -> None:
    """One line naming the field for what traced TP does not run (estimator.parallel.tp_untraced: the analytic
    split still estimates it)."""
    why = tp_untraced(workload, parallel)
    if why:
        raise ValueError(why)


def check_divisible(model: torch.nn.Module, tp: int) -> None:
    """Every sharded dimension must split evenly over tp, or ranks would differ (DTensor's uneven shards)."""
    for name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            if isinstance(p, DTensor) and any(isinstance(pl, Shard) and p.shape[pl.dim] % tp for pl in p.placements):
                raise ValueError(f"tp: {tp} does not divide {name}.{p_name} {tuple(p.shape)}; ranks would hold "
                                 "different shards")


def plan(model: torch.nn.Module, train: bool, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The module-name -> style plan of `apply_tp` (module docstring) on this transformers model; with
    `sequence_parallel`, `sequence_parallel_plan` on top."""
    base_name = model.base_model_prefix
    base = getattr(model, base_name, None)
    declared = getattr(model.config, "base_model_tp_plan", None) or {}
    if base is None or not declared:
        raise ValueError(f"tp: {model.config.model_type} declares no base_model_tp_plan in transformers; traced TP "
                         "needs it")
    out: dict[str, ParallelStyle] = {}
    for pattern, style in declared.items():
        if style not in STYLES:
            raise ValueError(f"tp: {model.config.model_type}'s tp plan uses {style!r} for {pattern}; traced TP "
                             f"runs {', '.join(STYLES)}")
        out[f"{base_name}.{pattern}"] = STYLES[style]()
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {m: n for n, m in model.named_modules()}
    if emb is not None:  # a pipeline stage after the first holds no embedding (tracer.pp)
        out[names[emb]] = RowwiseParallel(input_layouts=Replicate())
    if head is not None:
        out[names[head]] = (ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
                            if train else ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if sequence_parallel:
        out.update(sequence_parallel_plan(model, out, names[emb] if emb is not None else None,
                                          names[head] if head is not None else None))
    return out


def sequence_parallel_plan(model: torch.nn.Module, tp_plan: dict, emb: str | None, head: str | None) -> dict:
    """torchtitan's sequence parallelism (apply_tp): the residual stream between blocks sharded on the sequence
    (Shard(1)): the embedding's output, every RowwiseParallel output (o_proj, down_proj: a reduce-scatter), the
    norms `SequenceParallel()`, the attention and MLP inputs all-gathered back (`PrepareModuleInput`, Shard(1) ->
    Replicate()), the head's input Shard(1). One change for transformers: the sharded stream stays a DTensor
    (use_local_output=False) where torchtitan takes local tensors, because transformers sizes the positions and the
    causal mask from the embedding output's shape (LlamaModel.forward), which must be the whole sequence's."""
    out: dict[str, ParallelStyle] = {}
    if emb is not None:   # a later pipeline stage's input arrives sequence-sharded (tracer.pp.StageModule)
        out[emb] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    if head is not None:
        out[head] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    for name, style in tp_plan.items():
        if isinstance(style, RowwiseParallel) and name != emb:
            out[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    parents = {n.rsplit(".", 1)[0] for n, st in tp_plan.items() if n not in (emb, head)}
    for name, mod in model.named_modules():
        if any(fnmatch(name, p) for p in parents):   # the attention (hidden_states=...), the MLP (it first)
            out[name] = GatherSequence()
        elif "norm" in type(mod).__name__.lower() and not any(fnmatch(name, p + ".*") for p in parents):
            out[name] = SequenceParallel()   # a block's norms and the final one (not q/k norms inside attention)
    return out


def parallelize(model: torch.nn.Module, mesh, train: bool, sequence_parallel: bool = False) -> None:
    """Apply `plan`, re-tie a tied head to the embedding's shard (both shard the vocabulary rows), then replicate
    every module still holding plain parameters (the norms without sequence parallelism)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and emb is not None and head.weight is emb.weight
    parallelize_module(model, mesh, plan(model, train, sequence_parallel))
    if tied:
        head.weight = emb.weight
    for mod in model.modules():
        if any(not isinstance(p, DTensor) for p in mod.parameters(recurse=False)):
            ReplicateParallel()._apply(mod, mesh)
    check_divisible(model, mesh.size())


def world_mesh(parallel: Parallel, pp: int = 1, dp: int | None = None):
    """(mesh, dp mesh) of torchtitan's ParallelDims over the fake world: (pp,) dp, tp, outermost first; HSDP splits
    dp into (dp_replicate, dp_shard), and fully_shard on that 2-D dp mesh shards the parameters over dp_shard and
    replicates them over dp_replicate. The pipeline dimension is left out where pp is 1 (fsdp.fsdp_model); `dp`:
    the data-parallel size (default the layout's: a pipeline without FSDP has none)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp_n = parallel.dp_size if dp is None else dp, parallel.tp_size
    lead, names = ((pp,), ("pp",)) if pp > 1 else ((), ())
    if parallel.strategy == "hsdp":
        shard = shard_group(parallel)
        mesh = init_device_mesh("cpu", (*lead, dp // shard, shard, tp_n),
                                mesh_dim_names=(*names, "dp_replicate", "dp_shard", "tp"))
        return mesh, mesh["dp_replicate", "dp_shard"]
    mesh = init_device_mesh("cpu", (*lead, dp, tp_n), mesh_dim_names=(*names, "dp", "tp"))
    return mesh, mesh["dp"]


@contextlib.contextmanager
def tp_model(config: dict, workload: Workload, parallel: Parallel, layers: list[int] | None = None):
    """The model on the meta device, tensor-parallel over a fake world of tp ranks (this one rank 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check(workload, parallel)
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; TP tracing needs its own fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=parallel.gpus)
    try:
        mesh = init_device_mesh("cpu", (parallel.tp_size,), mesh_dim_names=("tp",))
        model = runner.build_model(config, workload, device="meta", layers=layers)
        parallelize(model, mesh, workload.mode == "train", parallel.sequence_parallel)
        yield model
    finally:
        dist.destroy_process_group()


def forget_meshes() -> None:
    """Drop DTensor's cached sharding decisions when a pipeline's fake world ends (tracer.pp). They are keyed by
    DTensorSpecs whose meshes compare by layout, not by process group, so the next world's equal-looking mesh (the tp
    group of another pipeline rank, [2, 3] after [0, 1]) would get output specs holding the destroyed world's mesh,
    and its first collective would fail to find that group. Only the pipeline path needs it (every other layout
    traces rank 0), and only it clears them: a cleared cache makes the next world propagate shardings again on
    global-shape fake tensors, which StorageCounter leaves out but FSDPMemTracker counts (`--check` runs two FSDP
    worlds back to back and must see the same)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()   # the Python cache and the C++ dispatch's fast-path cache


def loss_context(workload: Workload):
    """torchtitan's loss_parallel around a training forward and backward (the logits stay vocabulary-sharded)."""
    if workload.mode != "train":
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


__all__ = ["ReplicateParallel", "check", "check_divisible", "forget_meshes", "loss_context", "parallelize", "plan",
           "tp_model"]
