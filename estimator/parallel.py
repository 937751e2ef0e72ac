"""Per-GPU share of the model states under each parallel strategy, read from the model's inventory.

Sources:
- ZeRO stages (Rajbhandari et al. 2020, arXiv 1910.02054, Fig. 1): stage 1 shards optimizer states (and the
  fp32 master), stage 2 also gradients, stage 3 also parameters, each over the data-parallel group.
- FSDP2 `fully_shard` = ZeRO-3 per layer (traced with a fake process group: its profile already holds one rank);
  SHARD_GRAD_OP = ZeRO-2; HYBRID_SHARD (HSDP) shards within a group and replicates across groups.
- DDP: every rank holds everything plus gradient buckets (traced: the profile has them as comm buffers).
- Tensor parallelism (Megatron-LM, arXiv 1909.08053): attention heads, MLP columns and the vocabulary split over
  tp; norms replicated. Activations per layer (Korthikanti et al. 2022, arXiv 2205.05198, Table 2): of the
  34·s·b·h + 5·a·s²·b bytes of a GPT layer, 24·s·b·h and all of the s² term are split over t, 10·s·b·h (the
  LayerNorm and dropout part) is not unless sequence parallelism splits it too.
  Traced instead where a profile of one TP rank is on disk (tracer.tp, `tp_untraced`: strategy tp alone, or FSDP2 x
  TP, with sequence parallelism in training): the estimate then takes that rank's categories as they are.
- Pipeline parallelism (1F1B, Narayanan et al. 2021; GPipe): a stage holds torchtitan's split of the layers
  (`pp_stage_layers`), the first the embedding, the last the head; under 1F1B rank r keeps min(pp - r, micro-batches)
  micro-batches of activations, under GPipe every rank all of them (the analytic rule: the single-GPU step's
  activations scaled by the stage's share of the layers; the first, the last and rank 1 for the middle ones).
  Traced instead where every rank's profile is on disk (tracer.pp, `pp_untraced`: strategy pp over all the GPUs,
  or FSDP2 over each stage's dp ranks; every schedule of PP_SCHEDULES, full fine-tuning): each rank holds
  torchtitan's split of the layers over its stages (`pp_rank_layers`), and the estimate takes each rank's
  categories as they are, the worst rank deciding (`pp_rank_shares`); the zero-bubble schedules have no rule.
- Expert parallelism: the routed experts are sharded over ep.
- Composed (docs/parallel.md): an FSDP-family strategy with tp, pp or ep > 1 shards over the data-parallel group
  dp = gpus / (tp*pp*ep) what TP/PP/EP leave on the rank (torchtitan's order: TP on the innermost mesh dimension,
  `fully_shard` on the dp mesh of each pipeline stage's module): the traced FSDP rank's sharded (1/n) model
  states, evaluated at n = dp, are scaled by the rank's TP slice of its stage over the whole model, divided by
  ep since EP borrows its ranks from the FSDP dimension (`fsdp_frac`), and its gathered (n-free) working set by
  the TP/EP share of a layer (`gathered_frac`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from estimator.inventory import Inventory
from estimator.spec import PP_STAGES_PER_RANK, PP_TRACED_ONLY, PP_V_SCHEDULES, Parallel, Workload

SHARD_STATES = ("zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp")
SHARD_GRADS = ("zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp")
SHARD_PARAMS = ("zero3", "fsdp", "hsdp")
TRACED_SHARDING = ("fsdp", "zero3", "fsdp-grad-op")   # the profile is of one FSDP2 rank already
FSDP_FAMILY = (*TRACED_SHARDING, "hsdp")               # priced from that profile (HSDP: over its shard group)
KORTHIKANTI_SPLIT = 24 / 34                           # share of a layer's s·b·h activations that TP splits


@dataclass(frozen=True)
class Share:
    """Fractions of the full model's parameters whose weights / grads / optimizer states live on one GPU."""

    stage: str            # 'first' or 'last' pipeline stage ('only' without PP)
    params_local: int     # parameters of this GPU's model slice before ZeRO/FSDP sharding
    layers_local: int     # transformer layers on this GPU
    weight_frac: float    # of params_local
    grad_frac: float
    state_frac: float
    largest_layer_params: int  # for a ZeRO-3 gathered working set (estimate.py)
    gathered_frac: float = 1.0  # this GPU's TP/EP share of the largest layer (what FSDP all-gathers per unit)
    fsdp_frac: float = 1.0      # of the model's params, what FSDP shards over dp on this GPU (composed layouts)
    pp_rank: int = 0            # its pipeline rank (stage): how many micro-batches a 1F1B schedule keeps in flight


def shard_group(par: Parallel) -> int:
    """Size of the group ZeRO/FSDP shards over: the data-parallel group (HSDP: its shard group, by default half
    of it, i.e. 2 replicas). With context parallelism FSDP shards over dp_shard x cp, as torchtitan's "fsdp" mesh
    does (torchtitan/distributed/parallel_dims.py: fsdp = dp_shard * cp)."""
    if par.strategy == "hsdp":   # torchtitan: replicated over dp_replicate, sharded over dp_shard x cp
        return (par.hsdp_shard or max(1, par.dp_size // 2)) * par.cp
    return par.dp_size * par.cp


def composed(par: Parallel) -> bool:
    """An FSDP-family strategy on a TP/PP/EP mesh: the traced FSDP rank's model states are scaled to this rank's
    slice (estimator.evaluate.Swap); plain FSDP (tp = pp = ep = 1) is the traced rank as it is."""
    return par.strategy in FSDP_FAMILY and (par.tp_size, par.pp_size, par.ep_size) != (1, 1, 1)


def check_model(inv: Inventory, par: Parallel, name: str = "model") -> None:
    """One line naming the field when `par` cannot split this model: a TP degree must divide the attention heads
    (Megatron: heads % tp == 0) and the KV heads must divide it or be divided by it (vLLM replicates KV heads past
    tp > kv_heads); every pipeline stage needs a layer; EP shards routed experts, which the model must have and
    the degree must divide."""
    tp, pp, ep = par.tp_size, par.pp_size, par.ep_size
    if tp > 1 and inv.heads and (inv.heads % tp or (inv.kv_heads % tp and tp % inv.kv_heads)):
        ok = [n for n in range(2, inv.heads + 1) if inv.heads % n == 0 and (inv.kv_heads % n == 0 or n % inv.kv_heads == 0)]
        raise ValueError(f"tp: {tp} does not divide the {inv.heads} attention heads ({inv.kv_heads} KV heads) of {name}; "
                         f"allowed: {', '.join(map(str, ok)) or 'none'}")
    if pp > 1 and inv.layers and pp > inv.layers:
        raise ValueError(f"pp: {pp} pipeline stages for {inv.layers} layers of {name}; at most {inv.layers}")
    if par.fsdp_wrap == "torchtitan" and any(k in inv.extra for k in ("vision", "vlm", "audio", "seq2seq")):
        raise ValueError(f"fsdp_wrap: torchtitan's units (embedding, blocks, norm and head) are traced for text "
                         f"models; {name} is a vision, multimodal or encoder-decoder model: use fsdp_wrap 'layers'")
    if ep > 1:
        if not inv.n_experts:
            raise ValueError(f"ep: expert parallelism shards routed experts; {name} is not a mixture-of-experts model")
        if inv.n_experts % ep:
            raise ValueError(f"ep: {ep} does not divide the {inv.n_experts} routed experts of {name}")


def shares(inv: Inventory, par: Parallel) -> list[Share]:
    """One Share per distinct pipeline stage that could hold the peak (one without PP). With PP, torchtitan's split
    of the layers (`pp_stage_layers`): the first stage (the embedding), the last (the head), and with 3 or more
    stages rank 1, which stands for the middle ranks: it has the most layers among them (the split gives the extra
    layers to the first ranks) and, under 1F1B, the most micro-batches in flight; it is priced where it holds more
    layers than the first stage (otherwise the first holds more of everything)."""
    return list(_shares(inv, par))


@lru_cache(maxsize=4096)
def _shares(inv: Inventory, par: Parallel) -> tuple[Share, ...]:
    tp, pp, ep = par.tp_size, par.pp_size, par.ep_size
    experts_per_layer = inv.params_by_role.get("expert", 0) / max(1, inv.layers)
    norms = inv.params_by_role.get("norm", 0) / max(1, inv.layers)
    layer = [(p - experts_per_layer - norms) / tp + experts_per_layer / (ep * tp) + norms for p in inv.layer_params]
    largest = int(max(layer, default=0))
    full = max(inv.layer_params, default=0)
    gathered = max(layer, default=0) / full if full else 1.0
    split = [sum(map(len, pp_rank_layers(inv.layers, pp, r, par.pp_schedule))) for r in range(pp)] if pp > 1 \
        else [inv.layers]
    per_layer = sum(layer) / max(1, inv.layers)
    # FSDP on a TP/PP/EP mesh shards the rank's TP slice of its stage; EP borrows its ranks from the FSDP
    # dimension (torchtitan: dp_shard = dp_shard_mod_ep x ep), so that slice is spread over dp x ep ranks
    per_layer_tp = sum((p - norms) / tp + norms for p in inv.layer_params) / max(1, inv.layers)
    g = shard_group(par)
    s = par.strategy
    frac_w = 1 / g if s in SHARD_PARAMS else 1.0
    frac_g = 1 / g if s in SHARD_GRADS else 1.0
    frac_s = 1 / g if s in SHARD_STATES else 1.0
    embed = inv.embedding_params // tp
    head = (inv.params - sum(inv.layer_params) - inv.embedding_params) // tp
    def stage(name: str, r: int, ends: int, ends_tp: int) -> tuple:
        n = split[r]
        return name, r, n, ends + int(per_layer * n), ends + per_layer_tp * n
    if pp == 1:
        stages = [stage("only", 0, embed + head, embed + head)]
    else:
        stages = [stage("first", 0, embed, embed), stage("last", pp - 1, head, head)]
        # rank 1 only where it can exceed the first stage: with no more layers it holds less of everything (no
        # embedding, no more micro-batches in flight), so it cannot decide (and each share costs an evaluation)
        stages += [stage("middle", 1, 0, 0)] if pp >= 3 and split[1] > split[0] else []
    return tuple(Share(name, p, n, frac_w, frac_g, frac_s, largest, gathered, p_tp / ep / inv.params, r)
                 for name, r, n, p, p_tp in stages)


def tp_untraced(w: Workload, p: Parallel) -> str | None:
    """Why one rank of this TP run is not traced per rank (tracer.tp: torchtitan's apply_tp on a fake process group),
    naming the field, or None when it is: strategy 'tp' over all the GPUs, or an FSDP2 strategy (fsdp, zero3,
    fsdp-grad-op) over dp composed with tp > 1 on a (dp, tp) mesh, with sequence parallelism in training; no
    pipeline or expert parallelism or offload; for training full fine-tuning with the full loss (under
    loss_parallel) and none of float8, compile, optimizer-in-backward, activation offload, op-sac or fsdp-mp. The
    rest is the analytic split."""
    if p.tp_size == 1 or p.pp_size > 1 or p.ep_size > 1 or (p.strategy == "tp" and p.tp_size != p.gpus) \
            or p.strategy not in ("tp", *FSDP_FAMILY):
        return ("tp: traced tensor parallelism is strategy 'tp' over all the GPUs, or fsdp / zero3 / fsdp-grad-op / "
                "hsdp composed with tp > 1 (no pp, ep)")
    if p.sequence_parallel and w.mode != "train":
        return "sequence_parallel: traced for training (torchtitan's); inference is traced without it"
    if p.offload != "none":
        return "offload: traced TP keeps everything on the GPU"
    if w.mode == "train" and w.method != "full":
        return f"method: traced TP trains method 'full' (torchtitan), not {w.method!r}"
    if w.mode == "train" and (w.loss != "full" or w.float8 or w.compile or w.optimizer_in_backward
                              or w.activation_offload or w.checkpointing == "op-sac" or w.recipe == "fsdp-mp"):
        return ("loss: traced TP trains with loss 'full' under loss_parallel and no float8, compile, "
                "optimizer-in-backward, activation offload, op-sac or fsdp-mp")
    return None


PP_FIRST_LESS = PP_LAST_LESS = 1          # torchtitan pipeline_parallel_{first,last}_stage_less_layers (defaults)


def pp_stage_layers(n_layers: int, pp: int, stage: int, first_less: int = PP_FIRST_LESS,
                    last_less: int = PP_LAST_LESS) -> range:
    """The decoder layers pipeline stage `stage` of `pp` holds, as torchtitan deals them out
    (torchtitan/distributed/pipeline_parallel.py `_generate_llm_fqn_per_model_part`, the same in its transformers
    backend): the embedding and the final norm + head weigh `first_less` and `last_less` layers, the n_layers + both
    "effective layers" are split evenly, the remainder one each to the first stages. 6 layers on 4 stages: 1, 2, 2,
    1; 32 on 4: 8, 9, 8, 7."""
    if not 0 <= stage < pp:
        raise ValueError(f"pp_rank: pipeline stage {stage} does not exist; allowed 0..{pp - 1}")
    per, extra = divmod(n_layers + first_less + last_less, pp)
    if per == 0 or first_less > per or last_less > per:
        raise ValueError(f"pp: {pp} pipeline stages for {n_layers} layers leave a stage without a layer (torchtitan "
                         f"counts the embedding and the head as one layer each); at most "
                         f"{(n_layers + first_less + last_less) // max(first_less, last_less, 1)} stages")
    start = 0
    for i in range(pp):
        count = per + (1 if i < extra else 0) - (first_less if i == 0 else last_less if i == pp - 1 else 0)
        count = max(0, min(count, n_layers - start))
        if i == stage:
            return range(start, start + count)
        start += count
    raise AssertionError("unreachable")


def pp_rank_layers(n_layers: int, pp: int, rank: int, schedule: str = "1f1b") -> tuple[range, ...]:
    """The decoder layers pipeline rank `rank` holds, one range per stage it runs: one stage (`pp_stage_layers`)
    under a single-stage schedule; under a multi-stage one PP_STAGES_PER_RANK stages of pp x that many
    (`pp_rank_stages`: r, r + pp, ... or ZBV's V), torchtitan's split being over all those stages."""
    v = PP_STAGES_PER_RANK[schedule]
    if not 0 <= rank < pp:
        raise ValueError(f"pp_rank: pipeline rank {rank} does not exist; allowed 0..{pp - 1}")
    return tuple(pp_stage_layers(n_layers, pp * v, i) for i in pp_rank_stages(pp, rank, schedule))


def pp_rank_stages(pp: int, rank: int, schedule: str) -> tuple[int, ...]:
    """The stage indices rank `rank` runs: r, r + pp, ... ("loop": torch's and torchtitan's looped schedules), or for
    ZBV the V r, 2 pp - 1 - r (torch `generate_stage_to_rank_mapping(style="v")`, torchtitan `stage_ids_this_rank`)."""
    v = PP_STAGES_PER_RANK[schedule]
    return (rank, 2 * pp - 1 - rank) if schedule in PP_V_SCHEDULES else tuple(rank + k * pp for k in range(v))


def pp_in_flight(schedule: str, pp: int, rank: int, micro: int, untraced: str | None = None) -> float:
    """Micro-batches of the rank's layers whose activations it holds at once (the analytic rule): 1F1B's rank r runs
    min(pp - r, micro) forwards before its first backward, GPipe every forward first; interleaved 1F1B's rank runs
    `_get_warmup_ops` chunk forwards first ((v - 1) x micro-batches per round + 2 x (pp - 1 - r), at most v x micro)
    and one more before the first backward frees any, each of 1/v of its layers (torch.distributed.pipelining
    schedules.py `_get_warmup_ops`, `ScheduleInterleaved1F1B`). A zero-bubble schedule has no rule: one line, naming
    why its ranks cannot be traced where `untraced` (`pp_untraced`'s reason) says so."""
    if schedule in PP_TRACED_ONLY:
        raise ValueError((f"{untraced}; and {schedule}" if untraced else f"pp_schedule: {schedule}")
                         + " is priced from its traced ranks only (its weight gradients wait for a later step of the "
                           "schedule, which no rule here counts)" + ("" if untraced else "; derive them first"))
    if schedule == "gpipe":
        return float(micro)
    if schedule == "1f1b":
        return float(min(pp - rank, micro))
    v = PP_STAGES_PER_RANK[schedule]
    per_round = micro // max(1, micro // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), micro * v)
    return min(warmup + 1, micro * v) / v


def pp_microbatches(w: Workload, p: Parallel) -> int:
    """Micro-batches per step through the pipeline: Parallel.microbatches, else the workload's grad_accum."""
    return p.microbatches or w.grad_accum


def pp_untraced(w: Workload, p: Parallel) -> str | None:
    """Why the ranks of this pipeline are not traced one by one (tracer.pp: torch.distributed.pipelining on a fake
    process group, torchtitan's split), naming the field, or None when they are: strategy 'pp' over all the GPUs
    (gpus = pp, or pp x tp with tensor parallelism inside each stage), or fsdp / zero3 / fsdp-grad-op over each
    stage's dp ranks (gpus = dp x tp x pp; no ep), 1F1B (with at least pp micro-batches), GPipe or interleaved 1F1B
    (its rounds dividing the micro-batches), training with full fine-tuning and the model's full loss, eager, the
    optimizer stepped after the schedule, no activation offload, recipe pure, mixed or amp; with tp, what traced TP
    runs too (`tp_untraced`'s rules for training)."""
    if p.pp_size < 2 or p.ep_size > 1 or p.strategy not in ("pp", *FSDP_FAMILY) \
            or (p.strategy == "pp" and p.dp_size > 1):
        return ("pp: traced pipelines are strategy 'pp' over all the GPUs (gpus = pp x tp), or fsdp / zero3 / "
                "fsdp-grad-op / hsdp over the dp ranks of each stage (gpus = dp x tp x pp); no ep")
    if p.tp_size > 1 and (w.float8 or w.checkpointing == "op-sac" or p.offload != "none"):
        return ("tp: traced TP inside pipeline stages runs without float8, op-sac and offload (traced TP's rules, "
                "estimator.parallel.tp_untraced)")
    if w.mode != "train":
        return "mode: pipelines are traced in training (torchtitan's pipelines train)"
    if w.method != "full":
        return f"method: traced pipelines train method 'full' (torchtitan), not {w.method!r}"
    if w.loss != "full" or compile_untraced(w, p) or w.optimizer_in_backward or w.activation_offload or \
            w.recipe == "fsdp-mp":
        return ("loss: traced pipelines run the model's full loss, eager or compiled per block without TP, the "
                "optimizer stepped after the schedule, "
                "no activation offload and no fsdp-mp")
    if p.pp_schedule == "dualpipev" and pp_microbatches(w, p) < 2 * p.pp_size:
        return (f"microbatches: DualPipeV needs at least as many micro-batches as stages (torch.distributed.pipelining "
                f"ScheduleDualPipeV: 2 x pp); got {pp_microbatches(w, p)} for pp {p.pp_size}")
    if p.pp_schedule == "1f1b" and pp_microbatches(w, p) < p.pp_size:
        return (f"microbatches: 1F1B needs at least as many micro-batches as stages (torch.distributed.pipelining "
                f"Schedule1F1B); got {pp_microbatches(w, p)} for pp {p.pp_size}")
    m = pp_microbatches(w, p)
    if p.pp_schedule in ("interleaved-1f1b", "interleaved-zb") and m % max(1, m // p.pp_size):
        return (f"microbatches: {p.pp_schedule} runs rounds of micro-batches (max(1, micro-batches // pp) of them) "
                f"and needs their count to divide the micro-batches (torch.distributed.pipelining "
                f"ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble); got {m} for pp {p.pp_size}")
    if p.microbatches and w.grad_accum > 1:
        return ("grad_accum: a traced pipeline step is one schedule step over its micro-batches; give the "
                "micro-batches or grad_accum, not both")
    return None


def pp_traced_parallel(p: Parallel, microbatches: int) -> Parallel:
    """The parallel class whose ranks are traced for this pipeline (`pp_untraced` is None): strategy pp over pp x tp
    GPUs, or the FSDP strategy over each stage's dp ranks at dp 2 (its profile is fit in 1/n; HSDP is FSDP over its
    shard group), with the TP degree and sequence parallelism inside every stage."""
    t = p.tp_size
    common = dict(tp=t, sequence_parallel=p.sequence_parallel and t > 1, pp_schedule=p.pp_schedule,
                  microbatches=microbatches)
    if p.strategy == "pp":
        return Parallel(strategy="pp", gpus=p.pp_size * t, pp=p.pp_size if t > 1 else 1, **common)
    return Parallel(strategy="fsdp" if p.strategy == "hsdp" else p.strategy, gpus=2 * p.pp_size * t, pp=p.pp_size,
                    **common)


def pp_rank_shares(inv: Inventory, par: Parallel) -> tuple[Share, ...]:
    """One Share per pipeline rank, for ranks traced one by one (each profile holds its rank's states and
    activations as they are): its stages' parameters (the embedding with the first stage, the norm and head with the
    last) and layers. Named by the pipeline's ends it holds: 'first', 'last' (ZBV's V gives rank 0 both: 'first and
    last'), or 'middle (rank r)'."""
    pp = par.pp_size
    embed = inv.embedding_params
    head = inv.params - sum(inv.layer_params) - embed
    last_stage = pp * PP_STAGES_PER_RANK[par.pp_schedule] - 1
    out = []
    for r in range(pp):
        held = [i for chunk in pp_rank_layers(inv.layers, pp, r, par.pp_schedule) for i in chunk]
        stages = pp_rank_stages(pp, r, par.pp_schedule)
        first, last = 0 in stages, last_stage in stages
        params = sum(inv.layer_params[i] for i in held) + (embed if first else 0) + (head if last else 0)
        name = " and ".join(n for n, on in (("first", first), ("last", last)) if on) or f"middle (rank {r})"
        largest = max((inv.layer_params[i] for i in held), default=0)
        # under TP a rank holds its slice of the stage (the norms whole: about 1/tp); only a recipe swapped in for
        # the traced one reads this count (the master copy), equal recipes cancel to the byte (evaluate.Swap)
        out.append(Share(name, int(params) // par.tp_size, len(held), 1.0, 1.0, 1.0, int(largest) // par.tp_size,
                         pp_rank=r))
    return tuple(out)


# torch.optim's fused steps DTensor has no sharding strategy for (torch/distributed/tensor/_ops/_pointwise_ops.py,
# torch 2.13, registers the fused Adam and AdamW steps only): FSDP2's and TP's parameters are DTensors
DTENSOR_UNFUSED = ("sgd", "sgd-momentum")


def _unsteppable(w: Workload, p: Parallel) -> bool:
    return w.training and w.optimizer_impl == "fused" and w.optimizer in DTENSOR_UNFUSED and \
        (p.strategy in FSDP_FAMILY or p.tp_size > 1)


def check_optimizer(w: Workload, p: Parallel) -> None:
    """One line where the run itself would fail: torch's fused SGD over DTensor parameters (FSDP2, TP) has no sharding
    strategy (NotImplementedError: aten._fused_sgd_; hypothesis found it, tests/test_exact_random.py)."""
    if _unsteppable(w, p):
        raise ValueError(f"optimizer_impl: torch's fused {w.optimizer} has no DTensor sharding strategy, so it cannot "
                         f"step FSDP2's or TP's parameters (strategy {p.strategy}); use foreach or forloop")


def steppable(w: Workload, p: Parallel) -> Workload:
    """`w` as a run under `p` can step it: a fused SGD step that `check_optimizer` refuses becomes its foreach step
    (what advice and the Multi-GPU page price when they move a run onto FSDP2 or TP, and say so); else `w` itself."""
    return replace(w, optimizer_impl="foreach") if _unsteppable(w, p) else w


def compile_untraced(w: Workload, p: Parallel) -> str | None:
    """Why a compile=True workload is not traced compiled (tracer.compiled runs AOTAutograd's partitioner on
    one GPU's training step with the full loss and no other knob), or None when it is (or compile is off)."""
    if not w.compile:
        return None
    if w.mode != "train":
        return "compile: traced for training only (the partitioner's saved tensors); inference runs eager"
    if p.strategy not in ("single", "ddp", "pp", *FSDP_FAMILY) or p.tp_size > 1 or p.ep_size > 1 or p.cp > 1:
        return (f"compile: traced on one GPU, DDP, an FSDP2 rank or a pipeline rank (torchtitan's per-block graphs), "
                f"not with tp {p.tp_size}, ep {p.ep_size} or cp {p.cp}")
    if (p.strategy in FSDP_FAMILY or p.pp_size > 1) and w.checkpointing in ("none", "full") and \
            (w.loss, w.activation_offload, w.float8) == ("full", False, False):
        return None   # per block (torchtitan, torchtune): a checkpointed block recomputes its compiled forward
    if (w.loss, w.checkpointing, w.activation_offload, w.float8) != ("full", "none", False, False):
        return ("compile: traced with loss='full' and no activation offloading or float8, and without checkpointing "
                "on one GPU or DDP (one graph of the whole step; on an FSDP2 or a traced pipeline rank, each block's, "
                "full checkpointing too)")
    return None


def compile_notes(w: Workload, p: Parallel) -> tuple[str, ...]:
    """What an estimate with compile on assumes: why it is priced as eager, or how it is traced."""
    if not w.compile:
        return ()
    why = compile_untraced(w, p)
    if why:
        return (f"{why}; estimated as eager",)
    unit = "each block and the loss apart (torchtitan, torchtune)" if p.strategy in FSDP_FAMILY or p.pp_size > 1 \
        else "the whole step"
    return (f"compile: traced as AOTAutograd's partitioner saves, {unit}; inductor's fusion inside a graph is not "
            "modelled, so a peak inside forward or backward can read above a compiled run's",)


def tp_activation_scale(tp: int, sequence_parallel: bool) -> tuple[float, float]:
    """(scale of the b·s terms, scale of the b·s² terms) of one GPU's activations under tensor parallelism."""
    if tp == 1:
        return 1.0, 1.0
    if sequence_parallel:
        return 1 / tp, 1 / tp
    return (1 - KORTHIKANTI_SPLIT) + KORTHIKANTI_SPLIT / tp, 1 / tp


def clear_caches() -> None:
    """Forget the memoised results (a cold estimate computes them again)."""
    _shares.cache_clear()
