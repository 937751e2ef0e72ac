"""One traced run: a real HF model on fake CPU tensors, every allocation counted.

    trace = run_traced(config, Workload(batch=4, seq=512), Parallel())   # -> Trace (log, params, notes)

The model is built from its config.json by `tracer.runner` inside FakeTensorMode: tensors carry shapes,
dtypes and storages but no data, so a 70B model traces on a laptop. `tracer.counters.StorageCounter` counts
the bytes of every live storage, per stage and per category. Fake CUDA tensors abort this CPU-only torch
build, so the fake device is "cpu"; what is counted is the same op-level allocation a GPU run asks its
allocator for (`NOTES` says what that leaves out).

Multi-GPU, rank 0 of N is traced with torch's fake process group (collectives do nothing):
- fsdp / zero3 / fsdp-grad-op: FSDP2 `fully_shard` on every decoder layer then the root, built on the meta
  device and materialised with to_empty inside FakeTensorMode. fsdp-grad-op keeps parameters unsharded
  between forward and backward (reshard_after_forward=False, ZeRO-2-like). FSDP2 pads every shard to the
  same size, so all ranks hold the same bytes and rank 0 stands for all.
- tp (and fsdp / zero3 / fsdp-grad-op with tp > 1): torchtitan's apply_tp on the model's own
  base_model_tp_plan (tracer.tp), on a "tp" mesh or, under FSDP2, the inner dimension of a (dp, tp) mesh with
  fully_shard over dp; training runs inside loss_parallel. Rank 0 stands for all (tp divides every sharded dim).
- pp (and fsdp / zero3 / fsdp-grad-op with pp > 1): one pipeline rank, rank r holding stage r, as torchtitan
  splits and schedules a transformers model with torch.distributed.pipelining (tracer.pp; `run_traced(rank=r)`):
  the ranks hold different stages, so each is traced on its own.
- ddp: DDP's C++ Reducer reads tensor data (parameter verification, bucket rebuilding), which fake
  tensors do not have, so DDP itself cannot run. Its one memory effect on a rank is the gradient buckets
  it allocates at construction (torch/csrc/distributed/c10d/reducer.cpp, initialize_buckets; with the
  default gradient_as_bucket_view=False they are separate from .grad); the trace allocates them as one
  flat buffer per dtype, counted as "comm_buffers", on top of the single-GPU run.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from estimator.model import check_context, from_hf_config
from estimator.spec import Parallel, Workload
from estimator.parallel import TRACED_SHARDING, pp_microbatches, shard_group
from tracer import serialized
from tracer import kernels as kernels_mod
from tracer import cp, fsdp, pp, recipes, recompute, runner, time_loop, tp, vlm
from tracer.counters import StageLog, StorageCounter, memtracker_peak_bytes
from tracer.depth import layer_stacks

# FSDP2 fully_shard runs for each (estimator.parallel); HSDP on a 2-D dp mesh (traced, never derived: its profile
# is FSDP's over the shard group, estimator.estimate.traced_class)
FSDP_STRATEGIES = (*TRACED_SHARDING, "hsdp")
TRACED_STRATEGIES = ("single", "ddp", *FSDP_STRATEGIES, "tp", "pp")


def check_learned_positions(config: dict, name: str, workload: Workload) -> None:
    """Fake tensors never check an index, so a run past learned position embeddings would 'trace': refuse it."""

    check_context(from_hf_config(config, name), workload.seq, workload.gen_tokens, allow_beyond=True)


@dataclass
class Trace:
    """What one traced run counted, before it becomes a row."""

    log: StageLog                  # per-stage peaks and breakdowns of the traced rank
    params: int
    trainable_params: int
    notes: list[str] = field(default_factory=list)
    per_rank: dict | None = None
    seconds: float = 0.0
    events: tuple | None = None    # with stream=True: StorageCounter.allocation_events() of the traced rank


def check_traceable(workload: Workload, parallel: Parallel) -> None:
    """Raise ValueError for what the traced tier cannot run (the analytic tier still estimates it)."""
    if parallel.strategy not in TRACED_STRATEGIES:
        raise ValueError(f"strategy: {parallel.strategy!r} is not traced; traced strategies are "
                         f"{', '.join(TRACED_STRATEGIES)}")
    if parallel.pp_size > 1:   # with TP inside the stages too (tracer.pp)
        pp.check(workload, parallel)
    elif parallel.tp_size > 1:
        tp.check(workload, parallel)
    elif parallel.ep_size > 1:
        raise ValueError("ep: expert parallelism is not traced; use ep=1")
    cp.check(workload, parallel, sizes=False)
    if parallel.offload != "none":
        raise ValueError("offload: CPU offload is not traced (every fake tensor is already on the CPU)")
    if workload.kv_dtype != "auto":
        raise ValueError(f"kv_dtype: {workload.kv_dtype!r} is not traced; the traced KV cache has the model's "
                         "dtype (kv_dtype 'auto')")
    if workload.optimizer == "adafactor":
        raise ValueError("optimizer: adafactor reads tensor values (.item() of norms) and cannot run on fake "
                         "tensors; use the analytic estimate or measure it on a GPU")
    if workload.method == "qlora":
        raise ValueError("method: qlora needs bitsandbytes 4-bit weights, which cannot run on fake CPU tensors")
    runner.weight_dtype(workload)  # raises for quantized weight formats
    recipes.check(workload, parallel)


def check_checkable(workload: Workload, parallel: Parallel) -> None:
    """MemTracker hooks every parameter's gradient, so it needs single-GPU full fine-tuning (no frozen
    parameters, no no_grad inference); FSDPMemTracker hooks FSDP itself and takes any FSDP case."""
    if workload.optimizer_in_backward or workload.compile:
        raise ValueError("check: torch's MemTracker tracks one torch optimizer over the module's own parameters; "
                         "trace optimizer_in_backward and compile cases without --check")
    if parallel.strategy in FSDP_STRATEGIES:
        return
    if (workload.mode, workload.method, parallel.strategy) != ("train", "full", "single"):
        raise ValueError("check: torch's MemTracker cross-checks single-GPU full fine-tuning only (it hooks "
                         "every parameter's gradient), and FSDPMemTracker FSDP cases; trace this case "
                         "without --check")


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    # allow_non_fake_inputs: meta tensors (the model before materialising) and Python scalars may meet fake ones
    return FakeTensorMode(allow_non_fake_inputs=True)


@dataclass
class _Case:
    """A built case, alive inside fake mode: what the stages run on, and what to classify up front."""

    model: torch.nn.Module
    optimizer: object
    inputs: dict
    workload: Workload
    roles: list = field(default_factory=list)      # (tensors, category) tracked before the run
    context: object = contextlib.nullcontext       # entered around the steps (TP: torchtitan's loss_parallel)
    notes: list = field(default_factory=list)
    per_rank: dict | None = None
    step: object = None     # one training step's forward and backward, step(on_stage) (a pipeline schedule), or None


@contextlib.contextmanager
def _prepared(config: dict, workload: Workload, parallel: Parallel, layers: list[int] | None = None,
              kernels: str = "cuda", rank: int = 0):
    """Yield the built _Case inside fake mode (and, for FSDP, a fake process group torn down after).
    `layers`: keep only these decoder layers (reduced depth; tracer.depth). `kernels` "cpu" passes the
    input ids themselves as labels, as the plain loop does (scripts/plain_loop.py); "cuda" a clone, as a data
    collator does (transformers DataCollatorForLanguageModeling: labels = input_ids.clone()). `rank`: the traced
    rank, which only a pipeline (rank r holds stage r: tracer.pp) and a context-parallel group (CP rank r of the first
    data-parallel shard: tracer.cp) tell apart; every other layout traces rank 0."""
    clone = kernels == "cuda"
    if rank and parallel.pp_size == 1 and parallel.cp == 1:
        raise ValueError(f"rank: only a pipeline's or a context-parallel group's ranks differ; without pp or cp every "
                         f"rank traces as rank 0, got {rank}")
    if rank >= parallel.gpus:
        raise ValueError(f"rank: {rank} is not a rank of {parallel.gpus} GPUs")
    if parallel.pp_size > 1:
        if kernels != "cuda":
            raise ValueError("kernels: a pipeline rank is traced with CUDA's kernels only")
        with pp.pp_case(config, workload, parallel, rank, layers) as (model, inputs, step):
            n = pp_microbatches(workload, parallel)
            case = _Case(model, runner.make_optimizer(model, workload), inputs, workload, step=step,
                         per_rank={"world_size": parallel.gpus, "traced_rank": rank, "pp": parallel.pp_size,
                                   "pp_schedule": parallel.pp_schedule, "microbatches": n,
                                   **({"tp": parallel.tp_size} if parallel.tp_size > 1 else {})})
            case.notes.append(f"pp rank {rank} of {parallel.pp_size} traced with a fake process group: "
                              f"torch.distributed.pipelining {parallel.pp_schedule}, {n} micro-batches of "
                              f"{workload.batch}, torchtitan's stage split (send and receive move no data)"
                              + (f"; each stage tensor-parallel over tp {parallel.tp_size} (apply_tp"
                                 + (", sequence parallel" if parallel.sequence_parallel else "") + ")"
                                 if parallel.tp_size > 1 else ""))
            yield case
        return
    if parallel.strategy in FSDP_STRATEGIES and parallel.cp > 1:
        cp.check(workload, parallel, kernels)
        with fsdp.fsdp_model(config, workload, parallel, layers, cp.fake_rank(parallel, rank)) as (model, cp_mesh), \
                _fake_mode():
            cp.check(workload, parallel, kernels, causal=not runner.is_masked_lm(model))
            model.to_empty(device="cpu")  # FSDP2's documented meta-device init; shards become fake
            inputs = cp.with_positions(runner.make_inputs(config, workload, "cpu", model, clone_labels=clone))
            case = _Case(model, runner.make_optimizer(model, workload), inputs, workload,
                         per_rank={"world_size": parallel.gpus, "traced_rank": cp.fake_rank(parallel, rank),
                                   "cp": parallel.cp, "cp_rank": rank, "tp": parallel.tp_size},
                         context=cp.step_context(cp_mesh, inputs, (lambda: tp.loss_context(workload))
                                                 if parallel.tp_size > 1 else None))
            case.notes.append(f"cp rank {rank} of {parallel.cp} (fake rank {cp.fake_rank(parallel, rank)} of "
                              f"{parallel.gpus}) traced with a fake process group: torch's context_parallel (ring "
                              f"attention, head-tail load balancing) inside FSDP2 over dp_shard {parallel.dp_size} x "
                              f"cp {parallel.cp}" + (f", TP {parallel.tp_size} inside (apply_tp"
                                                     + (", sequence parallel" if parallel.sequence_parallel else "")
                                                     + ")" if parallel.tp_size > 1 else "")
                              + ", as torchtitan runs it (collectives do nothing)")
            yield case
        return
    if parallel.strategy in FSDP_STRATEGIES:
        with fsdp.fsdp_model(config, workload, parallel, layers) as (model, _), _fake_mode():
            model.to_empty(device="cpu")  # FSDP2's documented meta-device init; shards become fake
            inputs = runner.make_inputs(config, workload, "cpu", model, clone_labels=clone)
            case = _Case(model, runner.make_optimizer(model, workload), inputs, workload,
                         per_rank={"world_size": parallel.gpus, "traced_rank": 0, "tp": parallel.tp_size},
                         context=lambda: (tp.loss_context(workload) if parallel.tp_size > 1
                                          else contextlib.nullcontext()))
            case.notes.append(f"fsdp2 rank 0 of {parallel.gpus} traced with a fake process group "
                              + (f"as HSDP ({parallel.dp_size // shard_group(parallel)} replicas of a "
                                 f"{shard_group(parallel)}-way shard group) " if parallel.strategy == "hsdp" else "")
                              + (f"on a (dp {parallel.dp_size}, tp {parallel.tp_size}) mesh, TP applied first as "
                                 "torchtitan does " if parallel.tp_size > 1 else "") + "(collectives do nothing)")
            yield case
        return
    if parallel.strategy == "tp":
        with tp.tp_model(config, workload, parallel, layers) as model, _fake_mode():
            model.to_empty(device="cpu")  # DTensor's meta-device init, as torchtitan does; shards become fake
            inputs = runner.make_inputs(config, workload, "cpu", model, clone_labels=clone)
            case = _Case(model, runner.make_optimizer(model, workload), inputs, workload,
                         per_rank={"world_size": parallel.gpus, "traced_rank": 0, "tp": parallel.tp_size},
                         context=lambda: tp.loss_context(workload))
            case.notes.append(f"tp rank 0 of {parallel.gpus} traced with a fake process group (torchtitan's "
                              "apply_tp on the model's base_model_tp_plan; collectives do nothing)")
            yield case
        return
    with _fake_mode():
        # Built on meta, then given fake storage by runner._materialize: building under fake mode directly
        # fails in PEFT, whose adapter .to() swaps fake parameters ("Cannot swap ... weakref").
        model = runner.build_model(config, workload, "cpu", meta_then_empty=True, layers=layers)
        inputs = runner.make_inputs(config, workload, "cpu", model, clone_labels=clone)
        case = _Case(model, runner.make_optimizer(model, workload), inputs, workload)
        if parallel.strategy == "ddp":
            case.roles.append((_ddp_buckets(model), "comm_buffers"))
            case.notes.append("ddp: gradient buckets allocated as DDP's Reducer does; DDP itself cannot run "
                              "on fake tensors")
        yield case




def _run(case: _Case, steps: int, observe_layers: bool = False,
         prime: set[str] | None = None, watch_grads: bool = False, saves=None) -> StorageCounter:
    """Count the stages of a built case; roles are (re)assigned at every stage boundary. With
    `observe_layers` the counter also records which decoder layer runs at every tick (`_observe_layers`).
    With `prime` (training: the names of the parameters a step reaches, `grad_names`), the optimizer's states are
    created by one step on zero gradients of those parameters instead of a whole first training step, and
    `steps - 1` steps run: the steady state without the cost of step 1. `watch_grads`: the counter records each
    gradient accumulation (StorageCounter.watch_grads; tracer.replay). `saves` (a tracer.recompute.Saves): the
    counter records what autograd saves and unpacks, and one probe forward runs after the steps (tracer.recompute)."""
    primed = prime if prime is not None and case.workload.mode == "train" and steps > 1 else None
    counter = StorageCounter()
    if observe_layers:
        _observe_layers(case.model, counter)
    counter.track(case.inputs.values(), "other")
    if hasattr(case.optimizer, "observe"):  # optimizer in backward: grads and states die between stage boundaries
        case.optimizer.observe(counter.track)
    for tensors, role in case.roles:
        counter.track(tensors, role)
    live: dict = {}

    def on_stage(stage: str) -> None:
        counter.classify_model(case.model, case.optimizer)
        counter.track(fsdp.unsharded(case.model), "weights")
        if "kv_cache" in live:
            counter.track(runner.kv_cache_tensors(live["kv_cache"]), "kv_cache")
        counter.mark_stage(stage)

    on_stage("load")
    handles = counter.watch_grads(case.model.parameters()) if watch_grads else []
    handles += recompute.watch_layers(case.model, counter, saves) if saves is not None else []
    with counter, case.context(), vlm.host_checks_skipped(), vlm.step_context(case.model, case.workload, counter), \
            time_loop.marks(case.model, counter):
        watching = recompute.watching(counter, saves, case.model) if saves is not None else contextlib.nullcontext()
        if primed is not None:
            _prime_optimizer(case, primed)
            on_stage("optimizer")
            steps -= 1
        if case.step is None:
            with watching:
                runner.run_stages(case.model, case.optimizer, case.workload, case.inputs, on_stage, steps=steps,
                                  live=live)
            if saves is not None:
                recompute.probe(case, counter, saves)
        else:
            for _ in range(steps):
                case.step(on_stage)
                case.optimizer.step()
                case.optimizer.zero_grad(set_to_none=True)
                on_stage("optimizer")
    for h in handles:
        h.remove()
    return counter


_GRAD_NAMES: dict = {}


def grad_names(config: dict, workload: Workload, parallel: Parallel, layers: list[int] | None = None,
               kernels: str = "cuda") -> set[str]:
    """The parameters a training step of this (reduced) model gives gradients (runner.params_with_grads), on a
    build of its own at the smallest size, never the counted one (a first forward does lazy work, FSDP's
    init among it, that every counted trace must see alike); memoised: a derivation traces the same reduced model
    at many sizes."""
    import json

    # not the LoRA rank: which parameters get gradients does not depend on it (a derivation traces three ranks)
    key = (json.dumps(config, sort_keys=True, default=str), workload.method, workload.lora_targets, workload.loss,
           workload.compile, workload.recipe, workload.checkpointing, workload.images, workload.audios,
           parallel.strategy, parallel.tp_size, tuple(layers) if layers is not None else None, kernels)
    if key not in _GRAD_NAMES:
        if len(_GRAD_NAMES) > 256:
            _GRAD_NAMES.clear()
        from dataclasses import replace

        # images, audio: the sequence must hold their tokens (tracer.vlm, tracer.audio)
        small = replace(workload, batch=1, seq=workload.seq if workload.images or workload.audios else
                        min(workload.seq, 64), gen_tokens=0)
        with kernels_mod.emulate(kernels), _prepared(config, small, parallel, layers, kernels=kernels) as case:
            with case.context(), vlm.host_checks_skipped(), vlm.step_context(case.model, case.workload):
                _GRAD_NAMES[key] = runner.params_with_grads(case.model, case.workload, case.inputs)
    return _GRAD_NAMES[key]


def _prime_optimizer(case: _Case, names: set[str]) -> None:
    """Create the optimizer's states as its first step does (torch.optim `_init_group` is lazy), on zero
    gradients of the parameters a step reaches (`names`): what a first training step leaves behind, less its
    activations (all freed by then). A parameter no step reaches gets no gradient and so no state."""
    for n, p in case.model.named_parameters():
        if p.requires_grad and n in names:
            p.grad = torch.zeros_like(p)
    case.optimizer.step()
    case.optimizer.zero_grad(set_to_none=True)


def _observe_layers(model, counter: StorageCounter) -> None:
    """Tag every tick with the decoder layer running it (its position in the layer list) or None.

    Forward: a pre-hook (prepended, so before FSDP's all-gather) opens the layer's block, a post-hook closes it.
    Backward: a gradient hook on the layer's output opens its block when the gradient reaches it (after the next
    layer's backward); one on the first layer's input closes the last block (on each stack's first layer: an
    encoder-decoder model's decoder runs its backward before its encoder's). transformers checkpoints a layer's
    `forward`, not `__call__` (modeling_layers.GradientCheckpointingLayer), so a recompute in backward fires no
    module hook and stays inside the layer's backward block.
    """

    stacks = [layers for _, _, layers in layer_stacks(model)]
    layers = [layer for stack in stacks for layer in stack]
    firsts = {sum(len(s) for s in stacks[:k]) for k in range(len(stacks))}   # an encoder-decoder model: two stacks

    def first_tensor(x):
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
            return x[0]
        return None

    def on_grad(block):
        def hook(grad):
            counter.set_block(block)
        return hook

    for pos, layer in enumerate(layers):
        def pre(module, args, kwargs, pos=pos):
            counter.set_block(pos)
            x = first_tensor(args) if args else kwargs.get("hidden_states")
            if pos in firsts and isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(on_grad(None))

        def post(module, args, output, pos=pos):
            counter.set_block(None)
            y = first_tensor(output)
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(on_grad(pos))

        layer.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        layer.register_forward_hook(post)


def _torch_tracker_peak(config, workload, parallel, steps, kernels: str = "cuda") -> tuple[int, str, dict]:
    """(overall peak, tracker name, its categories at the peak) of torch's tracker on its own run (inside the
    caller's kernels.emulate)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    with _prepared(config, workload, parallel, kernels=kernels) as case:
        inner = getattr(case.optimizer, "inner", case.optimizer)   # mixed: the torch optimizer over fp32 masters
        masters = list(getattr(case.optimizer, "master_params", ()))
        if parallel.strategy in FSDP_STRATEGIES:
            tracker, name = FSDPMemTracker(case.model, inner), "FSDPMemTracker"
            tracker.track_inputs((case.inputs, masters))  # it has no track_external; masters predate it too
        else:
            tracker, name = MemTracker(), "MemTracker"
            tracker.track_external(case.model, inner, case.inputs, *masters)

        def on_stage(stage: str) -> None:
            if stage != "forward":  # the trackers refuse a second forward without a reset
                tracker.reset_mod_stats()

        with tracker:
            runner.run_stages(case.model, case.optimizer, workload, case.inputs, on_stage, steps=steps)
    snap = tracker.get_tracker_snapshot("peak")
    categories = {str(getattr(k, "value", k)): v for dev in snap.values() for k, v in dev.items()}
    return memtracker_peak_bytes(tracker), name, categories


def _param_counts(model) -> tuple[int, int]:
    params = list(model.parameters())  # deduplicated, so tied embeddings count once
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _ddp_buckets(model) -> list[torch.Tensor]:
    """One flat buffer per gradient dtype, the bytes DDP's Reducer allocates for its buckets."""
    numel: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
    return [torch.empty(n, dtype=dt) for dt, n in numel.items()]









@serialized
def run_traced(config: dict, workload: Workload, parallel: Parallel = Parallel(), *, steps: int = 2,
               check: bool = False, name: str = "model", kernels: str = "cuda", stream: bool = False,
               rank: int = 0) -> Trace:
    """Trace one case: per-stage peaks and breakdowns, parameter counts, notes.

    kernels: "cuda" (default) traces what a CUDA GPU keeps (tracer.kernels.emulate); "cpu" the model
    exactly as a plain training loop on fake CPU tensors runs it.
    stream=True keeps the run's allocation events (`Trace.events`: what the caching allocator would be asked,
    in order; offline.allocator.Stream is built from them by bench.trace.cases.stream_of).
    rank: the traced rank of a pipeline (its stage; tracer.pp); every other layout traces rank 0.
    check=True traces the case a second time, counted by torch's own tracker alone (MemTracker for
    single-GPU full fine-tuning, FSDPMemTracker for FSDP), and raises if its overall peak is not
    the same to the byte. The two runs are separate because FSDPMemTracker re-registers FSDP's hooks,
    which changes when FSDP frees its buffers; nested, the counters would not be counting the same run.
    """
    kernels_mod.check_kind(kernels)
    check_traceable(workload, parallel)
    check_learned_positions(config, name, workload)
    if check:
        check_checkable(workload, parallel)
    start = time.perf_counter()
    with kernels_mod.emulate(kernels):
        with _prepared(config, workload, parallel, kernels=kernels, rank=rank) as case:
            counter = _run(case, steps)
            trace = Trace(counter.log(), *_param_counts(case.model), case.notes, case.per_rank)
            trace.notes.append(kernels_mod.note(kernels))
            if stream:
                trace.events = counter.allocation_events()
        if check:
            theirs, name_, categories = _torch_tracker_peak(config, workload, parallel, steps, kernels)
            if theirs != counter.peak_bytes:
                raise RuntimeError(f"counters disagree: StorageCounter peak {counter.peak_bytes} B, "
                                   f"{name_} {theirs} B")
            trace.notes.append(f"{name_} agrees to the byte ({theirs} B)")
            if trace.per_rank is not None:
                trace.per_rank["fsdp_mem_tracker_peak"] = categories
    trace.seconds = time.perf_counter() - start
    return trace
