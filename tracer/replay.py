"""A traced step replayed under another knob's rules, instead of traced again (issue "Exact and instant").

`accumulating`: gradient accumulation. A step of grad_accum >= 2 runs its micro-batches one after another, and from
the second on every trained parameter's gradient is already there: torch's AccumulateGrad adds each new gradient into
it in place (`variable_grad += new_grad`, torch/csrc/autograd/functions/accumulate_grad.h) and the new one dies when
the node returns, where the first micro-batch's node keeps it as `.grad` (it steals the tensor, or copies it where
it cannot). So the steady step of grad_accum 2 is the steady step of grad_accum 1 with one more forward and backward
spliced in before the optimizer step: a copy of the last forward and backward in which each stolen gradient is a
temporary freed right after its node ran (and each copied one is not made at all). The counter records where each
node ran (`StorageCounter.watch_grads`); the replay rebuilds the timeline event by event, and
`tracer.ticks._candidates` reads it like a traced one. Every grad_accum >= 2 is one class (estimator.store
.GRAD_ACCUM_CLASS): the last micro-batch holds the most, and all but the first look alike.

What it covers: one GPU (no gradient hooks of FSDP, DDP or a pipeline), the optimizer stepped after backward, no
activation offloading (its hooks keep autograd nodes across steps) and torch.compile's graphs (whose AccumulateGrad runs
where the compiled backward puts it): `replayable` says which. tests/test_replay.py compares replayed and traced
grad_accum 2 steps tick by tick.
"""
from __future__ import annotations

import numpy as np

from estimator.spec import Parallel, Workload
from tracer.counters import CATEGORIES, Timeline, per_tick

ACTIVATIONS = CATEGORIES.index("activations")


def replayable(workload: Workload, parallel: Parallel) -> str:
    """Why this class's grad_accum 2 step cannot be replayed from its grad_accum 1 timeline ("" where it can)."""
    if workload.mode != "train":
        return "an inference run has no gradients"
    if parallel.strategy not in ("single", "ddp"):   # DDP's one memory effect is its static buckets (tracer.session)
        return f"strategy {parallel.strategy}: its gradient hooks (reduce-scatter, all-reduce) are not replayed"
    if workload.optimizer_in_backward:
        return "optimizer_in_backward: the gradients die in backward"
    if workload.activation_offload:
        return "activation_offload: its hooks keep autograd nodes alive across micro-batches"
    if workload.compile:
        return "compile: the compiled backward places its gradient accumulation itself"
    if workload.grad_accum != 1:
        return "grad_accum: the replay starts from a step of grad_accum 1"
    return ""


def probed_step_refusal(workload: Workload) -> str:
    """Why a step without checkpointing cannot carry a checkpointing replay ("" where it can): what full
    (tracer.recompute) and selective (tracer.selective) checkpointing's replays both need of the traced step, a
    training step of grad_accum 1 without checkpointing whose probe forward runs as the checkpointed one would."""
    if workload.mode != "train":
        return "an inference run has no backward"
    if workload.checkpointing != "none":
        return "checkpointing: the replay starts from a step without checkpointing"
    if workload.loop != "loss-only":
        return "loop: the previous step's output is alive into the probe forward"
    if workload.activation_offload:
        return "activation_offload: its own saved-tensor hooks"
    if workload.compile:
        return "compile: the compiled graph saves what it chooses"
    if workload.images or workload.audios:
        return "images, audio: the per-item loops of a multimodal step"
    if workload.grad_accum != 1:
        return "grad_accum: the replay starts from a step of grad_accum 1"
    return ""


def _carried(entries: tuple, T: int, start: int, bwd: int) -> tuple[np.ndarray, np.ndarray]:
    """(each tick's value as traced, each tick's value in the copy of ticks start+1..bwd run again after bwd)."""
    traced = per_tick(entries, T + 2)
    again = traced.copy()
    first = min((t for t, _ in entries if start <= t <= bwd), default=bwd + 1)   # the copy's own first entry
    again[start + 1:first + 1] = traced[bwd + 1]
    return traced, again


def entries(values: list[int]) -> tuple:
    """(tick, value) entries that give `values` back through counters.per_tick: one wherever the value changes."""
    out, prev = [], -1
    for i, v in enumerate(values):
        if v != prev:
            out.append((i - 1, None if v == -1 else int(v)))
            prev = v
    return tuple(out)


def accumulating(tl: Timeline, accumulations: list[tuple[int, int, int]]) -> Timeline:
    """The timeline of a grad_accum 2 step, from a traced grad_accum 1 run whose counter watched its gradients: the
    last step's forward and backward run twice, the second time accumulating into the first's gradients."""
    names = [m[1] for m in tl.marks]
    if len(names) < 4 or names[-3:] != ["forward", "backward", "optimizer"]:
        raise ValueError(f"replay: the run does not end in forward, backward, optimizer ({', '.join(names[-3:])})")
    start, fwd, bwd = tl.marks[-4][0], tl.marks[-3][0], tl.marks[-2][0]
    T = len(tl.kind) - 1
    steal, skip = {}, set()   # tick after which a stolen gradient dies; allocation ticks of copied ones
    alloc_tick = {}
    for t in range(start + 1, bwd + 1):
        if tl.kind[t] == 1:
            alloc_tick[int(tl.rec[t])] = t
    for tick, handed, kept in accumulations:
        if not start < tick <= bwd:
            continue
        if handed < 0 or kept < 0 or kept not in alloc_tick:
            raise ValueError("replay: a gradient accumulation whose tensors the counter did not see")
        if handed == kept:
            steal.setdefault(tick, []).append(kept)
        else:
            skip.add(alloc_tick[kept])
    # the new run as original ticks (the copy's marked), with the frees to insert as (None, record)
    order: list[tuple[int | None, int, bool]] = [(t, -1, False) for t in range(bwd + 1)]
    copy_at = {}
    for t in range(start + 1, bwd + 1):
        if t not in skip:
            copy_at[t] = len(order)
            order.append((t, -1, True))
        for rec in steal.get(t, ()):
            order.append((None, rec, True))
    copy_end = len(order) - 1
    copy_fwd = max((copy_at[t] for t in copy_at if t <= fwd), default=bwd)
    order += [(t, -1, False) for t in range(bwd + 1, T + 1)]
    n = len(order)
    kind = np.zeros(n, dtype=np.int8)
    nbytes = np.zeros(n, dtype=np.int64)
    cat = np.zeros(n, dtype=np.int8)
    rec = np.full(n, -1, dtype=np.int64)
    stolen = {r for recs in steal.values() for r in recs}
    n_rec = int(tl.rec.max()) + 1 if len(tl.rec) else 0
    size_of = {int(tl.rec[t]): int(tl.nbytes[t]) for t in alloc_tick.values()}
    # the copy runs on from where the first pass left off: until the copy sets a block (a layer) or a loop of its
    # own, its ticks carry the state at the end of the backward before it (a frozen embedding has no gradient
    # hook to close the last layer's block: a second micro-batch's embedding runs in layer 0's)
    block_old, loop_old = _carried(tl.blocks, T, start, bwd), _carried(tl.loops, T, start, bwd)
    blocks, loops = [], []
    for i, (t, r, copied) in enumerate(order):
        if t is None:   # a stolen gradient's copy dies as its node returns
            kind[i], nbytes[i], cat[i], rec[i] = -1, size_of[r], ACTIVATIONS, r + n_rec
            blocks.append(blocks[-1])
            loops.append(loops[-1])
            continue
        kind[i], nbytes[i], cat[i], rec[i] = tl.kind[t], tl.nbytes[t], tl.cat[t], tl.rec[t]
        if copied:
            rec[i] = tl.rec[t] + n_rec if tl.rec[t] >= 0 else -1
            if tl.kind[t] == 1 and int(tl.rec[t]) in stolen:
                cat[i] = ACTIVATIONS   # handed to AccumulateGrad and added in: never a .grad
        blocks.append(int(block_old[1][t] if copied else block_old[0][t]))
        loops.append(int(loop_old[1][t] if copied else loop_old[0][t]))
    marks = [m for m in tl.marks if m[0] <= bwd]
    marks += [(copy_fwd, "forward"), (copy_end, "backward")]
    shift = copy_end - bwd
    marks += [(m[0] + shift, m[1]) for m in tl.marks if m[0] > bwd]
    return Timeline(kind, nbytes, cat, rec, tuple(marks), entries(blocks), entries(loops))


def keyed(ticks) -> dict:
    """Ticks (tracer.extend.Ticks) as the fit reads them: {(key, decode window): bytes per category}, a key repeated
    over micro-batches keeping its last value."""
    return {(k, g): tuple(int(x) for x in v) for k, g, v in zip(ticks.keys, ticks.gs, ticks.values)}


def check(replayed, traced, point: tuple, kind: str = "grad_accum") -> None:
    """A replayed step against a traced step of its class (tracer.extend.Ticks of each; `kind`: which replay,
    tracer.derive.SIBLINGS), key by key (`keyed`); ValueError (one line) at the first key that differs."""
    got, want = keyed(replayed), keyed(traced)
    if got != want:
        what = {"grad_accum": "step of grad_accum 2", "checkpointing": "step under full checkpointing",
                "selective": "step under selective checkpointing"}[kind]
        key = next(k for k in sorted(set(got) | set(want), key=str) if got.get(k) != want.get(k))
        raise ValueError(f"replay: at (b, s, n, r) = {point} the replayed {what} reads {got.get(key)} B "
                         f"at {key[0]}, a traced one {want.get(key)} B; the replay is not exact here")
