"""What torch reserves and what the device shows, from what the step allocates.

    reserved_bytes = allocated_bytes + min(allocated_bytes * r + c, allocated_bytes * q)
                                         (r, c, q per workload class and allocator mode)
    device_bytes   = reserved_bytes + CUDA context + NCCL buffers (more than one GPU)

A run fails when the CUDA caching allocator cannot get another segment, not when tensor bytes reach the card's
size: torch.cuda.memory_reserved (segments held by the allocator: live blocks, cached free blocks, the unused
tails of split segments) is what comes out of the device, and nvidia-smi adds the CUDA context and NCCL's buffers.

(r, c) come from data/allocator_fit.json, written by scripts/fit_reserved.py: traced runs' allocation streams
(tracer/counters.py allocation_events) replayed through the caching-allocator model
(offline/allocator, after c10/cuda/CUDACachingAllocator.cpp) under the default allocator and under
expandable_segments:True, one least-squares fit per workload class; docs/allocator.md has the method, the case set
and the residuals. q is the largest (reserved - allocated) / allocated any replayed case of the class showed: below
the fitted sizes c alone would dominate (a 10 MB model is not given the ~0.9 GiB of cached logits a 1B model's
step leaves), so the cache never exceeds the largest share that was seen. The file is read once and cached. No torch, no NumPy here: estimate() calls this per stage.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from estimator.spec import Parallel, Workload
from estimator.alloc_conf import AllocatorConfig, parse_alloc_conf

FIT_PATH = Path(__file__).resolve().parent.parent / "data" / "allocator_fit.json"
# the replayed cases behind the fit (docs, tests): kept apart so that an estimate reads a few KiB, not ~45 KiB
CASES_PATH = FIT_PATH.with_name("allocator_cases.json")
CLASSES = ("train-full", "train-lora", "train-fsdp", "infer")
MODES = ("default", "expandable")


def workload_class(w: Workload, p: Parallel) -> str:
    """The fitted class a workload falls in: inference (prefill + token-by-token decode: the KV cache grows by
    concatenation), LoRA/QLoRA training (frozen weights, small gradients and states), sharded training (FSDP
    all-gathers and frees whole layers' weights every step), or full training on one GPU's worth of parameters."""
    if w.mode == "infer":
        return "infer"
    if w.method in ("lora", "qlora"):
        return "train-lora"
    if p.strategy in ("fsdp", "zero3", "hsdp", "fsdp-grad-op"):
        return "train-fsdp"
    return "train-full"


@dataclass(frozen=True)
class ReservedFit:
    """reserved = allocated + min(allocated * ratio + const_bytes, allocated * max_ratio), fitted on `n` replayed
    cases of one class and mode."""
    workload_class: str
    mode: str                   # "default" | "expandable"
    ratio: float                # r: cached bytes per allocated byte
    const_bytes: int            # c
    n: int                      # cases the fit rests on
    median_rel_error: float     # |predicted - replayed| / replayed over those cases
    worst_rel_error: float
    max_ratio: float = float("inf")   # q: the largest (reserved - allocated) / allocated among those cases

    def cache_bytes(self, allocated_bytes: int) -> int:
        """reserved - allocated: the allocator's cached and split-off bytes on top of `allocated_bytes`."""
        fitted = round(allocated_bytes * self.ratio) + self.const_bytes
        if self.max_ratio != float("inf"):
            fitted = min(fitted, round(allocated_bytes * self.max_ratio))
        return max(0, fitted)

    def cache_bytes_array(self, allocated_bytes: np.ndarray) -> np.ndarray:
        """`cache_bytes` at many points (float64, whole bytes): the sweep's form of the same formula."""
        fitted = np.rint(allocated_bytes * self.ratio) + self.const_bytes
        if self.max_ratio != float("inf"):
            fitted = np.minimum(fitted, np.rint(allocated_bytes * self.max_ratio))
        return np.maximum(0.0, fitted)


def alloc_mode(alloc_conf: str) -> tuple[str, str | None]:
    """(fitted mode, note) for a PYTORCH_CUDA_ALLOC_CONF string, parsed as torch parses it (a bad string raises
    parse_alloc_conf's one-line ValueError). Only expandable_segments has its own fit; other keys that change
    device memory are priced as the mode they run in, and the note says so."""

    cfg = parse_alloc_conf(alloc_conf)
    mode = "expandable" if cfg.expandable_segments else "default"
    base = AllocatorConfig(expandable_segments=cfg.expandable_segments)
    changed = [k for k in ("max_split_size_bytes", "max_non_split_rounding_bytes", "large_segment_bytes",
                           "roundup_power2_divisions", "garbage_collection_threshold", "per_process_memory_fraction")
               if getattr(cfg, k) != getattr(base, k)]
    note = None
    if changed:
        note = (f"alloc-conf: {', '.join(changed)} not in the fitted classes; reserved priced as {mode} "
                f"(replay a stream with python -m bench replay --alloc-conf to see its effect)")
    return mode, note


def _max_ratios(cases: list[dict]) -> dict:
    """{(class, mode): largest (reserved - allocated) / allocated} over the replayed cases of the fit file."""
    out: dict = {}
    for c in cases:
        for mode in MODES:
            res, alloc = c.get(f"reserved_{mode}_bytes"), c.get("allocated_bytes")
            if res and alloc:
                key = (c["class"], mode)
                out[key] = max(out.get(key, 0.0), (res - alloc) / alloc)
    return out


@functools.cache
def _load(path: str) -> dict:
    """{(class, mode): ReservedFit}. Each fit carries its cap ("max_ratio", written by scripts/fit_reserved.py from
    the cases); a file from before that keeps its cases inline and the caps are computed from them."""
    doc = json.loads(Path(path).read_text())
    caps = _max_ratios(doc["cases"]) if "cases" in doc else {}
    fits = {}
    for cls, modes in doc["classes"].items():
        for mode, f in modes.items():
            cap = float(f["max_ratio"]) if "max_ratio" in f else caps.get((cls, mode), float("inf"))
            fits[(cls, mode)] = ReservedFit(cls, mode, float(f["ratio"]), int(f["const_bytes"]), int(f["n"]),
                                            float(f["median_rel_error"]), float(f["worst_rel_error"]), cap)
    return fits


def fit_for(w: Workload, p: Parallel, mode: str = "default", path: Path | None = None) -> ReservedFit:
    """The fit for this workload's class under `mode` (MODES)."""
    return fit_for_class(workload_class(w, p), mode, path)


def fit_for_class(cls: str, mode: str = "default", path: Path | None = None) -> ReservedFit:
    """The fit of one class (CLASSES) under `mode`; `path` defaults to FIT_PATH (read at call time)."""
    path = FIT_PATH if path is None else path
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not allowed; choose one of {', '.join(MODES)}")
    fits = _load(str(path))
    if (cls, mode) not in fits:
        raise ValueError(f"allocator_fit: {path} has no fit for class {cls!r} under {mode}; "
                         "run python scripts/fit_reserved.py")
    return fits[(cls, mode)]


def clear_tables() -> None:
    """Forget the data files read so far (they are read again on next use)."""
    _load.cache_clear()
