"""Searches over the estimate: the largest batch or sequence that fits, the fewest GPUs, and what to change.

Every answer comes from re-running `estimate` on a changed spec (`dataclasses.replace`); nothing here knows a
formula. `max_batch`/`max_seq` rely on memory growing monotonically with batch and with seq over the multiples of 16
(tests/test_properties.py checks it; `max_seq` says why an unaligned seq may cost more); `min_gpus` relies on it falling with the world size only for the ZeRO/FSDP strategies and scans
the other strategies' valid sizes one by one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from estimator import cp, vision
from estimator.estimate import Options, estimate
from estimator.model import Model
from estimator.parallel import steppable
from estimator.presets import default_lora_targets
from estimator.store import ProfileMissing
from estimator.profile.poly import MASK_ALIGNMENT, mask_width
from estimator.spec import (CP_STRATEGIES, MAX_BATCH, MAX_SEQ, STRATEGIES, Parallel, Workload, loss_seq_step,
                           spec_dict)
from estimator.alloc_conf import parse_alloc_conf

# Strategies whose per-GPU memory never grows with the world size once it is >= 2 (the shard fraction 1/n
# shrinks; nothing else depends on n), so the fewest GPUs can be found by bisection.
MONOTONE_STRATEGIES = ("zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op")


def _fits(model, workload, parallel, gpu_bytes, options) -> bool:
    return estimate(model, workload, parallel, options).total_bytes <= gpu_bytes


def _largest(fits, hi: int) -> int:
    """Largest n in 1..hi with fits(n), for a predicate true up to some n and false after; 0 if fits(1) fails.
    Exponential search for the first failure, then bisection: O(log n) calls."""
    if not fits(1):
        return 0
    lo, step = 1, 2
    while step <= hi and fits(step):
        lo, step = step, step * 2
    high = min(step, hi + 1)  # first known failure (or one past the range)
    while high - lo > 1:
        mid = (lo + high) // 2
        if fits(mid):
            lo = mid
        else:
            high = mid
    return lo


def max_batch(model: Model, workload: Workload, parallel: Parallel, gpu_bytes: int,
              options: Options = Options()) -> int:
    """Largest micro-batch per GPU whose step peak fits in gpu_bytes (0 if batch 1 does not)."""
    return _largest(lambda b: _fits(model, replace(workload, batch=b), parallel, gpu_bytes, options), MAX_BATCH)


def max_seq(model: Model, workload: Workload, parallel: Parallel, gpu_bytes: int,
            options: Options = Options(), limit: int = MAX_SEQ) -> int:
    """Longest sequence (prompt, for inference) that fits, up to `limit` (0 if none does). Memory only:
    the model's own context length (Model.max_positions) is a separate limit the caller may pass. With context
    parallelism, a multiple of 2 x cp (the load balancer's chunks: estimator.cp.check_seq). A vision-language model's
    images (an audio-language model's clips) take a fixed share of every sequence: the search starts past their
    tokens (0 if the shortest fails). A loss in 16 chunks or more: a multiple of them (`seq_step`).

    Memory is not monotone in seq where CUDA's memory-efficient attention is handed a mask (past a sliding window):
    on a seq that is no multiple of 16 it copies the mask to (batch, heads, seq, 16 * ceil(seq / 16)), so seq 8191
    can cost twice seq 8192 (attention.cpp `preprocess_mask`). It is monotone over the multiples of 16, and the copy
    only adds: the multiples of lcm(step, 16) are bisected, then the few seqs between the largest that fits and the
    next are tried one by one (what plain bisection finds, where memory is monotone)."""
    m = seq_step(model, workload, parallel)
    lo = (vision.media_tokens(model, workload) // m + 1) * m   # a VLM's seq holds its images' tokens and some text
    if limit < lo:
        return 0
    big = math.lcm(m, MASK_ALIGNMENT)
    first = -(-lo // big)   # the first multiple of big at or above lo, counted in bigs

    def fits(s: int) -> bool:
        return _fits(model, replace(workload, seq=s), parallel, gpu_bytes, options)

    k = _largest(lambda j: fits((first + j - 1) * big), limit // big - first + 1) if limit >= first * big else 0
    base = (first + k - 1) * big if k else lo - m                  # the largest aligned seq that fits
    top = min(limit, (first + k) * big - m)                         # the last seq below the next aligned one
    return next((s for s in range(top, base, -m) if fits(s)), base if k else 0)


def seq_step(model: Model, workload: Workload, parallel: Parallel) -> int:
    """What the seqs a search proposes are multiples of: context parallelism's 2 x cp chunks, and a loss split in 16
    chunks or more (estimator.spec.loss_seq_step), which is exact on its multiples and, past a window where CUDA's
    attention copies a mask, priced on them alone (profile.Profile.piece_for)."""
    step = loss_seq_step(workload, model.inventory.vocab, model.inventory.hidden)
    return math.lcm(cp.seq_multiple(parallel), step if step % MASK_ALIGNMENT == 0 else 1)


def valid_world_sizes(model: Model, strategy: str, max_gpus: int = 1024) -> list[int]:
    """World sizes `strategy` can use for `model`, ascending.

    - single: 1. ddp/zero*/fsdp*: any n. hsdp: even n (two replicas, each sharded over n/2).
    - tp: n dividing the attention heads, and the KV heads dividing n or n dividing them (Megatron requires
      heads % tp == 0; vLLM replicates KV heads when tp > kv_heads).
    - pp: n <= layers (every stage holds at least one layer).
    - ep: n dividing the routed-expert count (MoE models only).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: {strategy!r} is not allowed; choose one of {', '.join(STRATEGIES)}")
    sizes = range(1, max_gpus + 1)
    if strategy == "single":
        return [1]
    if strategy == "hsdp":
        return [n for n in sizes if n % 2 == 0]
    if strategy == "tp":
        return [n for n in sizes if model.heads % n == 0 and (model.kv_heads % n == 0 or n % model.kv_heads == 0)]
    if strategy == "pp":
        return [n for n in sizes if n <= model.layers]
    if strategy == "ep":
        if not model.is_moe:
            raise ValueError(f"strategy: 'ep' shards routed experts; {model.name} is not a mixture-of-experts model")
        return [n for n in sizes if model.n_experts % n == 0]
    return list(sizes)


def min_gpus(model: Model, workload: Workload, strategy: str, gpu_bytes: int, max_gpus: int = 1024,
             options: Options = Options()) -> int | None:
    """Fewest GPUs (world size) with which `strategy` fits `workload` in gpu_bytes per GPU; None if no valid
    size up to max_gpus does. ZeRO/FSDP sizes >= 2 are bisected (memory falls with n); others are scanned."""
    sizes = valid_world_sizes(model, strategy, max_gpus)

    def fits(n: int) -> bool:
        return _fits(model, workload, Parallel(strategy=strategy, gpus=n), gpu_bytes, options)

    if strategy == "ddp":
        sizes = sizes[:2]  # every rank holds everything: n > 2 costs what n = 2 costs (NCCL buffers included)
    if strategy in MONOTONE_STRATEGIES and len(sizes) > 2:
        if fits(1):
            return 1
        if not fits(sizes[-1]):
            return None
        lo, hi = 2, sizes[-1]  # fits(hi) holds; find the smallest n >= 2 that fits
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo
    return next((n for n in sizes if fits(n)), None)


def why_no_fit(model: Model, workload: Workload, strategy: str, gpu_bytes: int, max_gpus: int = 1024,
               options: Options = Options()) -> str:
    """Why `strategy` does not fit on up to max_gpus GPUs, and the fix when there is one: at the largest valid
    world size the biggest component is named (activations, which sharding does not split, for ZeRO/FSDP), and
    for training the fewest GPUs with full activation checkpointing is priced."""
    sizes = valid_world_sizes(model, strategy, max_gpus)
    n = sizes[-1]
    est = estimate(model, workload, Parallel(strategy=strategy, gpus=n), options)
    parts = est.components.as_dict()
    biggest = max(parts, key=parts.get)
    text = (f"does not fit on up to {max_gpus} GPUs: at {n}, {biggest.replace('_', ' ')} alone are "
            f"{parts[biggest] / 2**30:.2f} GiB per GPU")
    if biggest == "activations" and strategy in MONOTONE_STRATEGIES:
        text += f" ({strategy} shards weights, gradients and states, not activations)"
    if workload.training and workload.checkpointing != "full":
        try:
            fix = min_gpus(model, replace(workload, checkpointing="full"), strategy, gpu_bytes, max_gpus, options)
        except ProfileMissing:
            return text + "; activation checkpointing (full) would cut the activations (not priced: its profile "\
                "is derived on first use)"
        if fix is not None:
            return text + f"; with activation checkpointing (full) it fits on {fix}"
    return text


@dataclass(frozen=True)
class Advice:
    """One change to the run and what the estimator says it would do."""

    title: str                 # e.g. "Enable activation checkpointing (full)"
    change: dict = field(hash=False)  # field of Workload/Parallel -> new value
    saving_bytes: int          # current total - new total (per GPU)
    new_total_bytes: int
    fits: bool                 # new_total_bytes <= gpu_bytes
    note: str                  # the trade-off
    priced: bool = True        # False: its profile is not derived yet (options.derive=False), so no number


def _candidates(model: Model, w: Workload, p: Parallel, gpu_bytes: int, options: Options):
    """(title, workload changes, parallel changes, note), in the order of the usual out-of-memory playbook:
    shorter sequences and smaller micro-batches first, then checkpointing, the optimizer, the method,
    parallelism, attention, precision."""
    out = []
    aligned = mask_width(w.seq)   # the multiple of 16 above an unaligned seq (0 for an aligned one)
    if w.training and aligned and aligned <= model.max_positions:
        out.append((f"Pad each sequence to {aligned} tokens (a multiple of {MASK_ALIGNMENT})", {"seq": aligned}, {},
                    "Where CUDA's memory-efficient attention is handed a mask (past a sliding window), a seq that is "
                    f"no multiple of {MASK_ALIGNMENT} makes every layer copy it to (batch, heads, seq, seq rounded "
                    "up) and keep the copy for backward (attention.cpp preprocess_mask). Right-pad with labels -100 "
                    f"(pad_to_multiple_of={MASK_ALIGNMENT}): the same tokens are trained."))
    if w.seq > 1:  # never past the model's context (Model.max_positions, less the generated tokens)
        limit = max(1, min(w.seq - 1, model.max_positions - w.gen_tokens))
        m = seq_step(model, w, p)
        s = max_seq(model, w, p, gpu_bytes, options, limit=limit) or min(w.seq // 2, limit) // m * m or m
        if s > vision.media_tokens(model, w):   # a VLM: no shorter seq than its images' (audio's) tokens and a text one
            out.append((f"Cut the sequence length to {s}", {"seq": s}, {},
                        "The first lever: activations and KV cache grow with seq (eager attention as seq^2). "
                        "Longer documents must then be truncated or chunked."))
    if w.training and w.batch > 1:
        b = max(1, max_batch(model, w, p, gpu_bytes, options))
        b = max(d for d in range(1, min(b, w.batch - 1) + 1) if w.batch % d == 0)  # keep the effective batch
        out.append((f"Micro-batch {b} with gradient accumulation x{w.grad_accum * w.batch // b}",
                    {"batch": b, "grad_accum": w.grad_accum * w.batch // b}, {},
                    "Same effective batch (batch x grad_accum), fewer activations; more sequential steps."))
    if not w.training and w.gen_tokens > 1:
        out.append((f"Generate {w.gen_tokens // 2} tokens instead of {w.gen_tokens}", {"gen_tokens": w.gen_tokens // 2},
                    {}, "The KV cache grows with every generated token; stop earlier or stream in chunks."))
    if not w.training and w.batch > 1:
        b = max(1, max_batch(model, w, p, gpu_bytes, options))
        b = min(b, w.batch - 1)
        out.append((f"Serve batch {b} at a time", {"batch": b}, {},
                    "Smaller batches need less KV cache; throughput falls."))
    if w.training and w.checkpointing != "full":
        out.append(("Enable activation checkpointing (full)", {"checkpointing": "full"}, {},
                    "Each layer keeps only its input and is recomputed in backward: about 30% more compute."))
    if w.training and w.checkpointing == "none":
        out.append(("Enable selective activation checkpointing", {"checkpointing": "selective"}, {},
                    "Recomputes only the attention core (Korthikanti et al. 2022): a few % more compute."))
    if w.training and w.optimizer in ("adam", "adamw"):
        out.append(("Use 8-bit AdamW (bitsandbytes)", {"optimizer": "adamw-8bit", "optimizer_impl": "foreach"},
                    {}, "Block-wise 8-bit states; test convergence before a long run."))
        out.append(("Use Adafactor", {"optimizer": "adafactor"}, {},
                    "Factored second moment, no first moment; may need a different learning-rate schedule."))
    if w.training and w.optimizer_impl == "foreach" and w.optimizer in ("adam", "adamw", "adafactor"):
        out.append(("Use the fused optimizer step", {"optimizer_impl": "fused"}, {},
                    "torch's fused kernel (fused=True) updates in place, no state-sized temporary; same math."))
    out += _method_candidates(model, w)
    out += _parallel_candidates(model, w, p, gpu_bytes, options)
    if w.attention == "eager" and model.inventory.supports_sdpa:
        out.append(("Use SDPA attention instead of eager", {"attention": "sdpa"}, {},
                    "attn_implementation='sdpa' never materialises the seq x seq scores; same results."))
    out += _precision_candidates(w)
    return [_steppable(w, p, *c) for c in out]


def _steppable(w: Workload, p: Parallel, title: str, wc: dict, pc: dict, note: str) -> tuple:
    """A candidate as it can run (estimator.parallel.steppable): one that moves a fused SGD step onto FSDP2's or TP's
    parameters is priced with its foreach step and says so."""
    changed = replace(w, **wc)
    if steppable(changed, replace(p, **pc)) is changed:
        return title, wc, pc, note
    return (title, {**wc, "optimizer_impl": "foreach"}, pc,
            note + " Fused SGD cannot step FSDP2's or TP's parameters: priced with its foreach step.")


def _method_candidates(model: Model, w: Workload):
    if w.training and w.method == "lora" and w.precision != "fp32":
        return [("Fine-tune with QLoRA (4-bit NF4 base) instead of LoRA",
                 {"method": "qlora", "recipe": "pure", "weight_format": "auto"}, {},
                 "The same adapters over base weights in NF4 (~0.52 bytes/param instead of 2); dequantisation "
                 "slows each step.")]
    if not w.training or w.method != "full":
        return []
    targets = w.lora_targets
    names = set(model.inventory.lora_target_names())
    if not set(targets) <= names:  # PEFT's q_proj,v_proj default does not exist in every architecture: its default
        peft = default_lora_targets(model.model_type)   # for the type (T5: q, v; GPT-2: c_attn), else every Linear
        targets = peft if set(peft) <= names else tuple(sorted(names))
    lora = {"method": "lora", "lora_targets": targets, "weight_format": "auto"}
    out = [(f"Fine-tune with LoRA (r={w.lora_rank}) instead of all weights", lora, {},
            "Frozen base: no gradients or optimizer states for it; adapters train a subspace only.")]
    if w.precision != "fp32":
        out.append(("Fine-tune with QLoRA (4-bit NF4 base)", {**lora, "method": "qlora", "recipe": "pure"}, {},
                    "Base weights in NF4 (~0.52 bytes/param); dequantisation slows each step."))
    return out


def _parallel_candidates(model: Model, w: Workload, p: Parallel, gpu_bytes: int, options: Options):
    out = []
    if p.gpus > 1 and p.strategy in ("ddp", "zero1", "zero2", "fsdp-grad-op") and w.training:
        out.append((f"Shard parameters too: ZeRO-3 over the same {p.gpus} GPUs", {}, {"strategy": "zero3"},
                    "Every layer's weights are gathered before use: more communication per step."))
    if w.training and p.offload == "none" and p.strategy in ("single", "zero1", "zero2", "zero3", "fsdp"):
        out.append(("Offload optimizer states to CPU (ZeRO-Offload)", {}, {"offload": "optimizer"},
                    "States and the update live in host RAM; the step is bounded by PCIe and CPU speed."))
    if w.training and p.offload != "optimizer+params" and p.strategy in ("zero3", "fsdp") and p.gpus > 1:
        out.append(("Offload parameters, gradients and optimizer states to CPU (FSDP2 CPUOffloadPolicy)", {},
                    {"offload": "optimizer+params"},
                    "Only what FSDP gathers stays on the GPU; every shard crosses PCIe each step, and the optimizer "
                    "steps on the CPU: much slower steps."))
    c = _cp_degree(w, p)
    if c:
        out.append((f"Split each sequence over {c} GPUs (context parallelism {c})", {}, {"cp": c},
                    f"torch's ring attention as torchtitan runs it: each GPU holds {w.seq // c} of every sequence's "
                    f"{w.seq} tokens and FSDP shards over dp_shard x cp; K and V travel the ring in every layer, and "
                    f"with the same micro-batch per GPU the global batch is {c}x smaller."))
    strategy = "fsdp" if w.training else "tp"
    try:
        n = min_gpus(model, steppable(w, Parallel(strategy=strategy, gpus=2)), strategy, gpu_bytes, options=options)
    except ValueError:
        n = None
    if n is not None and n > p.gpus:
        out.append((f"Use {n} GPUs with {strategy.upper()}", {}, spec_dict(Parallel(strategy=strategy, gpus=n)),
                    "The fewest GPUs of this kind that fit; each costs money and adds communication."))
    return out


def _precision_candidates(w: Workload):
    out = []
    if w.training and w.recipe in ("fp32", "amp", "mixed") and w.method != "qlora":
        out.append(("Train in pure bf16 (weights, grads and states in bf16)",
                    {"recipe": "pure", "precision": "bf16"}, {},
                    "No fp32 copy of anything; bf16 states can stall tiny updates (use Kahan summation or "
                    "stochastic rounding for long runs)."))
    if not w.training:
        if w.precision == "fp32":
            out.append(("Serve in bf16", {"precision": "bf16"}, {}, "Half the weight and KV bytes."))
        if w.weight_format in ("auto", "fp32", "bf16", "fp16"):
            out.append(("Quantize weights to 8-bit (LLM.int8)", {"weight_format": "int8"}, {},
                        "About half the weight bytes of bf16; int8 matmuls are slower."))
            out.append(("Quantize weights to 4-bit (NF4)", {"weight_format": "nf4"}, {},
                        "About a quarter of bf16; some quality loss."))
        if w.kv_dtype in ("auto", "fp32", "bf16", "fp16") and (w.precision != "fp32" or w.kv_dtype != "auto"):
            out.append(("Store the KV cache in fp8", {"kv_dtype": "fp8"}, {},
                        "Half the KV bytes of bf16 (vLLM kv_cache_dtype='fp8'); small accuracy cost."))
    return out


def advice(model: Model, workload: Workload, parallel: Parallel, gpu_bytes: int,
           options: Options = Options()) -> list[Advice]:
    """What to change to fit (or to gain headroom), each priced by re-running estimate, largest saving first.
    Changes that save nothing are left out. When no single change fits, a last item combines changes
    greedily (largest saving first, up to MAX_COMBINED of them) until the run fits, if it can."""
    single = _single_advice(model, workload, parallel, gpu_bytes, options)
    if any(a.priced for a in single) and not any(a.fits for a in single):
        combined = _combined(model, workload, parallel, gpu_bytes, options, single)
        if combined is not None:
            single.append(combined)
    expandable = _expandable_advice(model, workload, parallel, gpu_bytes, options)
    if expandable is not None:
        single.insert(next((i for i, a in enumerate(single) if a.saving_bytes < expandable.saving_bytes or
                            not a.priced or a.title.startswith("Combine")), len(single)), expandable)
    return single


EXPANDABLE = "expandable_segments:True"


def _expandable_advice(model, workload, parallel, gpu_bytes, options) -> Advice | None:
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, priced through the fitted reserved classes
    (estimator.reserved), when the run does not use it yet and it would save bytes. The note says when the
    allocator's cache decides the verdict (the run fits without it and does not with it)."""
    import re

    if "expandable_segments" in options.alloc_conf and _expandable(options.alloc_conf):
        return None
    conf = re.sub(r"expandable_segments\s*:\s*\w+", EXPANDABLE, options.alloc_conf) \
        if "expandable_segments" in options.alloc_conf else ",".join(filter(None, (options.alloc_conf, EXPANDABLE)))
    try:
        now = estimate(model, workload, parallel, options)
        new = estimate(model, workload, parallel, replace(options, alloc_conf=conf)).total_bytes
    except ProfileMissing:
        return None
    if new >= now.total_bytes:
        return None
    decides = now.total_bytes > gpu_bytes >= now.total_bytes - now.components.allocator_cache
    note = ("Fragmentation decides the verdict: the tensors fit, the allocator's cached segments do not. "
            if decides else "") + ("One growing virtual segment per pool instead of fixed cudaMalloc segments: "
                                  "fewer unusable split tails (torch docs, CUDA memory management).")
    return Advice(f"Set PYTORCH_CUDA_ALLOC_CONF={conf}", {"alloc_conf": conf}, now.total_bytes - new, new,
                  new <= gpu_bytes, note)


def _expandable(conf: str) -> bool:
    return parse_alloc_conf(conf).expandable_segments


MAX_COMBINED = 4
MIN_SAVING_BYTES = 2**30 // 200   # 0.005 GiB: a saving that shows as 0.00 GiB is no advice


def _combined(model, workload, parallel, gpu_bytes, options, first: list[Advice]) -> Advice | None:
    w, p, steps, advices = workload, parallel, [], first
    for _ in range(MAX_COMBINED):
        priced = [a for a in advices if a.priced]
        if not priced:
            return None
        best = priced[0]
        w, p = changed(w, p, best.change)
        steps.append(best)
        if best.fits:
            change = {}
            for a in steps:
                change.update(a.change)
            start = estimate(model, workload, parallel, options).total_bytes
            return Advice("Combine: " + "; ".join(a.title for a in steps), change, start - best.new_total_bytes,
                          best.new_total_bytes, True, "Each step was the largest single saving after the previous.")
        advices = _single_advice(model, w, p, gpu_bytes, options)
        if not advices:
            return None
    return None


def _cp_degree(w: Workload, p: Parallel) -> int:
    """The context-parallel degree advice proposes for a long-sequence FSDP run (0: none): the largest power of two
    up to 8 that divides the GPUs (over tp) and whose 2 x cp chunks divide seq, from seq 4096 up (shorter sequences
    gain little against the ring's communication)."""
    if not (w.training and p.cp == 1 and p.strategy in CP_STRATEGIES and p.pp_size == p.ep_size == 1
            and w.seq >= 4096 and p.gpus > p.tp_size):
        return 0
    for c in (8, 4, 2):
        try:   # an HSDP shard group that no longer divides the data-parallel ranks: not this degree
            with_cp = replace(p, cp=c)
        except ValueError:
            continue
        if w.seq % cp.seq_multiple(with_cp) == 0:
            return c
    return 0


_WORKLOAD_FIELDS = tuple(f.name for f in fields(Workload))


def changed(workload: Workload, parallel: Parallel, change: dict) -> tuple[Workload, Parallel]:
    """The (workload, parallel) an advice's `change` (fields of either) describes."""
    wf = {k: v for k, v in change.items() if k in _WORKLOAD_FIELDS}
    return replace(workload, **wf), replace(parallel, **{k: v for k, v in change.items() if k not in wf})


def unpriced(workload: Workload, parallel: Parallel, items: list[Advice]) -> list[tuple[str, Workload, Parallel]]:
    """(title, workload, parallel) of each advice row that has no number yet (its profile is not derived): what
    `python -m estimator --price-advice` and the app's "What to change" derive so that every row is priced."""
    return [(a.title, *changed(workload, parallel, a.change)) for a in items if not a.priced]


def _single_advice(model, workload, parallel, gpu_bytes, options) -> list[Advice]:
    current = estimate(model, workload, parallel, options).total_bytes
    out, unpriced = [], []
    for title, wc, pc, note in _candidates(model, workload, parallel, gpu_bytes, options):
        try:
            new = estimate(model, replace(workload, **wc), replace(parallel, **pc), options).total_bytes
        except ProfileMissing:
            unpriced.append(Advice(title, {**wc, **pc}, 0, 0, False, note + " (not priced: its profile is "
                                   "derived on first use)", priced=False))
            continue
        except ValueError:
            continue  # the change is not valid for this spec (e.g. LoRA targets the model lacks)
        if current - new >= MIN_SAVING_BYTES:  # less would read "saves 0.00 GiB"
            out.append(Advice(title, {**wc, **pc}, current - new, new, new <= gpu_bytes, note))
    return sorted(out, key=lambda a: -a.saving_bytes) + unpriced
