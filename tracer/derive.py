"""Derive a model's memory profile from traces of its own code (torch; imported only to derive a profile).

    profile = derive_profile(config, Workload(method="lora"), Parallel(), progress=print)

The method, for one config and one workload class:

1. **Reduced depth.** The model is built on the meta device and its decoder layers are told apart by type
   (`tracer.depth.layer_infos`). R1 keeps the first layer, the first middle layer of every type and the
   last layer; for every middle type that occurs more than once, R2_T is R1 with one more layer of that type
   right after its first one. A uniform 32-layer Llama is traced with 3 and 4 layers (7 and 8 under activation
   offloading, whose stash needs R1 to keep five copies of each middle type: tracer.offload.DEPTH_COPIES). A
   model whose layers share parameters (a block several layers reuse: Zamba) is traced whole instead.
2. **Sizes.** Each reduced model is traced at batch 1, 2 x three sequence lengths (and, for FSDP, a second world
   size; TP at its own degree, which its profile's class names; for LoRA, a second rank at the sizes its
   r-linear terms need; for inference, two generated tokens), every tick of the step counted (`tracer.session`),
   and the ticks that can hold a peak (an allocation followed by a free) kept. Their live bytes per category are
   fit exactly as polynomials in (b, s[, g][, 1/n][, r]) (`estimator.profile.poly`); a further traced size
   (larger, of a remainder mod 32 no fitted seq has; for LoRA at a third rank) must agree to the byte, or the
   derivation stops with the moment that disagrees. Sliding-window and chunked attention make memory piecewise in
   s: each piece between window sizes
   is fit on its own. Where CUDA's memory-efficient attention runs, its padding (a logsumexp of 32 * ceil(s / 32)
   rows, a mask copied to a multiple of 16 columns on unaligned s) adds monomials in l and m, more seqs, and,
   with a mask, a split of the piece by s's alignment (`choose_seqs`, `_derive_pieces`).
3. **Full depth.** Ticks outside the decoder layers (embedding, head, loss, optimizer step) extend linearly in the
   number of layers of each type: c_full = c_R1 + sum_T (n_T - 1) (c_R2T - c_R1). A tick inside a middle layer of
   type T at full position j sees the layers before and after it: c_R1 plus, per type T', the extra layers before
   j times the effect of one more T' layer before (measured where R2 puts it before) and likewise after. Every
   middle position is a candidate; dominated candidates are dropped.
4. **Replayed classes.** Where tracer.replay allows it (one GPU, the optimizer after backward), every trace of a
   grad_accum 1 step is also replayed as a step of grad_accum 2, and where tracer.recompute allows it (full
   fine-tuning without checkpointing, one GPU or DDP) as a step under full activation checkpointing, and where
   tracer.selective allows it (full or LoRA, SDPA or eager attention) under selective checkpointing; those ticks are fit,
   verified and extended the same way, each replay checked against one traced step of its class: one derivation
   gives every class (`derive_profiles`), whichever was asked for (`replay_plan`).
The result is a `Profile` (pure data, JSON) that `estimator.estimate` evaluates without torch. Which sizes are traced:
tracer.seqs.
"""
from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace

from estimator import cp as estimator_cp
from estimator.families import batch_squared, batch_two_apart
from estimator.profile import poly
from estimator.profile.profile import Piece, Profile
from estimator.scans import LIGHTNING_KEY, chunked_scan, scan_path
from estimator.spec import PP_STAGES_PER_RANK, Parallel, Workload
from estimator.store import GRAD_ACCUM_CLASS, TRACER_REVISION, parallel_class, workload_class
from estimator.parallel import TRACED_SHARDING
from tracer import forked, serialized
from tracer import kernels as kernels_mod
from tracer import audio, losses, offload, pp, recompute, replay, runner, selective, session, vision, vlm
from tracer.depth import all_layers, layer_infos, traced_whole
from tracer.extend import (
    decode_ticks,
    encode_ticks,
    Plan,
    moment_of,
    size_points,
    extend,
    fit_variant,
    plan_layers,
    prune,
    verify,
)
from tracer.lora import derivation_ranks
from tracer.seqs import GEN_TOKENS, UNITS, WINDOW_KEYS, choose_seqs, chunk_step, max_positions, pieces_for  # noqa: F401
from tracer.ticks import prime_names, trace_ticks
from tracer.meta import is_masked_lm, is_vision_model, read_inventory  # noqa: F401  (read_inventory: the store's other miss)

# Batch 1 is its own region: with one sequence, size-1 dimensions make some copies unnecessary (a sliced
# (1, s+1) label tensor is already contiguous, so the loss's .contiguous() copies nothing), so bytes at b = 1 are not
# the b >= 2 polynomial's value. Each region: (batches fit, batch verified, b_lo, b_hi).
BATCH_REGIONS = (((1,), 1, 1, 1), ((2, 3), 4, 2, None))
# a step with a batch^2 term (families.BATCH_SQUARED_VLM_TYPES with images): its b >= 2 region fits three batches
BATCH_SQUARED_REGIONS = (((1,), 1, 1, 1), ((2, 3, 4), 5, 2, None))
THREE_BATCH_REGIONS = (((1,), 1, 1, 1), ((2,), 2, 2, 2), ((3, 4), 5, 3, None))   # families.batch_two_apart
FSDP_WORLD = (2, 4, 8)              # fit at 2 (all sizes) and 4 (one size), verify at 8


# ------------------------------------------------------------------------------------------------- driver


def _signatures(config: dict, workload: Workload) -> tuple[list[str], object, bool, bool, bool]:
    """(layer type signatures, transformers config, built as an encoder: a masked LM or a vision encoder, whether
    two decoder layers hold the same parameter: a block several layers reuse, as Zamba's shared transformer, whether
    transformers checkpoints its layers: `supports_gradient_checkpointing`)."""

    base = replace(workload, method="full", gen_tokens=0) if workload.method == "lora" else \
        replace(workload, gen_tokens=0)
    model = runner.build_model(config, base, device="meta")
    try:   # a spatial vision model's blocks are in stages of different widths: traced whole (tracer.vision)
        sigs = [] if vision.is_spatial(model.config) else [li.signature for li in layer_infos(model)]
    except ValueError:  # no decoder layer stack to tell apart: trace the whole model
        sigs = []
    owner: dict = {}
    shared = bool(sigs) and any(owner.setdefault(id(p), i) != i
                                for i, layer in enumerate(all_layers(model)) for p in layer.parameters())
    if sigs and workload.method in ("lora", "qlora"):
        sigs = _frozen_prefix(model, workload.lora_targets, sigs)
    return (sigs, model.config, is_masked_lm(model) or is_vision_model(model), shared,
            bool(getattr(model, "supports_gradient_checkpointing", False)))


def _frozen_prefix(model, targets, sigs: list[str]) -> list[str]:
    """The signatures with the layers before the first one holding a LoRA target told apart: their input needs no
    gradient, so autograd saves nothing in them, while a layer of the same type after it saves its activations.
    A hybrid whose attention layers alone hold the default targets (q_proj, v_proj) starts with layers of other types
    (Qwen3-Next: three Gated DeltaNet layers, Jamba: four Mamba layers); one more such layer measured where it saves
    nothing, counted for every one of that type, was 35 GiB low on Qwen3-Next at batch 2 x seq 3000."""
    wanted = set(targets)

    def holds(module) -> bool:   # PEFT matches a target name against the end of a module's name
        return any(name.split(".")[-1] in wanted for name, _ in module.named_modules())

    layers = all_layers(model)
    # an adapted embedding makes every layer's input need a gradient
    embedded = any("embed" in name and name.split(".")[-1] in wanted for name, _ in model.named_modules())
    first = 0 if embedded else next((i for i, layer in enumerate(layers) if holds(layer)), 0)
    return [sig + " (before the first LoRA layer)" if i < first else sig for i, sig in enumerate(sigs)]


@serialized
def derive_profile(config: dict, workload: Workload, parallel: Parallel = Parallel(),
                   progress: Callable[[int, int, str], None] | None = None, config_hash: str = "",
                   kernels: str = "cuda", rank_variable: bool | None = None, pp_rank: int = 0) -> Profile:
    """The profile of this class alone, traced (`derive_profiles` without the replays, which would add work for
    classes nobody asked for)."""
    return derive_profiles(config, workload, parallel, progress, config_hash, kernels, rank_variable, pp_rank,
                           replays=False)[0]


@serialized
def derive_profiles(config: dict, workload: Workload, parallel: Parallel = Parallel(),
                    progress: Callable[[int, int, str], None] | None = None, config_hash: str = "",
                    kernels: str = "cuda", rank_variable: bool | None = None, pp_rank: int = 0,
                    replays: bool | None = None) -> list[Profile]:
    """Trace the model at reduced depth and a few sizes, fit, verify and extend: see the module docstring.

    `workload` and `parallel` fix the class; their sizes (batch, seq, gen_tokens, gpus) are ignored; `kernels`
    as in session.run_traced. LoRA's rank is a variable of the profile (`LORA_RANKS`) unless `rank_variable` is
    False (then the profile is the workload's rank's alone, as profiles were before). With pipeline parallelism
    (strategy pp, or FSDP x PP) the profile is of rank `pp_rank`: its stage's layers
    (estimator.parallel.pp_stage_layers) are the model the reduced depths cut, and each traced size runs the whole
    schedule (tracer.pp). Raises ValueError (one line) when the case
    cannot be traced or the fit is not exact.

    Gradient accumulation and full and selective activation checkpointing are replayed, not traced (tracer.replay,
    tracer.recompute, tracer.selective), where `replays` and the class allow it: the class traced (grad_accum 1, no
    checkpointing) and its replayed classes (grad_accum >= 2; full; selective checkpointing) come from the same
    traces, the one asked for first in the list, the others after it (the store keeps them)."""

    start = time.perf_counter()
    asked = workload
    replays = replays_on() if replays is None else replays
    workload, kinds, asked_kind = replay_plan(workload, parallel) if replays else (workload, (), None)
    infer = workload.mode == "infer"
    fsdp = parallel.strategy in TRACED_SHARDING
    ranks = derivation_ranks(workload, fsdp, rank_variable)
    ranked = len(ranks[0]) > 1
    w0 = replace(workload, batch=1, seq=1, gen_tokens=GEN_TOKENS if infer else 0, lora_rank=ranks[0][0])
    # a TP profile is of one tp degree (its parallel class names it): traced and fit at that world size only
    # a CP profile is of one cp degree and rank: FSDP over n = dp_shard x cp, fit at dp_shard 1 and 2, verified at 4
    world = tuple(parallel.cp * k for k in (1, 2, 4)) if fsdp and parallel.cp > 1 else \
        FSDP_WORLD if fsdp else ((2,) if parallel.strategy == "ddp" else
                                     (parallel.tp_size,) if parallel.strategy == "tp" else
                                     (parallel.pp_size * parallel.tp_size,) if parallel.strategy == "pp" else (1,))
    session.check_traceable(w0, _at_world(parallel, world[0]))
    scan = chunked_scan(config)
    if scan and kernels != "cuda":
        # transformers' torch references: Mamba-2's fit at b = 1 was 2 bytes off at the verify seq on the tiny
        # Mamba-2 (tests/data/tiny/t-mamba2.json); the others loop over chunks or time steps in Python
        raise ValueError(f"kernels: {config.get('model_type')} runs a chunked state-space scan ({scan[0]}="
                         f"{scan[1]}); a profile prices it on the GPU's kernels only (mamba_ssm, flash-linear-attention "
                         "and causal_conv1d installed: kernels cuda)")
    sigs, hf_config, masked, shared, checkpointable = _signatures(config, w0)
    if not checkpointable and "checkpointing" in kinds:   # a ResNet: transformers refuses to checkpoint it
        if asked_kind == "checkpointing":
            return derive_profiles(config, asked, parallel, progress, config_hash, kernels, rank_variable, pp_rank,
                                   False)
        kinds = tuple(k for k in kinds if k != "checkpointing")
    held = None   # a pipeline rank: its stages' layers (the model's indices) are the model the reduced depths cut
    if parallel.pp_size > 1:
        sigs, held = pp.rank_signatures(sigs, parallel, pp_rank)
    elif pp_rank and not 0 < pp_rank < parallel.cp:
        raise ValueError(f"pp_rank: only a pipeline's or a context-parallel group's ranks are traced apart; got rank "
                         f"{pp_rank}")
    scan = chunked_scan(hf_config)
    scan_extra = poly.scan_monomials(scan[1], blocks=scan[0] == LIGHTNING_KEY) if scan else ()
    if masked and infer:
        w0 = replace(w0, gen_tokens=0)  # an encoder (text or vision) runs one forward pass: no decoding
    plan = plan_layers(sigs, offload.DEPTH_COPIES if workload.activation_offload else 1)
    multiple = estimator_cp.seq_multiple(parallel)   # CP cuts each sequence into 2 x cp chunks (x tp with SP)
    step = math.lcm(chunk_step(workload, hf_config), multiple)
    # a scan whose chunk is longer than the largest unit (Mamba-1's 2048) is fit on seqs that span chunks
    units = (scan[1] // 2,) if scan and scan[1] > 2 * UNITS[0] else UNITS
    pieces = pieces_for(hf_config, max_positions(hf_config), infer, step, multiple, units,
                        max(vlm.seq_floor(hf_config, w0), audio.seq_floor(config, hf_config, w0)))
    fit_world = world[:2] if fsdp else world
    reduced_refused = traced_whole(hf_config, w0, shared) or \
        (pp.LOOPED_WHOLE if PP_STAGES_PER_RANK[parallel.pp_schedule] > 1 else "")   # what the extension cannot add
    if reduced_refused and not plan.full:
        plan = Plan(plan.n_layers, plan.types, (tuple(range(plan.n_layers)),), (None,), True)
    try:
        out_pieces, n_jobs, padding = _derive_pieces(config, w0, parallel, plan, pieces, world, fit_world, fsdp,
                                                     kernels, progress, scan_extra, step, ranks, (pp_rank, held), multiple,
                                                     kinds)
    except _ReducedDepthFailed as e:
        # The model's code outside its layer stack depends on the layer count (Gemma-3n / Gemma-4 per-layer
        # embeddings: one table num_hidden_layers x width wide, reshaped by the config's count), so a model cut in
        # place cannot run: it is traced whole, at every size (slower, exact by construction).
        reduced_refused = f"the reduced-depth model failed: {e.reason}"
        plan = Plan(plan.n_layers, plan.types, (tuple(range(plan.n_layers)),), (None,), True)
        out_pieces, n_jobs, padding = _derive_pieces(config, w0, parallel, plan, pieces, world, fit_world, fsdp,
                                                     kernels, progress, scan_extra, step, ranks, (pp_rank, held), multiple,
                                                     kinds)
    jobs = range(n_jobs)
    if progress:
        progress(len(jobs), len(jobs), "done")
    import torch
    import transformers

    prov = {"torch": torch.__version__, "transformers": transformers.__version__, "kernels": kernels,
            "tracer_revision": TRACER_REVISION,
            "python": platform.python_version(), "traces": len(jobs), "fsdp_padding_max_bytes": padding,
            "seconds": round(time.perf_counter() - start, 2),
            "reduced_depths": [list(v) for v in plan.variants if v is not None and not reduced_refused],
            **({"traced_whole": reduced_refused} if reduced_refused else {}),
            **({"lora_ranks": {"fit": list(ranks[0]), "verified": ranks[1]}} if ranked else {}),
            **({"scan": scan_path(scan, not infer)} if scan else {}),
            "derived_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    main, replayed = out_pieces
    refused = {k: v for k, v in replayed.items() if isinstance(v, str)}   # replays that missed their traced check
    if refused:
        prov["replay_refused"] = refused
    model_type = str(config.get("model_type"))
    out = [Profile(config_hash, model_type, workload_class(workload, ranked), parallel_class(parallel, pp_rank),
                   plan.n_layers, tuple(main), prov)]
    for kind, pieces_k in replayed.items():
        if not isinstance(pieces_k, str):
            out.append(Profile(config_hash, model_type, workload_class(SIBLINGS[kind](workload), ranked),
                               parallel_class(parallel, pp_rank), plan.n_layers, tuple(pieces_k),
                               {**prov, "replayed": REPLAYED[kind]}))
    if asked_kind in refused:   # traced after all, the classes the traces gave kept beside it
        return [derive_profiles(config, asked, parallel, progress, config_hash, kernels, rank_variable, pp_rank,
                                False)[0], *out]
    if asked_kind is not None:
        i = 1 + [k for k in replayed if not isinstance(replayed[k], str)].index(asked_kind)
        out.insert(0, out.pop(i))
    return out


REPLAYS_ENV = "WILLITFIT_REPLAYS"


def replays_on() -> bool:
    """Whether a derivation replays its siblings (`replays` None): WILLITFIT_REPLAYS, 1 (the default) or 0. 0 traces
    the class asked for alone, the replays' hooks and probe forwards left out (about half a derivation's work where
    its class replays two or three siblings): for runs that want that one class, and for the test suite, whose tests
    of the replays turn them back on (tests/conftest.py)."""
    raw = os.environ.get(REPLAYS_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{REPLAYS_ENV}: 1 (replay grad_accum 2 and checkpointing from a derivation's traces, the "
                         f"default) or 0 (trace the class asked for alone); got {raw!r}")
    return raw != "0"


# the class each replay gives from the traced one, and what its provenance says
SIBLINGS = {"grad_accum": lambda w: replace(w, grad_accum=GRAD_ACCUM_CLASS),
            "checkpointing": lambda w: replace(w, checkpointing="full"),
            "selective": lambda w: replace(w, checkpointing="selective")}
REPLAYED = {"grad_accum": "grad_accum 2 from the traces of grad_accum 1 (tracer.replay)",
            "checkpointing": "full activation checkpointing from the traces without it (tracer.recompute)",
            "selective": "selective activation checkpointing from the traces without it (tracer.selective)"}


def replay_plan(workload: Workload, parallel: Parallel) -> tuple[Workload, tuple[str, ...], str | None]:
    """(the workload to trace, the replays its traces give (SIBLINGS), which of them is the class asked for or None):
    a class of grad_accum >= 2 traces grad_accum 1, one of full or selective checkpointing traces none, where the
    replay allows it; every replay the traced class allows comes along."""
    base, asked_kind = workload, None
    none = replace(workload, checkpointing="none")
    if workload.grad_accum > 1 and not replay.replayable(replace(workload, grad_accum=1), parallel):
        base, asked_kind = replace(workload, grad_accum=1), "grad_accum"
    elif workload.checkpointing == "full" and not recompute.replayable(none, parallel):
        base, asked_kind = none, "checkpointing"
    elif workload.checkpointing == "selective" and not selective.replayable(none, parallel):
        base, asked_kind = none, "selective"
    kinds = tuple(k for k, why in (("grad_accum", replay.replayable(base, parallel)),
                                   ("checkpointing", recompute.replayable(base, parallel)),
                                   ("selective", selective.replayable(base, parallel))) if not why)
    return base, kinds, asked_kind


def _at_world(parallel: Parallel, n: int) -> Parallel:
    """The traced setting at world size n: FSDP's n is its shard group (dp), so FSDP x TP x PP runs on n x tp x pp GPUs;
    TP alone runs on its own degree (n = tp); single on one GPU."""
    if parallel.strategy == "single":
        return parallel
    if parallel.strategy in TRACED_SHARDING:   # n is the dp group: of each TP group and pipeline stage
        return replace(parallel, gpus=n * parallel.tp * parallel.pp)
    return replace(parallel, gpus=n)


class _ReducedDepthFailed(Exception):
    """The reduced-depth model raised inside the model's own code on its first trace."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _derive_pieces(config, w0, parallel, plan, pieces, world, fit_world, fsdp, kernels, progress, scan_extra=(),
                   step=8, ranks=((8,), 8), stage=(0, 0), multiple=1, kinds=()):
    """(fitted pieces, traces run, largest FSDP padding): every piece of s and batch region, every variant of
    `plan` traced, fit, verified and extended. Where the step calls CUDA's memory-efficient attention (seen on the
    piece's first trace) the fit gets its monomials in l and m and the seqs that determine them (`choose_seqs`);
    with a mask, the piece is split by s's alignment (the mask is copied on unaligned s only). `scan_extra`: the
    monomials in q of a chunked state-space scan (poly.scan_monomials; its chunk tensors are sized by the chunk
    count), fit on every piece with seqs that tell q from s. `ranks`: (the LoRA ranks fit, the rank verified); with
    two fit ranks the rank is a variable. `stage`: (pipeline rank, the model's index of each of the plan's layers;
    None: the same). A reduced plan whose first trace fails in the model's code raises _ReducedDepthFailed.
    `kinds`: every trace also replays its step under each of these knobs (SIBLINGS: grad_accum 2, tracer.replay;
    full checkpointing, tracer.recompute; selective, tracer.selective), and those ticks are fit and verified the same way; one traced step of each
    replayed class checks its replay itself (`replay.check`): the fitted pieces are (this class's, {kind: the
    replayed class's, or why not where the replay was not exact})."""

    fit_ranks, vrank = ranks
    ranked = len(fit_ranks) > 1
    pp_rank, held = stage
    # GLM-4.1V's vision embeddings hold an (images x patches) tensor: b^2 at a fixed image size
    regions, b_extra = (BATCH_SQUARED_REGIONS, (poly.B2,)) if batch_squared(config, w0) else \
        (THREE_BATCH_REGIONS if batch_two_apart(config, w0) else BATCH_REGIONS, ())

    def jobs(fseqs) -> int:
        return sum(len(size_points(r[0], fseqs, fit_world, fit_ranks)) + 1 for r in regions) * \
            len(plan.variants)

    n_jobs = sum(jobs(p[2]) for p in pieces) + len(kinds)   # each replay's one traced check
    done, padding = 0, 0
    cache: dict = {}

    def what(pt, v) -> str:
        keep = plan.variants[v]
        b, s, n, r = pt
        whole = "the whole model" if held is None else f"pipeline rank {pp_rank}'s {plan.n_layers} layers"
        return ((f"tracing {whole}" if keep is None or plan.full else
                 f"tracing {len(keep)} of {plan.n_layers} layers") + f" at batch {b}, seq {s}"
                + (f", {n} GPUs" if n > 1 else "") + (f", LoRA rank {r}" if ranked else ""))

    def args(job) -> tuple:
        """(config, workload, parallel, layers, kernels) of one trace job (variant, (b, s, n, r)[, replayed kind])."""
        v, (b, s, n, r) = job[:2]
        keep = plan.variants[v]
        w = replace(w0, batch=b, seq=s, lora_rank=r)
        return (config, SIBLINGS[job[2]](w) if len(job) > 2 else w,
                _at_world(parallel, n), None if keep is None else [i if held is None else held[i] for i in keep], kernels)

    def trace(job):
        return trace_ticks(*args(job), pp_rank=pp_rank, replays=kinds if len(job) == 2 else ())

    def run(pt, v, *accumulated):
        """The ticks of variant v at pt (with `accumulated` (kind,): a traced step of that replayed class, the
        replay's check)."""
        nonlocal done
        hit = cache.get((v, pt, *accumulated))
        if isinstance(hit, Exception):  # a forked trace's failure, raised where one process would have met it
            raise hit
        if hit is not None:
            return hit
        if progress:
            progress(done, n_jobs, what(pt, v))
        try:
            ticks = trace((v, pt, *accumulated))
        except (RuntimeError, KeyError, IndexError, AttributeError, TypeError) as e:
            # the model's own code failing (Zamba2's shared blocks look their adapters up by the position of the
            # layer in the stack, which a reduced model renumbers: KeyError)
            if multiple > 1 and not done:   # context parallelism: the model's attention is not what the ring runs
                raise ValueError("cp: this step does not run under torch's context_parallel (ring attention takes "
                                 "causal SDPA with no mask or bias): " + " ".join(str(e).split())[:160]) from e
            if done or plan.full:
                raise
            said = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"   # a bare KeyError says "2"
            raise _ReducedDepthFailed(" ".join(said.split())[:200]) from e
        done += 1
        cache[(v, pt, *accumulated)] = ticks
        return ticks

    def prefetch(points) -> None:
        """Trace the sizes a piece's fit and check will ask for, in forked copies where that is possible
        (tracer.forked); `run` then finds them in `cache`."""
        todo = list(dict.fromkeys(job for job in points if job not in cache))
        sequential = forked.why_sequential(len(todo), forked.workers())
        here = set()

        def start(job) -> None:
            here.add(job)
            if progress:
                progress(done, n_jobs, what(job[1], job[0]))

        def finished(job, out) -> None:
            nonlocal done
            cache[job] = out
            if not isinstance(out, Exception):
                done += 1
            if progress and job not in here:  # a forked copy's trace: said as it comes back
                progress(done, n_jobs, what(job[1], job[0]).replace("tracing", "traced", 1))

        if sequential is None:
            # what every copy would compute first, computed once here and inherited (session.grad_names memo)
            with kernels_mod.emulate(kernels), losses.bounding_chunks(), vision.interpolating(), vlm.fitting():
                for job in {job[0]: job for job in todo if len(job) == 2}.values():   # the traced class's
                    prime_names(*args(job))
        forked.run_all(todo, trace, encode_ticks, decode_ticks, finished, start)

    def probe_of(seqs) -> tuple:
        return (regions[-1][0][0], seqs[0], fit_world[0], fit_ranks[0])   # one the b >= 2 region fits anyway

    # Two rounds, each spread over processes (prefetch): every piece's first trace (it decides that piece's seqs;
    # the first piece's here, where a failure of the reduced model is told apart), then every other trace
    run(probe_of(pieces[0][2]), 0)
    prefetch([(0, probe_of(p[2])) for p in pieces[1:]])
    planned = []
    masks = poly.MASK_MONOMIALS + (poly.FIXED_QUERY_MASK_MONOMIALS if w0.target_seq else ())  # t x m: cross-attn
    for lo, hi, seqs, vseq in pieces:
        seen = run(probe_of(seqs), 0).efficient
        unit = seqs[0] - lo
        if multiple > 1 and seen:
            raise ValueError("attention: under context parallelism this model's ring attention runs CUDA's "
                             "memory-efficient kernel, whose padding follows each rank's chunk of the sequence; only "
                             "the flash kernel's ring (bf16 or fp16, head dim up to 256, no mask) is priced")
        # q is one value all through a piece within one chunk (MiniMax's one- and two-block pieces): no q terms there
        lse = (poly.LSE_MONOMIALS if "lse" in seen else ()) + tuple(
            m for m in scan_extra if hi is None or poly.scan_padded(lo + 1, poly.scan_chunk(m)) != poly.scan_padded(
                hi, poly.scan_chunk(m)))
        if "mask" in seen:  # a mask is copied on unaligned s only: two pieces (the aligned one alone where a loss's
            # chunks are whole on multiples of 16 only, chunk_step: no unaligned seq keeps them whole)
            classes = [(a, x, *choose_seqs(lo, unit, x, a, step, multiple)) for a, x in
                       (("aligned", lse), ("unaligned", masks + lse))[:2 if step % poly.MASK_ALIGNMENT else 1]]
        else:
            classes = [(None, lse, *(choose_seqs(lo, unit, lse, step=step, multiple=multiple) if lse else (seqs, vseq)))]
        n_jobs += sum(jobs(c[2]) for c in classes) - jobs(seqs)
        planned.append((seen, classes))
    # each replay's check: one traced step of its class, at the first piece's verified size of b >= 2 on the deepest
    # reduced model, against the replayed ticks there, key by key (the replay's surgery is the same at every size)
    checked = (len(plan.variants) - 1, (regions[-1][1], planned[0][1][0][3], world[-1], vrank))
    prefetch([(v, pt) for _, classes in planned for _, _, fseqs, vs in classes
              for batches, vbatch, _, _ in regions for v in range(len(plan.variants))
              for pt in (*size_points(batches, fseqs, fit_world, fit_ranks), (vbatch, vs, world[-1], vrank))] +
             [(*checked, kind) for kind in kinds])
    out_pieces = [[], {kind: [] for kind in kinds}]
    for (lo, hi, seqs, _), (seen, classes) in zip(pieces, planned):
        for align, extra, fseqs, vs in classes:
            for batches, vbatch, b_lo, b_hi in regions:
                vpoint = (vbatch, vs, world[-1], vrank)
                fits = ([], {})
                for v in range(len(plan.variants)):
                    traces = {pt: run(pt, v) for pt in size_points(batches, fseqs, fit_world, fit_ranks)}
                    check = run(vpoint, v)
                    if any(tk.efficient - seen for tk in (*traces.values(), check)):
                        raise ValueError(f"fit: the step calls CUDA's memory-efficient attention differently at some "
                                         f"sizes of s > {lo} than at seq {seqs[0]}; no exact profile can be derived")
                    fit = fit_variant(traces, fsdp, one_batch=len(batches) == 1, extra=extra + b_extra,
                                      ranked=ranked)
                    padding = max(padding, verify(fit, check, vpoint))
                    fits[0].append(fit)
                    for kind, got in out_pieces[1].items():   # each replayed step, checked against a traced one
                        if isinstance(got, str):
                            continue
                        try:
                            refused = next((tk.replayed[kind].refused for tk in (*traces.values(), check)
                                            if tk.replayed[kind].refused), "")
                            if refused:
                                raise ValueError(refused)
                            if (v, vpoint) == checked:
                                replay.check(check.replayed[kind], run(vpoint, v, kind), vpoint, kind)
                            fit = fit_variant({pt: tk.replayed[kind] for pt, tk in traces.items()}, fsdp,
                                              one_batch=len(batches) == 1, extra=extra + b_extra, ranked=ranked)
                            verify(fit, check.replayed[kind], vpoint)
                            fits[1].setdefault(kind, []).append(fit)
                        except (ValueError, RuntimeError, KeyError, IndexError, AttributeError, TypeError) as e:
                            # the replay not exact, or its check's trace failing in the model's code: no such class
                            out_pieces[1][kind] = " ".join(str(e).split())[:300] or type(e).__name__
                main_cands = prune(extend(plan, fits[0]))
                out_pieces[0].append(Piece.from_moments(lo, hi, [moment_of(c) for c in main_cands], b_lo, b_hi, align))
                for kind, got in out_pieces[1].items():
                    if not isinstance(got, str):
                        cands = prune(extend(plan, fits[1][kind]))
                        got.append(Piece.from_moments(lo, hi, [moment_of(c) for c in cands], b_lo, b_hi, align))
    return (out_pieces[0], out_pieces[1]), n_jobs, padding
