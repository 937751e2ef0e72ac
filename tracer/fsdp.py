"""FSDP2 on the traced model, as the strategies run it: `fully_shard` per decoder layer, then (with torchtitan's
units, `Parallel.fsdp_wrap`) the embedding and the final norm with the head, then the root, in a fake world
(torch's fake process group: collectives do nothing); TP and CP meshes first where the layout has them
(docs/parallel.md).

    with fsdp_model(config, workload, parallel, layers) as (model, cp_mesh):
        ...   # model on the meta device; `model.to_empty(device="cpu")` under fake mode gives the shards storage
"""
from __future__ import annotations

import contextlib

import torch

from estimator.spec import Parallel, Workload
from tracer import compiled, cp, recipes, runner, tp


@contextlib.contextmanager
def fsdp_model(config: dict, workload: Workload, parallel: Parallel, layers: list[int] | None = None,
                rank: int = 0):
    """(the model on the meta device, fully_shard-ed per decoder layer (with torchtitan's units the embedding and the
    final norm with the head too: `torchtitan_units`) and at the root, in a fake world as `rank`; with context
    parallelism the cp mesh too, else None)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; FSDP tracing needs its own fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=parallel.gpus)
    try:
        model = runner.build_model(config, workload, device="meta", layers=layers)
        reshard = parallel.strategy != "fsdp-grad-op"
        mp = {"mp_policy": recipes.mp_policy(workload)} if workload.recipe == "fsdp-mp" else {}
        cp_mesh = None
        if parallel.cp > 1:   # torchtitan: FSDP2 over dp_shard x cp, the step inside context_parallel on cp
            mp["mesh"], cp_mesh, tp_mesh = cp.world_mesh(parallel)
            if tp_mesh is not None:   # TP on the innermost dimension first, as below
                tp.parallelize(model, tp_mesh, workload.mode == "train", parallel.sequence_parallel)
        elif parallel.tp_size > 1 or parallel.strategy == "hsdp":
            mesh, dp_mesh = tp.world_mesh(parallel)   # torchtitan's ParallelDims (dp_replicate, dp_shard, tp)
            if parallel.tp_size > 1:  # torchtitan: TP on the inner mesh dimension first, then fully_shard over dp
                tp.parallelize(model, mesh["tp"], workload.mode == "train", parallel.sequence_parallel)
            mp["mesh"] = dp_mesh
        for layer in decoder_layers(model):
            fully_shard(layer, reshard_after_forward=reshard, **mp)
        if parallel.fsdp_wrap == "torchtitan":
            torchtitan_units(model, reshard, mp)
        fully_shard(model, reshard_after_forward=reshard, **mp)
        if workload.compile:   # torchtitan compiles each block and the loss; FSDP2's hooks stay outside the graphs
            compiled.compile_units(model, decoder_layers(model))
        yield model, cp_mesh
    finally:
        dist.destroy_process_group()
        if parallel.cp > 1 and parallel.tp_size > 1:
            tp.forget_meshes()   # CP ranks live on other TP groups ([2, 3] after [0, 1]): tracer.tp.forget_meshes


def unsharded(model) -> list[torch.Tensor]:
    """FSDP2's unsharded parameters live in each FSDPParam's all_gather_outputs (fsdp/_fully_shard/_fsdp_param.py)."""
    out = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        if group is not None:
            for fsdp_param in group.fsdp_params:
                out.extend(fsdp_param.all_gather_outputs)
    return out


FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm")


def torchtitan_units(model, reshard: bool, mp: dict) -> None:
    """torchtitan's apply_fsdp beyond the blocks (torchtitan/models/llama3/infra/parallelize.py): the token embedding
    a unit of its own, resharded after forward as the blocks are; the final norm and the output head one unit that
    stays gathered after forward (its `reshard_after_forward_policy` "default": backward needs them at once). A tied
    head shares the embedding's weight, and a parameter belongs to one unit: then the embedding, the norm and the
    head are one unit, kept gathered. The root (fully_shard(model), after this) holds what is left."""
    from torch.distributed.fsdp import fully_shard

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    stack = decoder_layers(model)[0]
    parent = next((m for m in model.modules() if any(c is stack for c in m.children())), None)
    owner = next((m for m in model.modules() if parent is not None and any(c is parent for c in m.children())), None)
    norm = next((getattr(owner, n) for n in FINAL_NORMS if owner is not None and isinstance(getattr(owner, n, None),
                                                                                          torch.nn.Module)), None)
    tail = [m for m in (norm, head) if m is not None]
    if head is not None and emb is not None and head.weight is emb.weight:
        fully_shard([emb, *tail], reshard_after_forward=False, **mp)
        return
    if emb is not None:
        fully_shard(emb, reshard_after_forward=reshard, **mp)
    if tail:
        fully_shard(tail, reshard_after_forward=False, **mp)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' GradientCheckpointingLayer modules, in module order): FSDP's units."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"model_type: {model.config.model_type!r} has no decoder layers FSDP can wrap")
    return layers
