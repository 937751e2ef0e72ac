"""Allocation counters for traced runs: every live tensor storage, its bytes, and what it is for.

`StorageCounter` is a TorchDispatchMode. Every op's outputs pass through it; each new untyped storage is
recorded once (a view or an in-place result shares its base's storage and is not counted again) with
`storage.nbytes()` bytes, and forgotten when `weakref.finalize` on the storage fires. This is an exact
count of the bytes a caching allocator would be asked for, before its rounding (512-byte blocks on CUDA,
c10/cuda/CUDACachingAllocator.cpp) and before fragmentation; a kernel's private workspace (cuBLAS, the
flash-attention scratch) is not an op output and is not seen.

Categories at the peak, exactly. Every storage lifetime is a record (bytes, alloc time, free time) on a
logical clock that ticks once per allocation or free. Peaks store only their tick. A record's category is
its *role*, learnt at the stage boundaries where the caller classifies what it holds: storages that are
parameters -> "weights", that are some parameter's .grad -> "gradients", in optimizer.state ->
"optimizer_states", in the KV cache -> "kv_cache", buffers and model inputs -> "other"; everything
never classified is "activations" (saved activations and temporaries). The breakdown at a peak is then
the sum over the records live at that tick, grouped by their final role, so a gradient that AccumulateGrad
has not yet attached when the peak happens is still counted as a gradient. Cost: one small record per
storage and one pass over the records per reported peak; no snapshot of the live set at each new peak.

`memtracker_peak_bytes` reads the second, independent counter (torch's MemTracker) the same way, so
tests can check the two agree to the byte.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# "activations" is everything never given another role: saved activations and every temporary (the
# optimizer step's foreach intermediates, FSDP's flat all-gather / reduce-scatter buffers included).
CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "kv_cache", "comm_buffers", "other")
NEVER_FREED = float("inf")
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


@dataclass
class _Role:
    """What one storage is for; shared by all its records, so a late classification covers its past."""

    category: str = "activations"


@dataclass
class _Record:
    """One lifetime of one storage at one size (a resize closes the record and opens a new one)."""

    nbytes: int
    t_alloc: int
    role: _Role
    t_free: float = NEVER_FREED
    index: int = -1     # its place in the counter's records (Timeline.rec)
    aliases: int = 0    # live stand-ins counted as this storage (StorageCounter.alias)
    dead: bool = False  # the storage died while a stand-in lived: the record closes with the last stand-in


@dataclass(frozen=True)
class StagePeak:
    stage: str
    peak_bytes: int
    breakdown: dict           # category -> bytes live at the peak; sums to peak_bytes


@dataclass(frozen=True)
class StageLog:
    """Per-stage peaks (in run order) and the overall peak, each with its breakdown."""

    stages: tuple[StagePeak, ...]
    peak: StagePeak

    def breakdown_json(self) -> dict:
        return {"units": "bytes", "peak": self.peak.breakdown,
                "stages": {s.stage: s.breakdown for s in self.stages}}


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor; DTensor (FSDP2's sharded parameters) holds its local shard."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return [t.untyped_storage()]


class StorageCounter(TorchDispatchMode):
    """Counts live storage bytes; keeps the current total, the peak, and a peak per stage window.

    Use as a context manager around the traced work, `track(...)` tensors that exist before it (weights,
    inputs), and call `mark_stage(name)` at each stage boundary: the stage's peak is the maximum between
    the previous boundary and this one. A stage that repeats (forward of step 1 and step 2) keeps the max.
    """

    def __init__(self) -> None:
        super().__init__()
        self._records: list[_Record] = []
        self._live: dict[int, _Record] = {}       # id(storage) -> its open record
        self._clock = itertools.count(1)
        self._now = 0
        self.current_bytes = 0
        self.peak_bytes = 0
        self._peak_tick = 0
        self._window_bytes = 0
        self._window_tick = 0
        self._stage_ticks: dict[str, tuple[int, int]] = {}   # stage -> (peak bytes, tick)
        self._orig_resize = None
        self._orig_propagate = None
        self._paused = False
        self.marks: list[tuple[int, str]] = []       # (tick, stage) at every mark_stage: the stage that just ended
        self.blocks: list[tuple[int, object]] = []   # (tick, block) whenever the running decoder layer changes
        self.loops: list[tuple[int, int | None]] = []   # (tick, iteration or None) of a loop over images (set_loop)
        self.accumulations: list[tuple[int, int, int]] = []   # (tick, handed, kept) per AccumulateGrad (watch_grads)

    # -- recording --------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._now = next(self._clock)
        return self._now

    def _open(self, st: torch.UntypedStorage) -> _Record:
        rec = _Record(st.nbytes(), self._tick(), _Role(), index=len(self._records))
        self._records.append(rec)
        key = id(st)
        self._live[key] = rec
        # The finalizer holds the key, not the storage; torch keeps one Python object per live storage,
        # so it fires when the storage itself dies.
        fin = weakref.finalize(st, self._close, key, rec)
        fin.atexit = False
        self._grow(rec.nbytes)
        return rec

    def _close(self, key: int, rec: _Record) -> None:
        if self._live.get(key) is rec:
            del self._live[key]
        if rec.aliases:
            rec.dead = True
            return
        if rec.t_free == NEVER_FREED:
            rec.t_free = self._tick()
            self.current_bytes -= rec.nbytes

    def _grow(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        if self.current_bytes > self._window_bytes:
            self._window_bytes, self._window_tick = self.current_bytes, self._now
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes, self._peak_tick = self.current_bytes, self._now

    def _see(self, st: torch.UntypedStorage) -> _Record:
        rec = self._live.get(id(st))
        if rec is None:
            return self._open(st)
        if rec.nbytes != st.nbytes():          # resized in place (aten.resize_, set_, storage.resize_)
            self._resize(st, rec)
            rec = self._live[id(st)]
        return rec

    def _resize(self, st: torch.UntypedStorage, rec: _Record) -> None:
        rec.t_free = self._tick()
        self.current_bytes -= rec.nbytes
        new = _Record(st.nbytes(), self._tick(), rec.role, index=len(self._records))
        self._records.append(new)
        self._live[id(st)] = new
        # A second finalizer closes the new record; the first one will find its record closed already.
        weakref.finalize(st, self._close, id(st), new).atexit = False
        self._grow(new.nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let DTensor desugar into ops on its local tensors first; those come back through here.
        if any(t is DTensor for t in types):
            return NotImplemented
        if func is _WAIT_TENSOR and active_fake_mode() is not None:
            # Eager wait_tensor returns its input; the fake kernel returns a new tensor, which would add
            # a copy of every all-gather that a GPU never makes (MemTracker does the same).
            return args[0]
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        if isinstance(out, torch.Tensor):
            self._see(out.untyped_storage())
        else:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._see(t.untyped_storage())
        return out

    def __enter__(self):
        self._patch_sharding_propagation()
        # FSDP2 frees and re-allocates unsharded parameters with UntypedStorage.resize_, which is not an op.
        self._orig_resize = orig = torch.UntypedStorage.resize_
        counter = self

        def resize_(st, size):
            out = orig(st, size)
            rec = counter._live.get(id(st))
            if rec is not None and rec.nbytes != st.nbytes():
                counter._resize(st, rec)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
        return super().__exit__(*exc)

    def _patch_sharding_propagation(self) -> None:
        """Do not count DTensor's sharding propagation: the first time it meets an op and shape it runs
        the op on global-shape fake tensors, in the active FakeTensorMode, only to read the output's
        shape (torch/distributed/tensor/_sharding_prop.py). Those tensors are not part of the run."""
        self._orig_propagate = orig = ShardingPropagator._propagate_tensor_meta_non_cached
        counter = self

        def propagate(prop, op_schema):
            counter._paused = True
            try:
                return orig(prop, op_schema)
            finally:
                counter._paused = False

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate

    # -- classification ---------------------------------------------------------------------------
    def track(self, tensors, category: str) -> None:
        """Record tensors that already exist (or set the role of tracked ones) under `category`.

        A storage keeps the first role other than "activations" it is given. classify_model gives
        weights first, then gradients, then optimizer state; no PyTorch optimizer stores a parameter or
        a gradient in its state, so in practice no storage is offered two roles.
        """
        if category not in CATEGORIES:
            raise ValueError(f"category: {category!r} is not one of {', '.join(CATEGORIES)}")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for st in _storages(t):
                role = self._see(st).role
                if role.category == "activations":
                    role.category = category

    def classify_model(self, model: torch.nn.Module, optimizer=None) -> None:
        """Give roles to parameters, buffers, gradients and optimizer state that are alive now."""
        params = list(model.parameters())
        self.track(params, "weights")
        self.track(model.buffers(), "other")
        self.track((p.grad for p in params if p.grad is not None), "gradients")
        if optimizer is not None:
            self.track(optimizer_state_tensors(optimizer), "optimizer_states")

    def watch_grads(self, params) -> list:
        """Record each gradient accumulation into a parameter (torch's AccumulateGrad node) as (tick, record of the
        gradient it was handed, record of `.grad` after it): the same record where it stole the tensor (a first
        gradient), another where it copied it. What tracer.replay needs to turn a step into one that accumulates
        onto gradients already there. Returns the hook handles (remove them after the run)."""
        handles = []
        for p in params:
            if not p.requires_grad:
                continue
            handed: list = []

            def pre(g, handed=handed):
                rec = self._live.get(id(g.untyped_storage()))
                handed.append(-1 if rec is None else rec.index)

            def post(p, handed=handed):
                rec = self._live.get(id(p.grad.untyped_storage()))
                self.accumulations.append((self._now, handed.pop() if handed else -1, -1 if rec is None else rec.index))

            handles.append(p.register_hook(pre))
            handles.append(p.register_post_accumulate_grad_hook(post))
        return handles

    @property
    def now(self) -> int:
        """The last tick."""
        return self._now

    def record_of(self, t: torch.Tensor) -> int:
        """The index of the open record of `t`'s storage (Timeline.rec), -1 where the counter has not seen it."""
        rec = self._live.get(id(t.untyped_storage()))
        return -1 if rec is None else rec.index

    def block(self):
        """The block the ticks after now belong to (`set_block`), None outside every block."""
        return self.blocks[-1][1] if self.blocks else None

    def alias(self, t: torch.Tensor, of: torch.Tensor) -> None:
        """Count `t`'s storage as `of`'s (a stand-in tracer.recompute hands autograd): ops on it see `of`'s record,
        which closes when both have died."""
        rec = self._live.get(id(of.untyped_storage()))
        if rec is None:
            return
        st = t.untyped_storage()
        self._live[id(st)] = rec
        rec.aliases += 1
        weakref.finalize(st, self._unalias, id(st), rec).atexit = False

    def _unalias(self, key: int, rec: _Record) -> None:
        """A stand-in died; where the storage it stood in for died first (a backward that hands the tensor it read on,
        e.g. as a gradient), the record closes now, as that tensor itself would have lived until here."""
        if self._live.get(key) is rec:
            del self._live[key]
        rec.aliases -= 1
        if not rec.aliases and rec.dead:
            self._close(key, rec)

    @contextlib.contextmanager
    def paused(self):
        """Ops run inside are not counted (the tracer's own bookkeeping, e.g. tracer.recompute's detached aliases)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    # -- reading ----------------------------------------------------------------------------------
    def set_block(self, block) -> None:
        """Record that the ticks after now belong to `block` (a decoder layer's position, or None outside)."""
        self.blocks.append((self._now, block))

    def set_loop(self, iteration: int | None) -> None:
        """Record that the ticks after now are iteration `iteration` (0, 1, ...) of a loop the model's code runs once
        per image (tracer.vlm_loop) or per time step (tracer.time_loop), or (None) that the loop ended: the loop's
        ticks are keyed by their place in their iteration, so a step with more images (a longer sequence) has the
        same keys (tracer.ticks._candidates). `tracer.time_loop.SKIP`: the ticks after now are dropped (iterations
        that hold less than the first one, which is kept)."""
        self.loops.append((self._now, iteration))

    def timeline(self) -> Timeline:
        """Every tick of the run as arrays (after the run, once roles are final); see `Timeline`."""
        import numpy as np

        n = self._now
        kind = np.zeros(n + 1, dtype=np.int8)
        nbytes = np.zeros(n + 1, dtype=np.int64)
        cat = np.zeros(n + 1, dtype=np.int8)
        rec_of = np.full(n + 1, -1, dtype=np.int64)
        index = {c: i for i, c in enumerate(CATEGORIES)}
        for i, rec in enumerate(self._records):
            c = index[rec.role.category]
            kind[rec.t_alloc], nbytes[rec.t_alloc], cat[rec.t_alloc], rec_of[rec.t_alloc] = 1, rec.nbytes, c, i
            if rec.t_free != NEVER_FREED:
                t = int(rec.t_free)
                kind[t], nbytes[t], cat[t], rec_of[t] = -1, rec.nbytes, c, i
        return Timeline(kind, nbytes, cat, rec_of, tuple(self.marks), tuple(self.blocks), tuple(self.loops))

    def allocation_events(self):
        """The run as the caching allocator would have seen it: (kind, handle, nbytes, stage) per tick in order,
        kind 0 = allocation, 1 = free, handle = the storage record (an allocation and its free share it), stage =
        the stage whose window the tick falls in (the next mark's name; ticks after the last mark: "end").
        Zero-byte storages are left out: the allocator is never asked for them."""
        import numpy as np

        tl = self.timeline()
        stages, bounds = [], []
        for t, st in tl.marks:
            bounds.append(t)
            stages.append(st)
        names = list(dict.fromkeys(stages + ["end"]))
        stage_of_tick = np.full(len(tl.kind), names.index("end"), dtype=np.int16)
        prev = 0
        for t, st in zip(bounds, stages):
            stage_of_tick[prev + 1:t + 1] = names.index(st)
            prev = t
        keep = (tl.kind != 0) & (tl.nbytes > 0)
        keep[0] = False
        kind = np.where(tl.kind[keep] > 0, 0, 1).astype(np.int8)
        return kind, tl.rec[keep].astype(np.int64), tl.nbytes[keep].astype(np.int64), stage_of_tick[keep], names

    def mark_stage(self, stage: str) -> None:
        """Close the current window as `stage`: its peak is the max since the previous mark."""
        self.marks.append((self._now, stage))
        best = self._stage_ticks.get(stage)
        if best is None or self._window_bytes > best[0]:
            self._stage_ticks[stage] = (self._window_bytes, self._window_tick)
        self._window_bytes, self._window_tick = self.current_bytes, self._now

    def breakdown_at(self, tick: int) -> dict:
        """Bytes per category of the storages live at `tick` (allocated at or before it, freed after)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for rec in self._records:
            if rec.t_alloc <= tick < rec.t_free:
                out[rec.role.category] += rec.nbytes
        return out

    def log(self) -> StageLog:
        """Peaks with their breakdowns; computed once, after the run, from the records."""
        stages = tuple(StagePeak(s, b, self.breakdown_at(t)) for s, (b, t) in self._stage_ticks.items())
        return StageLog(stages, StagePeak("overall", self.peak_bytes, self.breakdown_at(self._peak_tick)))


def per_tick(entries, n: int):
    """The value ticks 0..n-1 run under, from (tick t, value) entries (Timeline.blocks, .loops): the last entry with
    t below the tick, -1 for None or before any."""
    import numpy as np

    out = np.full(n, -1, dtype=np.int64)
    for t, v in sorted(entries, key=lambda x: x[0]):
        out[t + 1:] = -1 if v is None else int(v)
    return out


@dataclass(frozen=True)
class Timeline:
    """A counted run tick by tick. Tick t (1..T) is one allocation (kind +1) or one free (kind -1) of
    `nbytes[t]` bytes of a storage whose final role is `CATEGORIES[cat[t]]` (record `rec[t]`); tick 0 is the
    empty start. `marks` are (tick, stage that ended there); `blocks` are (tick, decoder-layer block or None);
    `loops` are (tick, iteration of a per-image loop, or None where it ended)."""

    kind: object      # np.ndarray[int8]
    nbytes: object    # np.ndarray[int64]
    cat: object       # np.ndarray[int8]
    rec: object       # np.ndarray[int64]
    marks: tuple
    blocks: tuple
    loops: tuple = ()

    def live(self):
        """(len(CATEGORIES), T + 1) int64 array: bytes live per category after each tick."""
        import numpy as np

        out = np.zeros((len(CATEGORIES), len(self.kind)), dtype=np.int64)
        np.add.at(out, (self.cat.astype(np.int64), np.arange(len(self.kind))), self.kind * self.nbytes)
        return np.cumsum(out, axis=1)


def _storage_exact_fake_cache() -> None:
    """FakeTensorMode's dispatch cache (torch/_subclasses/fake_tensor.py) rebuilds a cached output with
    `torch.empty_strided(shape, stride)`, whose storage ends where the view does, and never reads the storage size it
    recorded (`storage_bytes`). An op whose output is a slice of a larger buffer (CUDA's memory-efficient attention:
    its bias gradient and its mask copy padded to 16 columns, sliced back; a head dim padded to 8) then counts the
    whole buffer on a cache miss and all but the last row's padding on a hit: a trace's bytes depended on which ops
    ran before it in the process (a forked derivation of a T5 read 2-16 B more than the same traces in one process,
    docs/architectures.md). Such outputs are not cached: every one is counted as the kernel allocates it."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, _BypassDispatchCache

    original = FakeTensorMode._validate_output_for_cache_entry
    if getattr(original, "_willitfit", False):
        return

    def validate(self, state, key, func, args, kwargs, output):
        original(self, state, key, func, args, kwargs, output)
        if isinstance(output, FakeTensor) and output.numel() and output.layout == torch.strided:
            last = output.storage_offset() + sum((n - 1) * st for n, st in zip(output.shape, output.stride()))
            if output.untyped_storage().nbytes() > (last + 1) * output.element_size():
                raise _BypassDispatchCache("storage beyond the view")

    validate._willitfit = True
    FakeTensorMode._validate_output_for_cache_entry = validate


_storage_exact_fake_cache()


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in optimizer.state, including a wrapped inner optimizer's (mixed precision)."""
    out = []
    for opt in (optimizer, getattr(optimizer, "inner", None)):
        if opt is None:
            continue
        for state in opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        out.extend(getattr(opt, "master_params", ()))
    return out


def memtracker_peak_bytes(tracker) -> int:
    """Overall peak of torch's MemTracker (torch/distributed/_tools/mem_tracker.py), summed over devices."""
    snap = tracker.get_tracker_snapshot("peak")
    return sum(dev_snap["Total"] for dev_snap in snap.values())
