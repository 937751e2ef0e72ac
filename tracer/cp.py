"""Context parallelism on one rank, as torchtitan applies it, to a transformers model in a fake world.

    with cp_world(Parallel("fsdp", gpus=8, cp=4), rank=0) as (fsdp_mesh, cp_mesh): ...

torchtitan (torchtitan/distributed/parallel_dims.py, torchtitan/distributed/context_parallel.py) splits the world
into (dp_shard, cp) and shards the parameters with FSDP2 over their product, its "fsdp" mesh (fsdp = dp_shard * cp);
each training step runs inside torch's `context_parallel` on the "cp" mesh (torch/distributed/tensor/experimental/
_context_parallel/_attention.py), given the step's sequence buffers (input ids, labels, positions: dimension 1):

- at entry, each buffer is cut into 2 x cp chunks along the sequence and this rank keeps chunks r and 2cp - 1 - r
  (the head-tail load balancer, `_HeadTailLoadBalancer`), written back into the buffer in place (`resize_` then
  `copy_`: the buffer keeps its storage, so a rank holds the whole sequence's ids as before);
- `F.scaled_dot_product_attention` is replaced: q, k and v become DTensors sharded on the sequence, and the flash
  (or memory-efficient) op's DTensor handler runs ring attention on the local shards (`_templated_ring_attention`
  forward, `_templated_ring_attention_backward`), all-gathering each call's K and V once (the default rotate method,
  `_AllGatherRotater`).

Positions are passed as a buffer too, so each rank's rotary embedding reads its own chunks' positions (torchtitan
shards its rotary cache the same way); transformers would otherwise number the local tokens from 0 (same memory,
wrong values). Ring attention is causal self-attention without a mask: eager attention, a padding mask or inference
are not context-parallel (`check`).

The traced rank r is cp rank r of the first data-parallel shard, TP rank 0 (the fake world is laid out (dp_shard,
cp, tp), tp innermost, as torchtitan's mesh is; with TP, torchtitan's apply_tp on the tp dimension first, as
tracer.tp does, and the loss inside loss_parallel). FSDP2's shards are the same size on every rank (it pads dim 0 to a multiple of
the group), so the ranks differ only in what ring attention holds: docs/parallel.md, "Context parallelism".
"""
from __future__ import annotations

import contextlib

import torch

from estimator import cp as estimator_cp
from estimator.spec import Parallel, Workload


def check(workload: Workload, parallel: Parallel, kernels: str = "cuda", sizes: bool = True,
          causal: bool = True) -> None:
    """One line naming the field where a context-parallel rank cannot be traced as torchtitan runs it (`sizes`:
    the workload's seq too; `causal`: the model is a causal LM): estimator.cp.check, and CUDA's kernels."""
    estimator_cp.check(workload, parallel, sizes, causal)
    if parallel.cp > 1 and kernels != "cuda":
        raise ValueError("kernels: a context-parallel rank is traced with CUDA's kernels only (ring attention runs "
                         "the flash or memory-efficient op)")


def world_mesh(parallel: Parallel):
    """(fsdp mesh, cp mesh, tp mesh or None) of torchtitan's ParallelDims over the fake world: (dp_shard, cp[, tp]),
    outermost first, FSDP2 on the flattened (dp_shard, cp)."""
    from torch.distributed.device_mesh import init_device_mesh

    tp = parallel.tp_size
    dp_shard = parallel.gpus // (parallel.cp * tp)
    dims, names = (dp_shard, parallel.cp, tp), ("dp_shard", "cp", "tp")
    mesh = init_device_mesh("cpu", dims if tp > 1 else dims[:2], mesh_dim_names=names if tp > 1 else names[:2])
    return mesh["dp_shard", "cp"]._flatten("dp_shard_cp"), mesh["cp"], (mesh["tp"] if tp > 1 else None)


def fake_rank(parallel: Parallel, cp_rank: int) -> int:
    """The world rank of CP rank `cp_rank` in the first data-parallel shard, TP rank 0 (mesh (dp_shard, cp, tp))."""
    return cp_rank * parallel.tp_size


def with_positions(inputs: dict) -> dict:
    """The step's inputs with position ids (batch, seq) of their own, a buffer context_parallel shards."""
    ids = inputs["input_ids"]
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1).contiguous()
    return {**inputs, "position_ids": pos}


def step_context(cp_mesh, inputs: dict, outer=None):
    """A context factory around the training steps: torch's context_parallel over the sequence buffers of `inputs`
    (each sharded in place once, at entry, and left sharded: torchtitan's `no_restore_buffers`), inside `outer()`
    where given (TP: loss_parallel, as torchtitan's train context nests them)."""
    from torch.distributed.tensor.experimental import context_parallel

    buffers = list(dict.fromkeys(inputs[k] for k in ("input_ids", "labels", "position_ids") if k in inputs))

    @contextlib.contextmanager
    def both():
        with contextlib.ExitStack() as stack:
            if outer is not None:
                stack.enter_context(outer())
            stack.enter_context(context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                 no_restore_buffers=set(buffers)))
            yield
    return both
