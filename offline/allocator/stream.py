"""The allocation-stream format: what a run asked of the allocator, in order. The tracer (traced tier) and the
GPU harness (measured tier) both write it; offline.allocator.replay reads it.

An event is (kind, handle, nbytes, stage): kind 0 = alloc, 1 = free; an alloc and its free share a handle, and a
handle may be reused after its free; nbytes is the request before rounding (for a free: the size that was
allocated); stage indexes `stage_names` (e.g. forward / backward / optimizer). `meta` is JSON provenance (source
traced or measured, model, workload, versions).

On disk: .npz (savez_compressed) with arrays kind int8, handle int64, nbytes int64, stage int16, and `header`,
a 0-d unicode array holding JSON {"format", "stage_names", "meta"}. Loaded with allow_pickle=False and validated
as untrusted input: every defect is one ValueError line.
"""
from __future__ import annotations

import bisect
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

FORMAT = "willitfit.allocation-stream/1"
MAX_NBYTES = 2**50              # 1 PiB: anything larger is a corrupt file, not a tensor
ALLOC, FREE = 0, 1
_ARRAYS = {"kind": np.int8, "handle": np.int64, "nbytes": np.int64, "stage": np.int16}


@dataclass(frozen=True, eq=False)
class Stream:
    kind: np.ndarray            # int8: 0 alloc, 1 free
    handle: np.ndarray          # int64: an alloc and its free share it
    nbytes: np.ndarray          # int64: requested bytes (before rounding)
    stage: np.ndarray           # int16: index into stage_names
    stage_names: tuple[str, ...] = ("all",)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        for name, dtype in _ARRAYS.items():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != dtype:
                raise ValueError(f"{name}: must be a 1-D numpy array of {np.dtype(dtype).name}")
        _validate(self)

    def __len__(self) -> int:
        return len(self.kind)

    @classmethod
    def from_events(cls, events: Iterable[tuple], meta: dict | None = None) -> Stream:
        """Build from (kind, handle, nbytes, stage_name) tuples; kind is 0/1 or 'alloc'/'free'. Stage names are
        numbered in order of first appearance."""
        kinds, handles, sizes, stages, names = [], [], [], [], {}
        for n, ev in enumerate(events):
            if len(ev) != 4:
                raise ValueError(f"events: event {n} must be (kind, handle, nbytes, stage_name), got {ev!r}")
            k, h, b, s = ev
            k = {"alloc": ALLOC, "free": FREE}.get(k, k)
            if k not in (ALLOC, FREE):
                raise ValueError(f"kind: event {n} has kind {ev[0]!r}; allowed 0/'alloc' or 1/'free'")
            kinds.append(k)
            handles.append(int(h))
            sizes.append(int(b))
            stages.append(names.setdefault(str(s), len(names)))
        return cls(np.array(kinds, np.int8), np.array(handles, np.int64), np.array(sizes, np.int64),
                   np.array(stages, np.int16), tuple(names) or ("all",), dict(meta or {}))

    def save(self, path) -> None:
        """Write the .npz to a path or a binary file object (the app keeps streams in memory)."""
        header = json.dumps({"format": FORMAT, "stage_names": list(self.stage_names), "meta": self.meta})
        arrays = dict(kind=self.kind, handle=self.handle, nbytes=self.nbytes, stage=self.stage, header=np.array(header))
        if hasattr(path, "write"):
            np.savez_compressed(path, **arrays)
            return
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Stream:
        """Read and validate a stream file (untrusted: no pickle, every field checked)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                names = set(z.files)
                if names != set(_ARRAYS) | {"header"}:
                    raise ValueError(f"stream file: arrays must be kind, handle, nbytes, stage, header; "
                                     f"got {', '.join(sorted(names)) or 'none'}")
                header = z["header"]
                arrays = {k: z[k] for k in _ARRAYS}
        except (OSError, zipfile.BadZipFile, EOFError) as e:
            raise ValueError(f"stream file: {path} is not a readable .npz ({type(e).__name__})") from None
        except ValueError as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(msg if msg.startswith("stream file") else f"stream file: {msg}") from None
        if header.ndim != 0 or header.dtype.kind != "U":
            raise ValueError("header: must be a 0-d unicode array holding JSON")
        try:
            head = json.loads(str(header))
        except json.JSONDecodeError:
            raise ValueError("header: is not valid JSON") from None
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            raise ValueError(f"header: format must be {FORMAT!r}")
        stage_names, meta = head.get("stage_names"), head.get("meta", {})
        if not isinstance(stage_names, list) or not all(isinstance(s, str) for s in stage_names):
            raise ValueError("stage_names: must be a list of strings")
        if not isinstance(meta, dict):
            raise ValueError("meta: must be a JSON object")
        for name, dtype in _ARRAYS.items():
            a = arrays[name]
            if a.ndim != 1 or a.dtype.kind not in "iu":
                raise ValueError(f"{name}: must be a 1-D integer array")
            if a.size and (a.min() < np.iinfo(dtype).min or a.max() > np.iinfo(dtype).max):
                raise ValueError(f"{name}: values do not fit {np.dtype(dtype).name}")
            arrays[name] = a.astype(dtype)
        return cls(**arrays, stage_names=tuple(stage_names), meta=meta)


def _validate(s: Stream) -> None:
    """Lengths equal, kinds 0/1, 0 <= nbytes < 2**50, stage indices in range, meta JSON; and, per handle, events
    alternate alloc, free, alloc, ... with each free naming the size of the alloc it ends (vectorised: sort by
    handle, then by position)."""
    n = len(s.kind)
    if not (len(s.handle) == len(s.nbytes) == len(s.stage) == n):
        raise ValueError(f"arrays: lengths differ (kind {n}, handle {len(s.handle)}, nbytes {len(s.nbytes)}, "
                         f"stage {len(s.stage)})")
    if not isinstance(s.stage_names, tuple) or not s.stage_names or \
            not all(isinstance(x, str) for x in s.stage_names):
        raise ValueError("stage_names: must be a non-empty tuple of strings")
    try:
        json.dumps(s.meta)
    except (TypeError, ValueError):
        raise ValueError("meta: must be JSON-serialisable") from None
    if n == 0:
        return
    if ((s.kind != ALLOC) & (s.kind != FREE)).any():
        raise ValueError(f"kind: event {int(np.flatnonzero((s.kind != 0) & (s.kind != 1))[0])} is not 0 or 1")
    bad = (s.nbytes < 0) | (s.nbytes >= MAX_NBYTES)
    if bad.any():
        raise ValueError(f"nbytes: event {int(np.flatnonzero(bad)[0])} is outside [0, 2**50)")
    bad = (s.stage < 0) | (s.stage >= len(s.stage_names))
    if bad.any():
        raise ValueError(f"stage: event {int(np.flatnonzero(bad)[0])} is outside 0..{len(s.stage_names) - 1}")
    order = np.lexsort((np.arange(n), s.handle))
    h, k, b = s.handle[order], s.kind[order], s.nbytes[order]
    first = np.ones(n, bool)
    first[1:] = h[1:] != h[:-1]
    starts = np.flatnonzero(first)
    position = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
    bad = k != (position & 1)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        what = "frees a handle that is not live" if k[j] == FREE else "allocates a handle that is still live"
        raise ValueError(f"handle: event {int(order[j])} {what} (handle {int(h[j])})")
    frees = np.flatnonzero(k == FREE)
    bad = b[frees] != b[frees - 1]
    if bad.any():
        j = int(frees[np.flatnonzero(bad)[0]])
        raise ValueError(f"nbytes: event {int(order[j])} frees handle {int(h[j])} with {int(b[j])} bytes but it "
                         f"was allocated with {int(b[j - 1])}")


def stream_from_snapshot(snapshot: dict, device: int | None = None, meta: dict | None = None,
                         stage_ends: list[tuple[int, str]] | None = None) -> Stream:
    """A Stream from a torch.cuda.memory._snapshot() dict recorded with _record_memory_history: its
    device_traces entries `alloc` (addr, size = the requested bytes) and `free_completed` (or, if the trace has
    none, `free_requested`); other actions (segment_*, oom, snapshot) are the allocator's own and are skipped.
    A free of an address allocated before recording began is dropped (counted in meta["dropped_frees"]).
    `stage_ends`: (time in microseconds, stage name) at the end of each stage, in order (the harness's stage
    boundaries); an entry belongs to the first stage ending at or after its `time_us`, entries after the last
    to "end". Without it (or without time_us in the entries) every event is in stage "trace".
    Format: torch/cuda/memory.py `_snapshot` docstring; TraceEntry in c10/core/CachingDeviceAllocator.h."""
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ValueError("snapshot: needs 'device_traces', a list (one per device) of lists of trace entries")
    used = [i for i, t in enumerate(traces) if t]
    if device is None:
        if len(used) > 1:
            raise ValueError(f"device: the snapshot has traces for devices {used}; pass device=")
        device = used[0] if used else 0
    if not 0 <= device < max(len(traces), 1):
        raise ValueError(f"device: {device} is not in the snapshot (devices 0..{len(traces) - 1})")
    trace = traces[device] if traces else []
    free_action = "free_completed" if any(_action(e) == "free_completed" for e in trace) else "free_requested"
    live: dict[int, tuple[int, int]] = {}
    events, next_handle, dropped = [], 0, 0
    times = [int(t) for t, _ in (stage_ends or [])]
    names = [str(s) for _, s in (stage_ends or [])]
    for n, e in enumerate(trace):
        action = _action(e)
        if action not in ("alloc", free_action):
            continue
        stage = _stage_of(e, times, names)
        addr, size = e.get("addr"), e.get("size")
        if not isinstance(addr, int) or not isinstance(size, int) or size < 0:
            raise ValueError(f"snapshot: trace entry {n} ({action}) needs integer addr and size >= 0")
        if action == "alloc":
            if addr in live:
                raise ValueError(f"snapshot: trace entry {n} allocates address {addr} twice without a free")
            live[addr] = (next_handle, size)
            events.append((ALLOC, next_handle, size, stage))
            next_handle += 1
        elif addr in live:
            handle, asked = live.pop(addr)
            events.append((FREE, handle, asked, stage))
        else:
            dropped += 1
    info = {"source": "measured", "from": "torch.cuda.memory._snapshot", "device": device,
            "free_action": free_action, "dropped_frees": dropped, "live_at_end": len(live)}
    info.update(meta or {})
    return Stream.from_events(events, info)


def _stage_of(entry: dict, times: list[int], names: list[str]) -> str:
    t = entry.get("time_us")
    if not times or not isinstance(t, int):
        return "trace"
    i = bisect.bisect_left(times, t)
    return names[i] if i < len(names) else "end"


def _action(entry) -> str | None:
    return entry.get("action") if isinstance(entry, dict) else None
