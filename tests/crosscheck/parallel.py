"""Per-GPU share of the model states under each parallel strategy.

Sources:
- ZeRO stages (Rajbhandari et al. 2020, arXiv 1910.02054, Fig. 1): stage 1 shards optimizer states (and the
  fp32 master), stage 2 also gradients, stage 3 also parameters, each over the data-parallel group. DeepSpeed's
  own `estimate_zero3_model_states_mem_needs` adds the largest layer's gathered params + grads
  (`largest_layer_memory = 4 * largest_layer_params`), which is `working_set_bytes` here.
- FSDP2 `fully_shard` = ZeRO-3 per layer with one layer prefetched (torch.distributed.fsdp); SHARD_GRAD_OP =
  ZeRO-2; HYBRID_SHARD (HSDP) shards within a group and replicates across groups.
- DDP (torch.nn.parallel.DistributedDataParallel): every rank holds everything, plus gradient buckets that
  copy every gradient unless `gradient_as_bucket_view=True` (PyTorch DDP docs: "the saved memory size will be
  equal to the total gradients size").
- Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053): attention heads, MLP columns and the
  vocabulary split over tp; norms replicated. Pipeline parallelism (1F1B, Narayanan et al. 2021): a stage holds
  L/pp layers; the first holds the embedding, the last the head. Expert parallelism shards routed experts over ep.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from crosscheck.model import ModelSpec
from estimator.spec import Parallel

SHARD_STATES = ("zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp")
SHARD_GRADS = ("zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp")
SHARD_PARAMS = ("zero3", "fsdp", "hsdp")


@dataclass(frozen=True)
class Share:
    """Fractions of the full model's parameters whose weights / grads / optimizer states live on one GPU."""

    stage: str            # 'first' or 'last' pipeline stage ('only' without PP)
    params_local: int     # parameters of this GPU's model slice before ZeRO/FSDP sharding
    layers_local: int     # transformer layers on this GPU
    weight_frac: float    # of params_local
    grad_frac: float
    state_frac: float
    largest_layer_params: int  # for the ZeRO-3/FSDP gathered working set


def shard_group(par: Parallel) -> int:
    """Size of the group ZeRO/FSDP shards over."""
    if par.strategy == "hsdp":
        return par.hsdp_shard or max(1, par.gpus // 2)
    return par.dp_size


def _layer_params_local(ls, tp: int, ep: int) -> int:
    total = ls.norm_params
    for lin in ls.linears:
        p = lin.params
        if lin.role == "expert":
            p //= ep
        if lin.role != "router":
            p //= tp
        total += p
    return total


def shares(model: ModelSpec, par: Parallel) -> list[Share]:
    """One Share per distinct pipeline stage that could hold the peak (first and last; one without PP)."""
    return list(_shares(model, par))


@lru_cache(maxsize=4096)  # per (frozen model, frozen parallel): estimate() and the searches ask repeatedly
def _shares(model: ModelSpec, par: Parallel) -> tuple[Share, ...]:
    tp, pp, ep = par.tp_size, par.pp_size, par.ep_size
    per_layer = [(_layer_params_local(ls, tp, ep), n) for n, ls in model.layer_groups]
    largest = max(p for p, _ in per_layer)
    avg_layer = sum(p * n for p, n in per_layer) / model.layers
    layers_local = -(-model.layers // pp)
    body = int(avg_layer * layers_local)
    g = shard_group(par)
    s = par.strategy
    frac_w = 1 / g if s in SHARD_PARAMS else 1.0
    frac_g = 1 / g if s in SHARD_GRADS else 1.0
    frac_s = 1 / g if s in SHARD_STATES else 1.0
    embed = model.embed_params // tp
    head = model.head_params // tp
    if pp == 1:
        stages = [("only", embed + body + head)]
    else:
        stages = [("first", embed + body), ("last", body + head)]
    return tuple(Share(name, p, layers_local, frac_w, frac_g, frac_s, largest) for name, p in stages)
