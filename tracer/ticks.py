"""One trace of a derivation: a (reduced) model at one size, its timeline cut to the ticks that can hold a peak.

`trace_ticks` is what `tracer.derive` runs per size (in this process or a forked copy: tracer.forked); each kept
tick's key says where it is (stage, segment outside the layers, layer, index), its bytes are per profile category.
"""
from __future__ import annotations

import gc

import numpy as np

from estimator.profile.profile import CATEGORIES
from estimator.spec import Parallel, Workload
from tracer import kernels as kernels_mod
from tracer import kernels_sdpa, losses, recompute, replay, session, time_loop, vision, vlm, vlm_grid
from tracer.counters import per_tick
from tracer.extend import OPTIONAL, STEP_MAX, TRACER_CATEGORIES, Ticks, tick_row



# each replay trace_ticks gives, and (checkpointing's) the unit it checkpoints (tracer.recompute.checkpointed)
REPLAYS = {"grad_accum": None, "checkpointing": "layers", "selective": "attention"}


def trace_ticks(config: dict, workload: Workload, parallel: Parallel, layers: list[int] | None,
                kernels: str = "cuda", pp_rank: int = 0, replays: tuple[str, ...] = ()) -> Ticks:
    """Trace one reduced model (or the whole one: layers None) at one size and keep the ticks that can be a peak
    (with the same kernels as session.run_traced, so a profile and a traced row agree). `pp_rank`: a pipeline's rank
    (tracer.pp); `layers` are then its stage's layers that are kept. `replays`: the same step replayed under other
    knobs comes with it, in `Ticks.replayed`: "grad_accum" (as a step of grad_accum 2, where tracer.replay.replayable
    allows), "checkpointing" (under full activation checkpointing, where tracer.recompute.replayable allows),
    "selective" (under selective checkpointing, where tracer.selective.replayable allows). A replay the tracer's guards
    refuse, or one the step is not one of, is there with `refused` set."""

    if set(replays) - set(REPLAYS):
        raise ValueError(f"replays: {', '.join(sorted(set(replays)))}; the replays are {', '.join(REPLAYS)}")
    steps = 2 if workload.mode == "train" else 1
    calls_before = kernels_sdpa.efficient_calls()
    want = tuple(unit for kind, unit in (("checkpointing", "layers"), ("selective", "attention")) if kind in replays)
    saves = recompute.Saves(want=want) if want else None
    gc.disable()  # frees happen at refcount zero; a collector pass at a random tick would break the alignment
    try:
        # Liger's power-of-two chunk rule is not polynomial in the sizes: the profile uses a bounding fixed count
        # a vision encoder interpolates its position embeddings at every fitted size (tracer.vision.interpolating)
        with kernels_mod.emulate(kernels), losses.bounding_chunks(), vision.interpolating(), vlm.fitting():
            prime = prime_names(config, workload, parallel, layers, kernels)
            with session._prepared(config, workload, parallel, layers, kernels=kernels, rank=pp_rank) as case:
                counter = session._run(case, steps, observe_layers=layers is not None, prime=prime,
                                       watch_grads="grad_accum" in replays, saves=saves)
            whole = counter.timeline()
    finally:
        gc.enable()
    tl = recompute.traced_part(whole)
    ticks = _candidates(tl, workload.mode == "train", per_window=parallel.pp_size > 1)
    ticks.efficient = frozenset(k for k, v in kernels_sdpa.efficient_calls().items() if v > calls_before[k])
    for kind in replays:
        try:
            if kind == "grad_accum":
                other = _candidates(replay.accumulating(tl, counter.accumulations), True)
            else:
                other = _candidates(recompute.checkpointed(whole, saves, REPLAYS[kind]), True)
        except ValueError as e:   # the replayed step is one the guards refuse (as a traced one would be) or one the
            # replay does not read: that class is not given, this one is (tracer.derive)
            other = Ticks([], [], np.zeros((0, len(CATEGORIES)), dtype=np.int64), refused=str(e))
        other.efficient = ticks.efficient
        ticks.replayed[kind] = other
    return ticks


def prime_names(config: dict, workload: Workload, parallel: Parallel, layers: list[int] | None,
                kernels: str = "cuda") -> set[str] | None:
    """The parameters whose optimizer states a training trace creates before its counted step (session._run's
    `prime`), or None where the trace runs its first step instead (other loops, optimizer in backward, a pipeline
    rank: its step is a schedule, not the model's forward; activation offloading, whose first step leaves more than
    optimizer states behind: torchtune's OffloadActivations keeps the last autograd node that brought a tensor back
    (`curr_autograd_node`) until the next backward, and with LoRA under checkpointing that node still reaches the
    embedding output, a leaf that requires grad, and its gradient: two (b, s, h) tensors live through the next
    forward, tracer.offload); a grid VLM's step with images (Qwen2VLModel caches its `rope_deltas` on the model for
    generation, so a second step's vision tower runs with the first step's still held: tracer.vlm_grid)."""
    if parallel.pp_size > 1 or workload.activation_offload or vlm_grid.keeps_state(config, workload):
        return None
    if workload.mode == "train" and workload.loop == "loss-only" and not workload.optimizer_in_backward:
        return session.grad_names(config, workload, parallel, layers, kernels)
    return None


# a loop's ticks are keyed LOOP_INDEX x (the loop's ordinal in its group + 1) + their place in their
# iteration: apart from every other tick's index, and the same however many images (iterations) the step has
LOOP_INDEX = 1 << 40
# a pinned iteration's ticks (tracer.time_loop.PINNED: the first iterations backward runs of a loop over time) are
# keyed apart from each other: PINNED_INDEX x (the iteration + 1) + their place in it, inside their loop's range
PINNED_INDEX = 1 << 30
MAX_OPTIMIZER_TICKS = 32   # an optimizer step with at most this many ticks keys each (tracer.extend.optional)


def _stage_of_ticks(tl) -> list[tuple[int, int, str, int]]:
    """(first tick, last tick, stage, window ordinal) per stage window, in order."""
    out, prev, seen = [], 0, {}
    for t, st in tl.marks:
        seen[st] = seen.get(st, 0) + 1
        out.append((prev + 1, t, st, seen[st]))
        prev = t
    return out


def _candidates(tl, train: bool, per_window: bool = False) -> Ticks:
    """The ticks that can hold a peak, keyed (stage, segment, layer block, index). Repeated windows of a stage (the
    micro-batches of a step) share their keys, so a fit keeps the last one's; `per_window` (a pipeline schedule,
    whose micro-batches hold different numbers of others in flight) numbers the ticks across the windows instead,
    so each window's are kept."""
    live = tl.live()                                    # (tracer categories, T + 1)
    T = len(tl.kind) - 1
    block = per_tick(tl.blocks, T + 2)
    it = per_tick(tl.loops, T + 2)   # the iteration of a per-image loop running at each tick (-1: none)
    windows = _stage_of_ticks(tl)
    if train:  # the steady state: the last step (its micro-batches and its optimizer step)
        opt_ends = [i for i, w in enumerate(windows) if w[2] == "optimizer"]
        start = opt_ends[-2] + 1 if len(opt_ends) >= 2 else 1
        keep = [windows[0]] + windows[start:]
    else:
        keep = windows
    keys, gs, rows = [], [], []
    counts: dict = {}   # per stage: (segment, previous block, index per group), carried across windows if per_window
    act = TRACER_CATEGORIES.index("activations")
    for lo, hi, stage, ordinal in keep:
        g = ordinal if stage == "decode" and ordinal >= 2 else 0
        if stage == "decode" and ordinal == 1:
            stage = "decode1"
        if stage == "load":
            keys.append(("load", 0, None, 0))
            gs.append(0)
            rows.append(tick_row(live[:, hi], 0))
            continue
        ticks = [t for t in range(lo, hi + 1) if tl.kind[t] == 1 and
                 (t == hi or tl.kind[t + 1] == -1 or block[t + 1] != block[t])]
        if stage == "optimizer":  # the step's temporaries differ between its ticks by constants: keep the largest
            # the stage's entry counts too, as the counter's stage peak does (counters.mark_stage): a step that
            # allocates nothing (plain SGD) peaks there, its gradients still alive
            base = live[act, lo - 1]
            t = max([lo - 1, *ticks], key=lambda t: int(live[:, t].sum()))
            keys.append(STEP_MAX)
            gs.append(0)
            rows.append(tick_row(live[:, t], int(live[act, t] - base)))
            # ... and, where the step has few ticks (a foreach optimizer: one per op, whatever the depth), each of them
            # as an optional key: which is the largest can change with depth (DTensor TP's AdamW: two embedding-sized
            # temporaries lead at 3 layers, the all-parameter sqrt at 8), so the full depth needs every one extended.
            # Where their count changes with depth or size (forloop: one per parameter), the fit and the extension
            # drop them (OPTIONAL) and the largest stands alone, as before.
            if len(ticks) <= MAX_OPTIMIZER_TICKS:
                for i, t in enumerate(ticks):
                    keys.append((*OPTIONAL, None, i))
                    gs.append(0)
                    rows.append(tick_row(live[:, t], int(live[act, t] - base)))
            continue
        if not per_window or stage not in counts:
            counts[stage] = (0, None, {})
        seg, prev_block, local = counts[stage]
        loops: dict = {}   # per group (a decoder layer's block, or a segment outside them): its loops, counted
        prev_it = -1   # the previous tick's iteration
        kept_max, skipped_max = {}, {}   # per pinned loop: the largest total of its kept ticks, of its dropped ones
        opened: set = set()   # groups whose loop began with dropped iterations (its first pinned one opens no other)
        iter_max: dict = {}   # per loop kept by its last iteration: each iteration's largest total
        for t in ticks:
            b = None if block[t] < 0 else int(block[t])
            if b is None and prev_block is not None:
                seg += 1
            prev_block = b
            group = (stage, seg if b is None else 0, b)
            i = int(it[t])
            if i == time_loop.SKIP:   # an iteration after the second to run of a loop whose first two hold the most
                if prev_it == -1:   # a loop whose first iterations are dropped (MiniMax's forward: all but the last
                    loops[group] = loops.get(group, -1) + 1   # two, which it pins)
                    opened.add(group)
                prev_it = i
                loop = (group, loops.get(group, -1))
                skipped_max[loop] = max(skipped_max.get(loop, 0), int(live[:, t].sum()))
                continue
            if i >= time_loop.PINNED:   # a pinned iteration (0, 1, ... to run): keyed by itself and its place in it
                j = i - time_loop.PINNED
                if j == 0 and prev_it != i and not (prev_it == time_loop.SKIP and group in opened):
                    loops[group] = loops.get(group, -1) + 1
                opened.discard(group)
                prev_it = i
                n = loops.get(group, 0)
                kept_max[(group, n)] = max(kept_max.get((group, n), 0), int(live[:, t].sum()))
                inner = (*group, "loop", n, i)
                local[inner] = local.get(inner, -1) + 1
                keys.append((*group, LOOP_INDEX * (n + 1) + PINNED_INDEX * (j + 1) + local[inner]))
                gs.append(g)
                rows.append(tick_row(live[:, t], 0))
                continue
            if i >= 0:   # a loop's ticks: keyed by their place in their iteration (the last iteration's are kept)
                if i == 0 and prev_it != 0:
                    loops[group] = loops.get(group, -1) + 1
                prev_it = i
                n = loops.get(group, 0)
                total = int(live[:, t].sum())
                iter_max.setdefault((group, n), {})[i] = max(iter_max.get((group, n), {}).get(i, 0), total)
                inner = (*group, "loop", n, i)
                local[inner] = local.get(inner, -1) + 1
                keys.append((*group, LOOP_INDEX * (n + 1) + local[inner]))
                gs.append(g)
                rows.append(tick_row(live[:, t], 0))
                continue
            prev_it = -1
            local[group] = local.get(group, -1) + 1
            keys.append((*group, local[group]))
            gs.append(g)
            rows.append(tick_row(live[:, t], 0))
        for k, per in iter_max.items():   # the last iteration, which the profile keeps, holds the most
            last = max(per)
            if max(per.values()) > per[last]:
                raise ValueError(f"fit: an earlier iteration of a loop in {stage} holds {max(per.values())} B, more than "
                                 f"its last ({per[last]} B), which the profile keeps (tracer.ticks); its memory is not "
                                 "priced")
        for k, most in skipped_max.items():
            if most > kept_max.get(k, 0):
                raise ValueError(f"fit: a later iteration of a loop over time steps in {stage} holds {most} B, more than "
                                 f"the first iteration to run ({kept_max.get(k, 0)} B), which the profile keeps "
                                 "(tracer.time_loop); its memory is not priced")
        counts[stage] = (seg + 1 if per_window else seg, None, local)
    keys, gs, rows = _last_iterations(keys, gs, rows)
    return Ticks(keys, gs, np.array(rows, dtype=np.int64).reshape(len(rows), len(CATEGORIES)))


def _last_iterations(keys: list, gs: list, rows: list) -> tuple[list, list, list]:
    """A per-image loop's ticks, only its last iteration's of each key: the same keys at any number of images. The
    iterations differ by the images done before (their outputs, in forward; their gradients, in backward), which only
    grow, so the last iteration's tick is the largest of its key; it is one polynomial in the sizes where the
    iteration count is (batch x images)."""
    seen, keep = set(), []
    for i in range(len(keys) - 1, -1, -1):
        k = keys[i]
        if isinstance(k[-1], int) and k[-1] >= LOOP_INDEX:
            if (k, gs[i]) in seen:
                continue
            seen.add((k, gs[i]))
        keep.append(i)
    keep.reverse()
    return [keys[i] for i in keep], [gs[i] for i in keep], [rows[i] for i in keep]
