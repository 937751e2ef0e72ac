"""Full activation checkpointing replayed from a step traced without it (issue "Exact and instant").

What torch's non-reentrant checkpoint (torch/utils/checkpoint.py; transformers 5.23's `gradient_checkpointing_enable`
runs it with `use_reentrant=False`, early stop on) changes in a step, layer by layer, and where this module reads it:

- forward: each checkpointed layer's ops save holders, not tensors (`_checkpoint_hook`), so every tensor the layer
  makes dies when its last Python reference does; the layer's inputs stay alive (the frame's `saved_args`, its keyword
  arguments in the `partial` the frame recomputes). A step traced without checkpointing cannot see those deaths (its
  saved tensors are alive), so the trace runs one more forward after its step, the *probe*, in which each layer's
  ops save nothing and the layer's arguments are held (`probe`): its ticks are the checkpointed forward's.
- backward: the first unpack of any of layer i's holders recomputes layer i's forward (`_recomputation_hook`), its
  saved tensors kept in the frame, the rest dying as in the forward without checkpointing; the recompute stops at
  the pack of the last tensor the layer saved (`_StopRecomputationError`) and the unwinding frees everything else it
  made. A recomputed tensor dies where the last node that reads it is done with it (the end of that node's `apply`,
  before the engine sums a broadcast gradient and before the node releases what it saved; one no node reads, where
  its holder dies), and a layer's arguments die with its frame (where the last node holding one of the layer's
  holders lets go). The trace records every pack (tick, record, layer), unpack, end of use and release (`watching`),
  and `checkpointed` splices each layer's recompute, the traced forward's ticks of that layer up to its last pack, in
  at its first unpack.

The same replay serves selective checkpointing, the attention call as the checkpointed unit instead of the layer
(tracer.selective; `checkpointed(..., unit="attention")`): a unit's output may outlive it there (`outlives`), the
events of one tick are replayed in the order they happened (`Saves.clock`), and a unit's arguments die last first.

What it covers (`replayable`): one GPU or DDP, full fine-tuning (under checkpointing transformers makes a LoRA model's
embedding output require a gradient, a backward the step without it never runs), checkpointing none asked (the
replay gives full), the loss-only loop, no offload, compile, images or audio (the optimizer may step in backward); the probe
refuses a model without decoder layers and one whose layers hold checkpointed blocks of their own (nested
checkpoints). A derivation checks the replayed class against one traced step of full checkpointing (tracer.derive,
as for gradient accumulation), so a model whose checkpointing differs from this reading is traced, not replayed.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from estimator.spec import Parallel, Workload
from tracer import replay, runner, selective
from tracer.counters import StorageCounter, Timeline, per_tick
from tracer.depth import all_layers

PROBE = "probe"   # the stage name of the probe forward (dropped from the traced timeline)
PROBES = (PROBE, selective.PROBE)


@dataclass
class Saves:
    """What autograd saved in a traced step: `packs` (tick, record, layer or None, attention call or None) per saved
    tensor, `unpacks` (tick, pack) per unpack in backward, and the probe forwards' ticks (first, last). `want`: which
    units are checkpointed in the replays asked for ("layers": full, here; "attention": selective, tracer.selective),
    each a probe of its own."""

    want: tuple = ("layers",)
    packs: list = field(default_factory=list)
    unpacks: list = field(default_factory=list)   # (tick, pack, event)
    applied: list = field(default_factory=list)   # (tick, pack, event) where the unpacked tensor's last reference died
    released: list = field(default_factory=list)  # (tick, pack, event) where autograd let the saved tensor go
    clock: itertools.count = field(default_factory=itertools.count)   # orders events of one tick (`event`)
    held: list = field(default_factory=list)      # (layer, record) per tensor argument of a layer in the probe
    starts: list = field(default_factory=list)    # (tick, layer) where a layer's own forward starts (watch_layers)
    probe: tuple[int, int] | None = None
    refused: str = ""   # why the probe did not run
    regions: list = field(default_factory=list)         # [first tick, last tick, layer] per attention call
    region: int | None = None                          # the attention call running now (tracer.selective.watch)
    held_attention: list = field(default_factory=list)  # (call, record) per tensor argument in the attention probe
    probe_attention: tuple[int, int] | None = None


def replayable(workload: Workload, parallel: Parallel) -> str:
    """Why this class's full-checkpointing step cannot be replayed from its step without checkpointing ("" where it
    can)."""
    why = replay.probed_step_refusal(workload)
    if why:
        return why
    if parallel.strategy not in ("single", "ddp"):   # DDP's gradient hooks run alike with and without checkpoints
        return f"strategy {parallel.strategy}: its hooks around each layer (unshard, reshard) are not replayed"
    if workload.method != "full":
        return (f"method {workload.method}: under checkpointing transformers makes the embeddings' output require a "
                "gradient (enable_input_require_grads), which the step without it never computes")
    return ""


@contextlib.contextmanager
def watching(counter: StorageCounter, saves: Saves, model=None):
    """Record every tensor autograd saves and every unpack (torch.autograd.graph.saved_tensors_hooks). The pack keeps a
    detached alias (the same storage, no autograd history: returning a saved output itself would make a reference
    cycle, freed only by the collector the tracer turns off), so storages live exactly as without the hooks. With
    "attention" in `saves.want`, `model`'s attention calls are watched too (tracer.selective.watch)."""

    def pack(x):
        block, region = counter.block(), saves.region
        saves.packs.append((counter.now, counter.record_of(x), block, region))
        if x.is_leaf and x.requires_grad:   # a parameter: no history to cycle through, made before the forward
            held = _Held(x, len(saves.packs) - 1, False)
        else:
            with counter.paused():
                # a stand-in on unpack only where a replay reads its end of use: a checkpointed unit's packs
                unit = region is not None or (block is not None and "layers" in saves.want)
                held = _Held(x.detach(), len(saves.packs) - 1, unit)
        weakref.finalize(held, _note, counter, saves.released, held.i, saves.clock).atexit = False
        return held

    def unpack(held):
        saves.unpacks.append((counter.now, held.i, next(saves.clock)))
        if not held.recomputed or held.x.untyped_storage().nbytes() % held.x.element_size():
            return held.x   # (a storage no whole number of elements fills: no stand-in of its size; read as released)
        # a stand-in with a storage of its own (counted as the saved one's): it dies where the node that asked for it
        # lets it go, at the end of its apply, before the engine's own work on the node's outputs (a broadcast
        # gradient's sum) and the node's release of what it saved; a recomputed tensor dies there under checkpointing
        x = held.x
        with counter.paused():
            # as large as the saved tensor's storage (a view's included), so the counter sees no resize
            flat = torch.empty(x.untyped_storage().nbytes() // x.element_size(), dtype=x.dtype, device=x.device)
            stand_in = flat.as_strided(x.shape, x.stride(), x.storage_offset())
            del flat
        counter.alias(stand_in, x)
        weakref.finalize(stand_in.untyped_storage(), _note, counter, saves.applied, held.i, saves.clock).atexit = False
        return stand_in

    calls = selective.watch(model, counter, saves) if "attention" in saves.want else contextlib.nullcontext()
    with calls, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def watch_layers(model, counter: StorageCounter, saves: Saves) -> list:
    """Record where each decoder layer's own forward starts: a pre-hook after every other (FSDP2's unshard among
    them), since a checkpoint recomputes the layer's `forward`, not its module hooks. Returns the hook handles."""
    try:
        layers = all_layers(model)
    except ValueError:
        return []
    handles = []
    for pos, layer in enumerate(layers):
        def pre(module, args, pos=pos):
            saves.starts.append((counter.now, pos))
        handles.append(layer.register_forward_pre_hook(pre))
    return handles


class _Held:
    """What a pack hands autograd: the saved tensor (a detached alias), its pack's number, and whether a checkpointed
    layer's recompute would make it again (saved inside a layer, not a leaf)."""

    __slots__ = ("x", "i", "recomputed", "__weakref__")

    def __init__(self, x, i, recomputed):
        self.x, self.i, self.recomputed = x, i, recomputed


def _note(counter, into, i, clock):
    into.append((counter.now, i, next(clock)))


def _drop(x):
    return None


def _never(held):
    raise RuntimeError("recompute: the probe forward has no backward")


def probe(case, counter: StorageCounter, saves: Saves) -> None:
    """The probes `saves.want` asks for, after the traced step: the layers' (`probe_layers`), the attention calls'
    (tracer.selective.probe)."""
    if "layers" in saves.want:
        as_forward_began(counter)
        probe_layers(case, counter, saves)
    if "attention" in saves.want:
        as_forward_began(counter)
        selective.probe(case, counter, saves)


def as_forward_began(counter: StorageCounter) -> None:
    """Put the counter in the block the traced forward began in (a LoRA step's backward leaves the first layer's
    block open: its input needs no gradient, whose hook would close it; session._observe_layers)."""
    i = max(k for k, (_, stage) in enumerate(counter.marks) if stage == "forward")
    began = counter.marks[i - 1][0]
    counter.set_block(next((b for t, b in reversed(counter.blocks) if t <= began), None))


def probe_layers(case, counter: StorageCounter, saves: Saves) -> None:
    """The probe: one more forward after the traced step, each layer's ops saving nothing (as under a checkpoint's
    holders) and each layer's tensor arguments held to the end (the frame's saved inputs and keyword arguments)."""
    held, entered = [], {}

    def pre(module, args, kwargs):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        held.append(tensors)
        saves.held.extend((positions[id(module)], counter.record_of(t)) for t in tensors)
        ctx = torch.autograd.graph.saved_tensors_hooks(_drop, _never)
        ctx.__enter__()
        entered[id(module)] = ctx

    def post(module, args, output):
        entered.pop(id(module)).__exit__(None, None, None)

    try:
        layers = all_layers(case.model)
    except ValueError as e:   # no decoder layers (a convolutional vision model, XLM): nothing checkpoints layer by layer
        saves.refused = f"recompute: {e}"
        return
    if any(hasattr(m, "gradient_checkpointing") for layer in layers for m in layer.modules() if m is not layer):
        # a checkpointed block inside a layer (Zamba's shared transformer): checkpoints nest
        saves.refused = "recompute: a layer holds a checkpointed block of its own (nested checkpoints are not replayed)"
        return
    handles = []
    positions = {id(layer): pos for pos, layer in enumerate(layers)}
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post))
    first = counter.now
    try:
        loss = runner.forward_loss(case.model, case.workload, case.inputs)
        counter.mark_stage(PROBE)
        saves.probe = (first, counter.now)
        del loss
        held.clear()
    finally:
        for ctx in entered.values():
            ctx.__exit__(None, None, None)
        for h in handles:
            h.remove()


def traced_part(tl: Timeline) -> Timeline:
    """The timeline without the probes (the traced step as if no probe ran)."""
    n = len(tl.marks)
    while n and tl.marks[n - 1][1] in PROBES:
        n -= 1
    if n == len(tl.marks):
        return tl
    end = tl.marks[n - 1][0]
    return Timeline(tl.kind[:end + 1], tl.nbytes[:end + 1], tl.cat[:end + 1], tl.rec[:end + 1], tl.marks[:n],
                    tuple(e for e in tl.blocks if e[0] < end), tuple(e for e in tl.loops if e[0] < end))


def checkpointed(tl: Timeline, saves: Saves, unit: str = "layers") -> Timeline:
    """The timeline of the same step with every layer checkpointed (full; `unit` "attention": every attention call,
    selective, tracer.selective), from a traced step without checkpointing whose counter watched its saves and ran
    that unit's probe; ValueError (one line) where the step is not one this reading covers."""
    if saves.refused and unit == "layers":
        raise ValueError(saves.refused)
    names = [m[1] for m in tl.marks]
    n = len(names)
    while n and names[n - 1] in PROBES:
        n -= 1
    if n < 4 or names[n - 3:n] != ["forward", "backward", "optimizer"] or n == len(names):
        raise ValueError("recompute: the run does not end in forward, backward, optimizer and the probe")
    if tl.loops:
        raise ValueError("recompute: a step with a per-item loop is not replayed")
    start, fwd, bwd, opt = (m[0] for m in tl.marks[n - 4:n])
    T = len(tl.kind) - 1
    block = per_tick(tl.blocks, T + 2)
    if unit == "layers":
        if saves.probe is None:
            raise ValueError("recompute: the layer probe did not run")
        packs, ublock, layer_of = [p[:3] for p in saves.packs], block, None
        begin_at, held_of, (p_lo, p_hi) = None, saves.held, saves.probe
    else:
        packs, ublock, layer_of, begin_at, held_of, (p_lo, p_hi) = selective.units(tl, saves, start, fwd, block)

    def allocs(lo, hi):
        return [t for t in range(lo + 1, hi + 1) if tl.kind[t] == 1]

    f_alloc, p_alloc = allocs(start, fwd), allocs(p_lo, p_hi)
    if [int(tl.nbytes[t]) for t in f_alloc] != [int(tl.nbytes[t]) for t in p_alloc]:
        raise ValueError("recompute: the probe forward allocates other tensors than the traced forward")
    rename = {int(tl.rec[p]): int(tl.rec[f]) for f, p in zip(f_alloc, p_alloc)}
    # frees in each window of records made before it, paired in order
    f_made = {int(tl.rec[t]) for t in f_alloc}
    # (an empty storage's record, closed as FSDP2 gives an unsharded parameter its bytes back, is no free: after a
    # step its storages sit at 0 bytes, before the first forward the counter had not seen them)
    f_old = [t for t in range(start + 1, fwd + 1) if tl.kind[t] == -1 and int(tl.rec[t]) not in f_made and tl.nbytes[t]]
    p_old = [t for t in range(p_lo + 1, p_hi + 1) if tl.kind[t] == -1 and int(tl.rec[t]) not in rename and tl.nbytes[t]]
    empty = {t for t in range(p_lo + 1, p_hi + 1) if tl.kind[t] == -1 and int(tl.rec[t]) not in rename and
             not tl.nbytes[t]}
    if any(tl.kind[t] == -1 and int(tl.rec[t]) not in f_made and not tl.nbytes[t] for t in range(start + 1, fwd + 1)):
        empty = set()   # the traced forward closes empty records too: the probe's are its own, kept
    if [int(tl.nbytes[t]) for t in f_old] != [int(tl.nbytes[t]) for t in p_old]:
        raise ValueError("recompute: the probe forward frees other tensors made before it than the traced forward")
    old_rename = {int(tl.rec[p]): int(tl.rec[f]) for f, p in zip(f_old, p_old)}
    alloc_at = {int(tl.rec[t]): t for t in f_alloc}
    rec_block = {r: int(ublock[t]) for r, t in alloc_at.items()}
    p_freed = {rename.get(int(tl.rec[t])) for t in range(p_lo + 1, p_hi + 1) if tl.kind[t] == -1}
    alive_after = f_made - p_freed
    packed: dict[int, set] = {}
    stop: dict[int, int] = {}
    for tick, rec, blk in packs:
        if not start < tick <= fwd or blk is None:
            continue
        packed.setdefault(blk, set()).add(rec)
        stop[blk] = max(stop.get(blk, 0), tick)
    n_rec = int(tl.rec.max()) + 1 if len(tl.rec) else 0
    copied: dict[int, set] = {}
    outlives = set()   # made and saved in a unit, alive after the checkpointed forward (an attention call's output)
    for blk, recs in packed.items():
        for r in recs:
            if r in f_made and rec_block[r] == blk:
                if r in alive_after:
                    outlives.add(r)
                copied.setdefault(blk, set()).add(r)
            elif r in f_made and r not in alive_after:
                raise ValueError(f"recompute: a tensor made outside layer {blk} that it saves dies in the "
                                 "checkpointed forward")
    all_copied = {r for recs in copied.values() for r in recs}
    # where things happen in backward: (tick, event), the event ordering those of one tick
    applied: dict[int, tuple] = {}
    for tick, i, n in saves.applied:
        applied[i] = max(applied.get(i, (0, -1)), (tick, n))
    released = {i: (tick, n) for tick, i, n in saves.released}
    window = [(i, rec, b) for i, (tick, rec, b) in enumerate(packs) if start < tick <= fwd]
    packs_of: dict[int, list] = {}   # per record: its packs in the traced forward, (pack, layer or None)
    for i, rec, b in window:
        packs_of.setdefault(rec, []).append((i, b))
    frame = {}   # per layer: where its checkpoint frame would die (the last node holding one of its holders lets go)
    for i, rec, b in window:
        if b is not None:
            if i not in released:
                raise ValueError(f"recompute: a tensor layer {b} saves is never let go in backward")
            frame[b] = max(frame.get(b, (0, -1)), released[i])
    begin: dict[int, int] = {}   # per layer: the tick its own forward starts after, in the traced forward
    for tick, pos in saves.starts:
        if start <= tick <= fwd:
            begin.setdefault(pos, tick)
    if begin_at is not None:
        begin = begin_at
    first_unpack: dict[int, tuple] = {}
    for tick, i, n in saves.unpacks:
        if fwd < tick <= bwd:
            blk = packs[i][2]
            if blk is not None:   # where layer blk's recompute runs (none where backward reads nothing it saved)
                first_unpack[blk] = min(first_unpack.get(blk, (tick, n)), (tick, n))

    def holds(i, blk):
        """Until which tick the recompute's copy of pack i is held: to the end of the node that unpacks it; one no
        node reads, until its holder dies (the frame's dict is keyed weakly by it); none where the holder died before
        the recompute (a node freed in forward: its pack is not stored)."""
        if i in applied:
            return applied[i]
        return released[i] if blk in first_unpack and released[i] > first_unpack[blk] else None

    dies: dict[int, list] = {}   # tick after which a record dies in the checkpointed step: (event, record, traced)
    kept: dict[int, set] = {}
    for blk, recs in copied.items():
        for r in recs:
            ticks = [t for t in (holds(i, blk) for i, b in packs_of[r] if b == blk) if t is not None]
            if ticks:
                kept.setdefault(blk, set()).add(r)
                t, n = max(ticks)
                dies.setdefault(t, []).append((n, n_rec + r, r))
    for r in sorted(outlives):   # the original lives as long as what holds it outside its unit (the copy is the unit's)
        ticks = [released.get(i) if b is None else holds(i, b) for i, b in packs_of[r] if b != rec_block[r]]
        if not [t for t in ticks if t is not None]:
            raise ValueError(f"recompute: a tensor unit {rec_block[r]} saves outlives the checkpointed forward, held "
                             "by nothing the replay reads")
        t, n = max(t for t in ticks if t is not None)
        dies.setdefault(t, []).append((n, r, r))
    held_by: dict[int, set] = {}
    for pos, r in held_of:
        r = rename.get(r, r)
        if r in f_made:
            held_by.setdefault(r, set()).add(pos)
    # a unit's argument: its frame's, and what else holds it as without checkpoints; those its frame lets go die last
    # one first (the frame's `saved_args` is a list, which CPython frees from the last item; the keyword arguments in
    # its `recompute_fn` closure go before it)
    for r, layers in reversed(held_by.items()):
        if r in all_copied or not layers <= set(frame):
            raise ValueError("recompute: a layer's argument the replay cannot place")
        ticks = [frame[b] for b in layers]
        ticks += [released.get(i) if b is None else holds(i, b) for i, b in packs_of.get(r, ())]
        t, n = max(t for t in ticks if t is not None)
        dies.setdefault(t, []).append((n, r, r))
    moved = all_copied | {r for recs in dies.values() for _, _, r in recs}
    out = []   # (kind, nbytes, cat, rec, block)

    def emit(t, rec=None, blk=None):
        out.append((int(tl.kind[t]), int(tl.nbytes[t]), int(tl.cat[t]), int(tl.rec[t]) if rec is None else rec,
                    int(block[t]) if blk is None else blk))

    for t in range(1, start + 1):
        emit(t)
    # the checkpointed forward: the probe's ticks as the traced forward's records, in their roles (a gradient a fused
    # loss makes in forward is one only where a backward follows)
    cat_of = {int(tl.rec[t]): int(tl.cat[t]) for t in range(start + 1, fwd + 1)}
    for t in (t for t in range(p_lo + 1, p_hi + 1) if t not in empty):
        r = rename.get(int(tl.rec[t]), old_rename.get(int(tl.rec[t]), int(tl.rec[t])))
        out.append((int(tl.kind[t]), int(tl.nbytes[t]), cat_of.get(r, int(tl.cat[t])), r, int(block[t])))
    fwd_new = len(out)
    at_unpack: dict[int, list] = {}   # per tick: (event, unit) of each unit's recompute, in the order they happen
    for blk, (t, n) in first_unpack.items():
        at_unpack.setdefault(t, []).append((n, None, blk))
    for t in range(fwd + 1, bwd + 1):
        r = int(tl.rec[t])
        if tl.kind[t] == -1 and r in f_made and r not in alive_after and r not in moved:
            raise ValueError("recompute: backward frees a tensor the checkpointed forward does not keep")
        if not (tl.kind[t] == -1 and r in moved):   # those die where `dies` says
            emit(t)
        for _, new, x in sorted(at_unpack.get(t, []) + dies.get(t, []), key=lambda e: e[0]):
            if new is None:   # unit x's recompute, at the first unpack of one of its holders
                _recompute(tl, x, begin.get(x, start), stop[x], ublock, kept.get(x, set()), n_rec, out,
                           x if layer_of is None else layer_of[x])
            else:
                out.append((-1, int(tl.nbytes[alloc_at[x]]), int(tl.cat[alloc_at[x]]), new, int(block[t])))
    bwd_new = len(out)
    for t in range(bwd + 1, opt + 1):
        emit(t)
    opt_new = len(out)
    n = len(out) + 1
    kind = np.zeros(n, dtype=np.int8)
    nbytes = np.zeros(n, dtype=np.int64)
    cat = np.zeros(n, dtype=np.int8)
    rec = np.full(n, -1, dtype=np.int64)
    blocks = [-1]
    for i, (k, b, c, r, blk) in enumerate(out, start=1):
        kind[i], nbytes[i], cat[i], rec[i] = k, b, c, r
        blocks.append(blk)
    marks = tuple(m for m in tl.marks if m[0] <= start) + ((fwd_new, "forward"), (bwd_new, "backward"),
                                                            (opt_new, "optimizer"))
    return Timeline(kind, nbytes, cat, rec, marks, replay.entries(blocks))


def _recompute(tl, blk, start, stop, block, kept, n_rec, out, layer) -> None:
    """Unit `blk`'s recompute in backward, appended to `out` under `layer`'s block: its forward's ticks after `start`
    (where the unit's own forward began) up to the last pack, each record a copy; then every copy it does not keep
    freed (the early stop's unwinding)."""
    alive = {}
    for t in range(start + 1, stop + 1):
        if int(block[t]) != blk:
            continue
        r = int(tl.rec[t])
        if tl.kind[t] == 1:
            alive[r] = t
        elif r in alive:
            del alive[r]
        else:
            continue
        out.append((int(tl.kind[t]), int(tl.nbytes[t]), int(tl.cat[t]), n_rec + r, layer))
    for r, t in sorted(alive.items(), key=lambda x: -x[1]):
        if r not in kept:
            out.append((-1, int(tl.nbytes[t]), int(tl.cat[t]), n_rec + r, layer))
