"""estimate(): one step's memory per GPU, stage by stage, from the model's traced profile.

A training step is load -> forward -> backward -> optimizer step, in the steady state (the optimizer states exist);
inference is load -> prefill -> decode. Each stage's bytes are the largest over the profile's moments of that
stage (estimator.profile: every tick of the real step that can hold the peak, exact polynomials in the sizes,
derived from the model's own code). What the traced profile cannot see is swapped in per category from the
inventory (estimator.components): stored weight formats, optimizers the trace cannot run, the KV-cache dtype,
ZeRO-1/2 and tensor/pipeline/expert sharding, CPU offload, the CUDA context. `traced_class` says which
traceable workload stands for a given one, and `Estimate.notes` what was priced analytically.
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from estimator import components as comp
from estimator import ssd, store
from estimator.breakdown import Breakdown
from estimator.model import Model
from estimator.parallel import (check_model, check_optimizer, compile_notes, compile_untraced, pp_microbatches,
                                pp_rank_shares, pp_traced_parallel, pp_untraced, shares, tp_untraced)
from estimator.reserved import workload_class
from estimator.spec import PAGED_OPTIMIZERS, PP_TRACED_ONLY, Parallel, Workload, class_key
from estimator.evaluate import peak_shares, stage_breakdowns, traced_rank
from estimator.reserved import alloc_mode
from estimator.reserved import fit_for_class
from estimator.device import context_bytes
from estimator.gpus import get_gpu
from estimator import cp, device, evaluate, gpus, parallel, reserved, seq2seq, vision
from estimator.profile import poly

UNTRACEABLE_OPTIMIZERS = ("adamw-8bit", "paged-adamw", "paged-adamw-8bit", "adafactor", "lion")
MAX_CUDA_CONTEXT = 64 * 2**30  # a context is 0.3-1.5 GiB; more than 64 GiB is a unit mistake (bytes for MiB)
CONTEXT_SOURCE = "data/cuda_context.json (estimator.device)"
ANALYTIC_STRATEGIES = ("zero1", "zero2", "tp", "pp", "ep")


@dataclass(frozen=True)
class Options:
    """Knobs that are not part of the workload: the overhead model, the activation model, deriving."""

    overhead: comp.Overhead = comp.Overhead()
    activation_k: float | None = None   # None: the traced profile; a number: the seeds' k * b*s*h*L*bytes form
    derive: bool = True                 # derive a missing profile now (torch); False raises store.ProfileMissing
    progress: Callable | None = field(default=None, compare=False, hash=False)
    alloc_conf: str = ""                # PYTORCH_CUDA_ALLOC_CONF: which fitted reserved class (estimator.reserved)
    gpu: str | None = None              # GPU preset: picks the CUDA context of its architecture (estimator.device)
    cuda_context_bytes: int | None = None  # a measured CUDA context: overrides the GPU preset's and the overhead's
    analytic_tp: bool = False           # price tp (analytic_pp: pp) by the analytic rule even where the traced
    analytic_pp: bool = False           # ranks' profiles are on disk (scripts/parallel_check.py compares the two)

    def __post_init__(self) -> None:
        c = self.cuda_context_bytes
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_CUDA_CONTEXT):
            raise ValueError(f"cuda_context: must be a whole number of bytes in 0..{MAX_CUDA_CONTEXT} "
                             f"(64 GiB), got {c!r}")
        if self.alloc_conf:
            _alloc_mode(self.alloc_conf)   # a bad string: parse_alloc_conf's one line, at construction
        if self.gpu is not None:
            get_gpu(self.gpu)


@dataclass(frozen=True)
class StageBytes:
    """One stage's peak as the three counters of a GPU run: torch's allocated and reserved, the device's use."""
    stage: str
    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int


@dataclass(frozen=True)
class Estimate:
    model: Model
    workload: Workload
    parallel: Parallel
    params: int
    trainable_params: int
    stages: tuple[tuple[str, Breakdown], ...]
    peak_stage: str
    pipeline_stage: str         # which pipeline stage holds the peak ('only' without PP)
    cuda_context_bytes: int     # part of `overhead` that torch.cuda's allocator never sees
    workspace_bytes: int        # one cuBLAS workspace, allocated through torch (a stage holds 0-2: workspace_at)
    peak_moment: str = ""       # where in the step the peak is (the profile moment's label)
    notes: tuple[str, ...] = ()  # what was priced analytically instead of traced
    profile: dict = field(default_factory=dict, compare=False)  # the profile's provenance
    paged_bytes: int = 0        # optimizer states in CUDA unified memory (paged optimizers): not in `total`
    reserved_source: str = ""   # which fitted class priced allocator_cache
    context_source: str = CONTEXT_SOURCE  # where cuda_context_bytes comes from
    per_rank: bool = False      # priced from one traced rank's profile (TP, pipeline), not split analytically

    @property
    def components(self) -> Breakdown:
        return dict(self.stages)[self.peak_stage]

    @property
    def total_bytes(self) -> int:
        """Per-GPU peak of the step, everything included: compare with the GPU's total memory."""
        return self.components.total

    @property
    def allocated_bytes(self) -> int:
        """Peak as torch.cuda.max_memory_allocated would see it (no cache, no context, no NCCL)."""
        return self.allocated_at(self.peak_stage)

    def workspace_at(self, stage: str) -> int:
        """Bytes of the cuBLAS workspaces `stage` holds (in its `overhead`; components.cublas_workspaces)."""
        return comp.cublas_workspaces(self.workload.mode, stage) * self.workspace_bytes

    @property
    def allocator_overhead_bytes(self) -> int:
        """The part of the peak's `overhead` allocated through torch: its stage's cuBLAS workspaces."""
        return self.workspace_at(self.peak_stage)

    def allocated_at(self, stage: str) -> int:
        """A stage's peak as torch.cuda.max_memory_allocated would see it: its tensors plus its cuBLAS workspaces
        (allocated through torch), without the allocator's cache, the CUDA context or NCCL's buffers."""
        c = self.stage(stage)
        return c.total - c.overhead - c.allocator_cache + self.workspace_at(stage)

    def stage_bytes(self) -> tuple[StageBytes, ...]:
        """Per stage: allocated, reserved (allocated + the allocator's cache) and device bytes (everything, the
        number nvidia-smi shows), the three counters a GPU run reports; the pages draw these, never re-derive them."""
        out = []
        for name, c in self.stages:
            allocated = self.allocated_at(name)
            out.append(StageBytes(name, allocated, allocated + c.allocator_cache, c.total))
        return tuple(out)

    @property
    def reserved_bytes(self) -> int:
        """Peak as torch.cuda.max_memory_reserved would see it: allocated + the allocator's cache
        (reserved = allocated + min(allocated * r + c, allocated * q) of its workload class: data/allocator_fit.json)."""
        return self.allocated_bytes + self.components.allocator_cache

    @property
    def device_bytes(self) -> int:
        """What nvidia-smi shows for the process: reserved + CUDA context + NCCL buffers. The verdict's number."""
        return self.total_bytes

    def verdict(self, capacity: int) -> str:
        """'fits', 'tight' or 'oom' on a GPU where a process can get `capacity` bytes. tight: all but the allocator's
        estimated cache fits; PyTorch frees cached blocks and retries before it raises (CUDACachingAllocator.cpp,
        release_cached_blocks), so fragmentation decides (docs/accuracy.md, "Measured tier")."""
        if self.device_bytes <= capacity:
            return "fits"
        return "oom" if self.device_bytes - self.components.allocator_cache > capacity else "tight"

    def device_parts(self) -> tuple[tuple[str, int, str], ...]:
        """(name, bytes, source) of each layer from allocated to device bytes at the peak; they sum to device_bytes."""
        c = self.components
        nccl = c.overhead - self.cuda_context_bytes - self.allocator_overhead_bytes
        return (("tensors", self.allocated_bytes - self.allocator_overhead_bytes,
                 f"traced profile ({self.profile.get('kernels', 'cuda')} kernels), swapped components"),
                ("cublas_workspace", self.allocator_overhead_bytes, "aten CublasHandlePool.cpp (sm90), one per thread"),
                ("allocator_cache", c.allocator_cache, self.reserved_source),
                ("cuda_context", self.cuda_context_bytes, self.context_source),
                ("nccl", nccl, "NCCL buffers, components.Overhead (only with more than one GPU)"))

    def stage(self, name: str) -> Breakdown:
        return dict(self.stages)[name]


def traced_class(w: Workload, p: Parallel) -> tuple[Workload, Parallel, tuple[str, ...]]:
    """The traceable (workload, parallel) whose profile stands for this one, and what is priced analytically.
    It starts from the canonical class (store.canonical_class: knobs that do not apply at their defaults, every
    grad_accum >= 2 as 2), the same one the store keys and derives, so no note speaks of an unused knob."""
    notes, asked, w = [], w, store.canonical_class(w)   # a pipeline's micro-batches: the grad_accum asked
    tw = replace(w, batch=1, seq=1, gen_tokens=0, kv_dtype="auto")
    if w.attention == "flash" and not w.images:   # traced as SDPA (tracer.runner.attn_implementation); only images
        tw = replace(tw, attention="sdpa")          # change the trace (tracer.vlm_grid): one profile, SDPA's
    if w.method == "qlora":
        tw = replace(tw, method="lora", weight_format="auto", quantize_scope="all", double_quant=True)
        notes.append("qlora: traced with bf16 base weights; the 4-bit base and its dequantization are priced "
                     "from the inventory")
    elif w.weight_format not in ("auto", *comp.FLOAT_FORMATS):
        tw = replace(tw, weight_format="auto")
        notes.append(f"weights: {w.weight_format} priced from the inventory (traced in {w.precision})")
    elif w.weight_format == comp.weight_format(replace(w, weight_format="auto")):
        tw = replace(tw, weight_format="auto")  # the same dtype 'auto' resolves to: the same traced class
    if w.optimizer_in_backward and w.optimizer in PAGED_OPTIMIZERS:
        # torchtune's low-memory recipe: paged AdamW stepped in backward. The per-parameter step is traced with
        # torch's AdamW; the paged states are swapped out of the allocator (paged_bytes) like any paged optimizer.
        tw = replace(tw, optimizer="adamw", optimizer_impl="foreach")
        notes.append(f"optimizer: {w.optimizer} stepped in backward, traced as AdamW; its states are in unified "
                     "memory (paged_bytes)")
    if not w.optimizer_in_backward and (w.optimizer, w.optimizer_impl) != ("adamw", "foreach"):
        # One traced optimizer serves every one: its states and step temporaries are swapped for the
        # inventory's (estimator.components), exactly where the trace and the formula agree (adamw foreach).
        tw = replace(tw, optimizer="adamw", optimizer_impl="foreach")
        if w.optimizer in UNTRACEABLE_OPTIMIZERS:
            notes.append(f"optimizer: {w.optimizer} states and step priced from the inventory")
    if w.kv_dtype != "auto":
        notes.append(f"kv cache: {w.kv_dtype} (traced in the model dtype, scaled)")
    if w.float8 and importlib.util.find_spec("torchao") is None:
        # torchao's matmul_with_hp_or_float8_args saves (input_hp, weight_hp_t), the tensors a bf16 Linear saves; only
        # its float8 copies (1 byte per element of one Linear's input and weight) are transient extras
        tw = replace(tw, float8=False)
        notes.append("float8: torchao is not installed, so not traced; priced as bf16, whose saved tensors eager "
                     "float8 training keeps too (its transient float8 copies are not counted)")
    if w.loss == "fused-linear":
        notes.append("fused-linear: Liger's power-of-two chunks of logits bounded from above in the profile "
                     "(at most three more chunks; tracer.losses.bounding_chunk_rows)")
    if p.strategy in ("fsdp", "zero3", "hsdp"):
        # FSDP2 fully_shard is ZeRO-3; HSDP is FSDP over its shard group (the replicas hold the same)
        tp = Parallel(strategy="fsdp", gpus=2, fsdp_wrap=p.fsdp_wrap)
        if p.strategy == "hsdp":
            notes.append("hsdp: one FSDP shard group traced")
    elif p.strategy == "fsdp-grad-op":
        tp = Parallel(strategy="fsdp-grad-op", gpus=2, fsdp_wrap=p.fsdp_wrap)
    elif p.strategy == "ddp":
        # DDP's one memory effect on a rank: its gradient buckets, allocated at construction (reducer.cpp
        # initialize_buckets; gradient_as_bucket_view=False): exactly the single-GPU step plus one buffer per
        # gradient dtype, added from the inventory
        tp = Parallel()
    else:
        tp = Parallel()
        if p.strategy != "single":
            notes.append(f"{p.strategy}: sharding priced from the inventory over a single-GPU profile"
                         + (" (activations split after Korthikanti et al. 2022, Table 2)" if p.tp_size > 1 else ""))
    if p.tp_size > 1 and tp_untraced(w, p) is None:
        # one TP rank traced (tracer.tp: torchtitan's apply_tp; FSDP2 over dp on a (dp, tp) mesh), its profile fit
        # at this tp degree; where it is not on disk, `resolve` falls back to the analytic split (`tp` above)
        fsdp = p.strategy != "tp"
        notes = [n for n in notes if not n.startswith(f"{p.strategy}: sharding priced")]
        notes.append(f"tp: one rank of tp {p.tp_size} traced (torchtitan's apply_tp, loss_parallel in training"
                     + (", FSDP2 over dp on a (dp, tp) mesh)" if fsdp else ")"))
        sp = p.sequence_parallel
        tp = replace(tp, gpus=2 * p.tp_size, tp=p.tp_size, sequence_parallel=sp) if fsdp else \
            Parallel(strategy="tp", gpus=p.gpus, sequence_parallel=sp)
    if p.pp_size > 1 and pp_untraced(asked, p) is None:
        # every rank traced (tracer.pp) at this degree, schedule and micro-batches; else `resolve`'s analytic rule
        m = pp_microbatches(asked, p)
        notes = [n for n in notes if not n.startswith(f"{p.strategy}: sharding priced")]
        notes.append(f"pp: every rank of pp {p.pp_size} traced ({p.pp_schedule}, {m} micro-batches of "
                     f"{w.batch}; torch.distributed.pipelining, torchtitan's split of the layers)")
        if p.tp_size > 1:   # TP inside every stage (torchtitan's 3-D mesh)
            notes = [n for n in notes if not n.startswith("tp: ")]
            notes.append(f"tp: each stage tensor-parallel over tp {p.tp_size} (torchtitan's apply_tp, loss_parallel"
                         + (", sequence parallelism" if p.sequence_parallel else "") + ")")
        tp = pp_traced_parallel(p, m)
        tw = replace(tw, grad_accum=1)
    if p.cp > 1:
        tp = cp.traced(p)
        notes.append(cp.note(p))
    if compile_untraced(w, tp):   # as the traced class runs it: one graph, or each block (an FSDP2 or pipeline rank)
        tw = replace(tw, compile=False)
    return tw, tp, (*notes, *compile_notes(w, tp), *evaluate.fsdp_notes(w, p))


_CLASSES: dict = {}


def resolve(model: Model, w: Workload, p: Parallel, options: Options):
    """(traced workload, notes, profile, [(share, profile)] per GPU that could hold the peak) for this workload
    class, memoised: a search or a sweep only changes the sizes, and looking a profile up (hashing its class) costs
    more than evaluating it. Every share is evaluated with the one profile, except a pipeline whose ranks are
    traced one by one: each rank with its own."""
    key = (model, p, options.derive, options.analytic_tp, options.analytic_pp,
           class_key(w))
    hit = _CLASSES.get(key)
    if hit is None:
        model.inventory.trainable_params(w)  # a LoRA target the model lacks: one clean line, before any trace
        check_model(model.inventory, p, model.name)  # a TP degree that does not divide the heads, ...
        w, attn_note = _runnable_attention(model, w)
        tw, tp, notes = traced_class(w, p)
        notes = attn_note + vision.scope_notes(model, w) + notes
        prof = None
        if tp.tp_size > 1 and tp.pp_size == 1 and tp.cp == 1:
            prof, tp, notes = _traced_tp_or_analytic(model, tw, tp, notes, options)
        per_rank = None
        if tp.pp_size > 1:
            per_rank, tw, tp, notes = _traced_pp_or_analytic(model, w, tw, tp, notes, options)
        if tp.cp > 1:   # each derived CP rank its own profile, one model share (tracer.cp)
            per_rank = tuple(store.profile(model.config, tw, tp, name=model.name, derive=options.derive,
                                           progress=options.progress, pp_rank=r) for r in store.class_ranks(tp))
            prof, pairs = per_rank[0], cp.rank_pairs(shares(model.inventory, p)[0], per_rank, tp.cp)
        elif per_rank is not None:
            prof = per_rank[0]
            pairs = tuple(zip(pp_rank_shares(model.inventory, p), per_rank))
        else:
            if prof is None:
                prof = store.profile(model.config, tw, tp, name=model.name, derive=options.derive,
                                     progress=options.progress)
            pairs = tuple((sh, prof) for sh in shares(model.inventory, p))
        hit = (tw, notes, prof, pairs)
        if len(_CLASSES) > 4096:
            _CLASSES.clear()
        _CLASSES[key] = hit
    return hit


def _traced_pp_or_analytic(model: Model, w: Workload, tw: Workload, tp: Parallel, notes: tuple, options: Options):
    """(every rank's profile, traced workload, parallel class, notes) with every rank's on disk; else None and the
    analytic rule's single-GPU class, noting the command that derives them (an estimate never derives a pipeline)."""
    try:
        if options.analytic_pp:
            raise store.ProfileMissing("analytic asked")
        return tuple(store.profile(model.config, tw, tp, name=model.name, derive=False, pp_rank=r)
                     for r in store.class_ranks(tp)), tw, tp, notes
    except store.ProfileMissing:
        how = (f"`python -m bench derive --model {model.name} --strategy {tp.strategy} --gpus {tp.gpus} "
               + (f"--pp {tp.pp_size} " if tp.strategy != "pp" or tp.tp_size > 1 else "")
               + (f"--tp {tp.tp_size} " if tp.tp_size > 1 else "")
               + ("--sequence-parallel true " if tp.sequence_parallel else "")
               + f"--pp-schedule {tp.pp_schedule} --microbatches {tp.microbatches}` with the same workload flags, "
                 "or `python -m estimator ... --derive-ranks`")
        if tp.pp_schedule in PP_TRACED_ONLY:   # no rule prices a zero-bubble schedule
            raise ValueError(f"pp_schedule: {tp.pp_schedule} is priced from traced ranks only; derive them: {how}") \
                from None
        note = "pp: priced by the analytic rule (Options.analytic_pp)" if options.analytic_pp else \
            f"pp: no traced profiles of the {tp.pp_size} pipeline ranks on disk; priced by the analytic rule " \
            f"(derive the exact ones: {how})"
        eager = tw.compile and compile_untraced(tw, analytic_class(tp))   # the rule's class, traced compiled or not
        tw = replace(tw, grad_accum=store.canonical_class(w).grad_accum, compile=tw.compile and not eager)
        gone = ("pp: every rank", "tp: each stage") + (("compile",) if eager else ())
        kept = tuple(n for n in notes if not n.startswith(gone)) + (note,)
        return None, tw, analytic_class(tp), kept + ((f"{eager}; the rule's step estimated as eager",) if eager else ())


def _traced_tp_or_analytic(model: Model, tw: Workload, tp: Parallel, notes: tuple, options: Options):
    """(profile, its parallel class, notes): the traced TP rank's profile where one is on disk (shipped, cache or
    bank); else None and the class the analytic split prices from (single GPU, or the FSDP rank), with a note
    naming how to derive the exact one (an estimate never starts a TP derivation itself: minutes per degree)."""
    try:
        if options.analytic_tp:
            raise store.ProfileMissing("analytic asked")
        return store.profile(model.config, tw, tp, name=model.name, derive=False), tp, notes
    except store.ProfileMissing:
        how = (f"`python -m bench derive --model {model.name} --strategy tp --gpus {tp.gpus}` with the same workload "
               "flags, or" if tp.strategy == "tp" and not tp.sequence_parallel else "") + \
            " `python -m estimator ... --derive-ranks` (ensure_profile(..., tp_rank=True))"
        note = "tp: priced by the analytic split (Options.analytic_tp)" if options.analytic_tp else \
            (f"tp: no traced profile of one rank at tp={tp.tp_size} on disk; priced by the analytic split (derive "
             f"the exact one: {how})")
        return None, analytic_class(tp), tuple(n for n in notes if not n.startswith("tp: one rank")) + (note,)


def _runnable_attention(model: Model, w: Workload) -> tuple[Workload, tuple[str, ...]]:
    """SDPA (or FlashAttention-2, traced as SDPA) on a model transformers runs without an SDPA path (Gemma-2's logit
    softcapping, gpt-oss's attention sinks) is priced as eager, what transformers runs by default; a note says so."""
    if w.attention == "eager" or model.inventory.supports_sdpa:
        return w, ()
    built = model.inventory.built_as
    if vision.is_spatial(model):   # a conv net or a windowed encoder: its own code, whatever attention is asked
        return replace(w, attention="eager"), (f"attention: {built} runs its own code (no SDPA path in "
                                               "transformers); priced as it runs",)
    note = (f"attention: {built} has no SDPA path in transformers; priced as eager (its default), which keeps "
            "the seq x seq scores" + (" (FlashAttention-2 keeps none: an upper bound)" if w.attention == "flash"
                                      else ""))
    return replace(w, attention="eager"), (note,)


def ensure_profile(model: Model, workload: Workload, parallel: Parallel = Parallel(),
                   progress: Callable | None = None, *, tp_rank: bool = False) -> dict:
    """Make sure the profile `estimate(model, workload, parallel)` evaluates is on disk, deriving it now (torch;
    `progress(done, total, message)` per trace) if it is not. Returns its provenance with 'where': shipped, cache or
    'derived now'. With tp > 1 that is the traced TP rank's profile where one is on disk, else the analytic split's;
    `tp_rank=True` derives the traced TP rank's, or every traced pipeline rank's (minutes each:
    `scripts/parallel_check.py`, `python -m bench derive`)."""
    tw, tp = evaluated_class(model, workload, parallel, tp_rank)
    if tp.pp_size > 1 or tp.cp > 1:  # every rank of the pipeline (the CP ranks), each its own derivation
        out = None
        for r in store.class_ranks(tp):
            found = _where(model, tw, tp, r)
            prof = store.profile(model.config, tw, tp, name=model.name, derive=found is None, progress=progress,
                                 pp_rank=r)
            out = out or {**prof.provenance, "where": found or "derived now"}
        return out
    found = _where(model, tw, tp)
    prof = store.profile(model.config, tw, tp, name=model.name, derive=found is None, progress=progress)
    return {**prof.provenance, "where": found or "derived now"}


def profile_where(model: Model, workload: Workload, parallel: Parallel = Parallel()) -> str | None:
    """Where the profile `estimate(model, workload, parallel)` evaluates is: 'shipped', 'cache', or None when it
    must be derived (or fetched from a bank) first. A file check: no profile is read."""
    tw, tp = evaluated_class(model, workload, parallel, False)
    found = [_where(model, tw, tp, r) for r in store.class_ranks(tp)]
    return None if None in found else found[0]


def evaluated_class(model: Model, workload: Workload, parallel: Parallel, tp_rank: bool):
    """(traced workload, traced parallel) of the profile an estimate evaluates: a traced TP rank's (every traced
    pipeline rank's) only where it is on disk already or `tp_rank` asks for it, else the class of the analytic split
    (`analytic_class`; a pipeline: the single-GPU profile)."""
    w, _ = _runnable_attention(model, workload)
    tw, tp, _ = traced_class(w, parallel)
    if tp.tp_size > 1 and tp.pp_size == 1 and tp.cp == 1 and not tp_rank and _where(model, tw, tp) is None:
        tp = analytic_class(tp)   # (a CP class has no analytic fallback: its ranks are derived)
    if tp.pp_size > 1 and not tp_rank and any(_where(model, tw, tp, r) is None for r in store.class_ranks(tp)):
        tw, tp = replace(tw, grad_accum=store.canonical_class(w).grad_accum), analytic_class(tp)
    return tw, tp


def _where(model: Model, tw: Workload, tp: Parallel, pp_rank: int = 0) -> str | None:
    """'shipped' or 'cache' for the profile file that answers this traced class (LoRA: the rank-free one, else a
    per-rank one: store.stored_key; a pipeline: rank `pp_rank`'s), or None."""
    key = store.stored_key(model.config, tw, tp, pp_rank=pp_rank)
    return None if key is None else store.where(model.config, key=key)


def analytic_class(tp: Parallel) -> Parallel:
    """The class the analytic TP split (the PP rule) prices from: single GPU for strategy tp (pp), else the FSDP rank
    (n = dp; ZeRO-3's is FSDP's, as in `traced_class`: a "zero3" class nobody ships was asked for before)."""
    strategy = "fsdp-grad-op" if tp.strategy == "fsdp-grad-op" else "fsdp"
    return Parallel() if tp.strategy in ("tp", "pp") else Parallel(strategy=strategy, gpus=2, fsdp_wrap=tp.fsdp_wrap)


def profile_for(model: Model, w: Workload, p: Parallel, options: Options = Options()):
    return resolve(model, w, p, options)[2]


def estimate(model: Model, workload: Workload, parallel: Parallel = Parallel(),
             options: Options = Options()) -> Estimate:
    """Per-GPU memory of one step of `workload` on `model` under `parallel`."""

    options = device_options(options)
    workload = vision.sized(model, workload)  # a vision encoder's image size -> its tokens per image (seq)
    vision.check_images(model, workload)      # a VLM's images: their tokens fit in seq
    seq2seq.check(model, workload, parallel)  # an encoder-decoder model's lengths, knobs and layout
    workload, attn_note = _runnable_attention(model, workload)  # the estimate shows what will run
    cp.check(workload, parallel, causal=model.causal)  # before any derivation: mode, attention, seq in 2 x cp chunks
    check_optimizer(workload, parallel)   # a fused step DTensor cannot run
    tw, notes, prof, stage_shares = resolve(model, workload, parallel, options)
    notes = attn_note + notes + ssd.split_notes(model.config, model.inventory.config_hash, workload.mode,
                                                workload.batch, workload.seq) + vision.size_notes(model, workload) \
        + seq2seq.layerdrop_notes(model, workload) + comp.offload_notes(workload)
    fit, mode_note, source = reserved_fit(workload_class(workload, parallel), options.alloc_conf)
    best = None
    points: dict = {}   # each piece's monomials at these sizes, shared by the pipeline stages' plans
    for sh, sh_prof in peak_shares(model, stage_shares, workload, parallel, tw, options, points):
        # the allocator's cache on each stage's allocated peak (monotone in it: the peak stage stays the peak)
        stages = stage_breakdowns(model, sh_prof, workload, parallel, tw, sh, options, fit, points)
        peak_name, (label, peak) = max(((n, v) for n, v in stages.items()), key=lambda kv: kv[1][1].total)
        if best is None or peak.total > best[0]:
            best = (peak.total, sh.stage, stages, peak_name, label)
    _, pstage, stages, peak_name, label = best
    paged = 0
    if comp.paged(workload.optimizer):
        paged = comp.optimizer_state_bytes(model.inventory.trainable_shapes(workload), workload.optimizer,
                                           comp.recipe_dtypes(workload).state)
    return Estimate(model=model, workload=workload, parallel=parallel, params=vision.params(model, workload),
                    trainable_params=model.inventory.trainable_params(workload),
                    stages=tuple((n, b) for n, (_, b) in stages.items()), peak_stage=peak_name,
                    pipeline_stage=pstage, cuda_context_bytes=options.overhead.cuda_context_bytes,
                    workspace_bytes=options.overhead.cublas_workspace_bytes, peak_moment=label,
                    notes=notes + ((mode_note,) if mode_note else ()), profile=dict(prof.provenance),
                    paged_bytes=paged, reserved_source=source,
                    per_rank=traced_rank(prof.parallel_class) or "cp" in prof.parallel_class,
                    context_source=CONTEXT_SOURCE if options.cuda_context_bytes is None else "given (--cuda-context)")


@functools.lru_cache(maxsize=64)
def _alloc_mode(alloc_conf: str):
    return alloc_mode(alloc_conf)


@functools.lru_cache(maxsize=64)
def reserved_fit(cls: str, alloc_conf: str):
    """(ReservedFit, note or None, source in words) for this workload class under this PYTORCH_CUDA_ALLOC_CONF."""
    mode, note = _alloc_mode(alloc_conf)
    f = fit_for_class(cls, mode)
    source = (f"data/allocator_fit.json: {f.workload_class}, {mode} allocator, reserved = allocated + min(allocated x "
              f"{f.ratio:.4f} + {f.const_bytes / 2**20:.1f} MiB, allocated x {f.max_ratio:.4f}) (n={f.n}, median "
              f"error {f.median_rel_error:.1%}, worst {f.worst_rel_error:.1%})")
    return f, note, source


@functools.lru_cache(maxsize=64)
def device_options(options: Options) -> Options:
    """With a GPU and the default overhead, the CUDA context of the GPU's architecture (estimator.device); a
    given context (Options.cuda_context_bytes, a measured one) overrides both."""
    if options.cuda_context_bytes is not None:
        return replace(options, overhead=replace(options.overhead, cuda_context_bytes=options.cuda_context_bytes))
    if options.gpu is None or options.overhead != comp.Overhead():
        return options
    ctx = context_bytes(get_gpu(options.gpu))
    if ctx == options.overhead.cuda_context_bytes:
        return options
    return replace(options, overhead=replace(options.overhead, cuda_context_bytes=ctx))


def clear_caches(tables: bool = True) -> None:
    """Empty every memo the estimator keeps (loaded profiles and inventories, lru_caches): a cold call.
    tables=False keeps the process-wide data tables (data/gpus.json, cuda_context.json, cuda_capacity.json,
    allocator_fit.json: read once per process): what the first estimate of a config costs in a running app."""
    store.clear_memo()
    _CLASSES.clear()
    evaluate.clear_plans()
    parallel.clear_caches()
    poly.clear_caches()
    for memo in (_alloc_mode, reserved_fit, device_options):
        memo.cache_clear()
    if tables:
        device.clear_tables()
        gpus.clear_tables()
        reserved.clear_tables()
